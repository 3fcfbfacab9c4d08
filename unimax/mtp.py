"""Qwen3.5's multi-token-prediction module (``mtp.*`` in its checkpoints): a cheap predictor of
the token after next, the draft verified mode can check instead of a quantized copy of the
whole model.

At position t it takes the model's last hidden state h_t (after the final norm: the LM head's
input) and the embedding of the token t + 1, and predicts token t + 2:

    x = fc([pre_fc_norm_embedding(embed(token_{t+1})); pre_fc_norm_hidden(h_t)])
    x = layer(x)           one gated-attention decoder layer (Qwen3.5's full-attention layer,
                           its own KV over the positions it has seen)
    h'_t = norm(x)         -> lm_head (the model's, shared) -> logits of token t + 2

Chained, a draft of k tokens feeds h'_t back as the next step's hidden state with the token
it predicted: the checkpoint's one layer (``mtp_num_hidden_layers`` 1 in every Qwen3.5
release) reads about a tenth of a 4B step's bytes. The layout and the math follow the public
implementations (vLLM's qwen3_5_mtp.py, SGLang's and lightllm's Qwen3.5 / Qwen3-Next MTP
models): every norm is Qwen3.5's (1 + w) RMSNorm, the embedding's half comes first in the
concatenation, and the hidden state is the one after the model's final norm.

Its KV is by position, like the model's attention layers: entries at or past its cache's
position are never read, so a rejected draft is undone by setting the position back.
"""

from __future__ import annotations

import torch
from torch import nn

from .cache import AttentionStateSpec, RecurrentCache
from .config import GDNConfig
from .layers import GDNBlock
from .norms import RMSNorm


class MTPHead(nn.Module):
    """``mtp.*``: the two input norms, ``fc``, ``config.mtp_layers`` gated-attention decoder
    layers (their own KV: ``make_cache``) and the output norm. The embedding and the LM head
    are the model's."""

    def __init__(self, config: GDNConfig):
        super().__init__()
        if config.mtp_layers < 1:
            raise ValueError("MTPHead needs config.mtp_layers >= 1")
        if min(config.num_attention_heads, config.num_key_value_heads,
               config.attn_head_dim) < 1:
            raise ValueError("the MTP layer is gated attention: the config needs "
                             "num_attention_heads, num_key_value_heads and attn_head_dim >= 1")
        self.config = config
        hidden, eps, offset = config.hidden_size, config.norm_eps, config.norm_offset
        self.pre_fc_norm_embedding = RMSNorm(hidden, eps, offset)
        self.pre_fc_norm_hidden = RMSNorm(hidden, eps, offset)
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.layers = nn.ModuleList(GDNBlock(config, attention=True)
                                    for _ in range(config.mtp_layers))
        self.norm = RMSNorm(hidden, eps, offset)

    def make_cache(self, batch_size: int = 1) -> RecurrentCache:
        """The MTP layers' KV buffers (``config.max_context`` positions each) and their own
        position: a RecurrentCache of attention layers only."""
        cfg = self.config
        spec = AttentionStateSpec((cfg.num_key_value_heads, cfg.max_context, cfg.attn_head_dim))
        weight = self.fc.weight
        return RecurrentCache([spec] * cfg.mtp_layers, batch_size, weight.dtype, weight.device)

    def forward(self, hidden: torch.Tensor, next_embeds: torch.Tensor,
                cache: RecurrentCache | None = None) -> torch.Tensor:
        """``hidden`` (B, T, H): the model's normed hidden states at positions p .. p + T - 1;
        ``next_embeds`` (B, T, H): the embeddings of the tokens after each; ``cache``: the MTP
        KV, its position p (the entries before it are the positions already seen). Returns
        the MTP's normed hidden states (B, T, H), the LM head's input for the tokens two ahead.
        An eager forward: it reads exactly the entries stored and advances the position."""
        if hidden.shape != next_embeds.shape or hidden.dim() != 3:
            raise ValueError(f"MTP forward: hidden {tuple(hidden.shape)} and next_embeds "
                             f"{tuple(next_embeds.shape)} must both be (B, T, hidden)")
        if cache is None:
            return self.forward_unchecked(hidden, next_embeds, None)
        tokens = hidden.shape[1]
        if cache.seen_tokens + tokens > self.config.max_context:
            raise ValueError(f"the MTP KV would reach {cache.seen_tokens + tokens} positions, "
                             f"over max_context {self.config.max_context}")
        with cache.attending(cache.seen_tokens + tokens, exact=True):
            out = self.forward_unchecked(hidden, next_embeds, cache)
        cache.seen_tokens += tokens
        return out

    def forward_unchecked(self, hidden: torch.Tensor, next_embeds: torch.Tensor,
                          cache: RecurrentCache | None) -> torch.Tensor:
        """The forward without validation or host bookkeeping (graphs, hot loops): the cache's
        device position advances by the rows fed."""
        x = self.fc(torch.cat([self.pre_fc_norm_embedding(next_embeds),
                               self.pre_fc_norm_hidden(hidden)], dim=-1))
        for index, layer in enumerate(self.layers):
            x = layer(x, None if cache is None else cache.layers[index])
        if cache is not None:
            with torch.no_grad():
                cache.position.add_(hidden.shape[1])
        return self.norm(x)
