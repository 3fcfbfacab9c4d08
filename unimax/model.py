"""The causal LM: HF-style forward for prefill / verify, one-token greedy step, the cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from .cache import AttentionStateSpec, LayerStateSpec, RecurrentCache
from .config import GDNConfig
from .layers import GDNBlock
from .mtp import MTPHead
from .norms import RMSNorm
from .ops.conv import conv_window_after
from .ops.gated_delta import first_steps_only, gated_delta_rule
from .ops.short_recurrence import rewind_states_
from .tape import Tape


@dataclass
class CausalLMOutput:
    logits: torch.Tensor  # (B, T_kept, vocab)
    past_key_values: RecurrentCache | None = None
    hidden: torch.Tensor | None = None  # (B, T_kept, hidden) after the final norm, if asked


class GDNForCausalLM(nn.Module):
    """A pure Gated DeltaNet LM. Call it like a transformers model:
    ``model(input_ids=, past_key_values=, use_cache=, logits_to_keep=)``.

    With a cache the forward continues from the cached state for any number of new tokens and
    folds them into it; ``logits_to_keep=0`` returns every position's logits, k > 0 the last k.
    """

    def __init__(self, config: GDNConfig):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(GDNBlock(config, config.is_attention(i))
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.norm_eps, config.norm_offset)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        # Qwen3.5's next-next-token predictor, where the checkpoint has one (unimax.mtp)
        self.mtp = MTPHead(config) if config.mtp_layers else None

    # --- the seed's model API -------------------------------------------------------------

    def get_input_embeddings(self) -> nn.Embedding:
        return self.embed_tokens

    @property
    def device(self) -> torch.device:
        return self.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.embed_tokens.weight.dtype

    def layer_state_specs(self) -> list[LayerStateSpec | AttentionStateSpec]:
        cfg = self.config
        spec = LayerStateSpec(conv_shape=(cfg.conv_dim, cfg.conv_size),
                              recurrent_shape=(cfg.num_v_heads, cfg.head_k_dim, cfg.head_v_dim))
        kv = AttentionStateSpec((cfg.num_key_value_heads, cfg.max_context, cfg.attn_head_dim))
        return [kv if cfg.is_attention(i) else spec for i in range(cfg.num_hidden_layers)]

    def make_recurrent_cache(self, batch_size: int = 1) -> RecurrentCache:
        return RecurrentCache(self.layer_state_specs(), batch_size, self.dtype, self.device)

    def forward(self, input_ids: torch.Tensor, past_key_values: RecurrentCache | None = None,
                use_cache: bool = False, logits_to_keep: int = 0,
                return_hidden: bool = False) -> CausalLMOutput:
        """``return_hidden``: every position's hidden state after the final norm too (the LM
        head's input, which the MTP module reads), whatever ``logits_to_keep`` keeps."""
        self.check_input_ids(input_ids)
        cache = past_key_values
        if cache is None and use_cache:
            cache = self.make_recurrent_cache(input_ids.shape[0])
        if cache is not None:
            self.check_cache(cache, input_ids.shape[0])
            self.check_room(cache, input_ids.shape[1])
        if logits_to_keep < 0:
            raise ValueError(f"logits_to_keep must be >= 0 (0 keeps all), got {logits_to_keep}")
        keep = 0 if return_hidden else logits_to_keep
        if cache is None:
            hidden = self.normed_hidden_unchecked(input_ids, None, keep)
        else:
            # Eager: attention reads exactly the KV entries stored after this call, no more.
            with cache.attending(cache.seen_tokens + input_ids.shape[1], exact=True):
                hidden = self.normed_hidden_unchecked(input_ids, cache, keep)
            cache.seen_tokens += input_ids.shape[1]
        kept = hidden[:, -logits_to_keep:] if return_hidden and logits_to_keep else hidden
        return CausalLMOutput(self.lm_head(kept), cache, hidden if return_hidden else None)

    def forward_with_hidden_unchecked(self, input_ids: torch.Tensor,
                                      cache: RecurrentCache | None,
                                      logits_to_keep: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """``forward_unchecked``'s logits and the kept positions' normed hidden states: the
        verifier's forward where the MTP module drafts (it reads them)."""
        hidden = self.normed_hidden_unchecked(input_ids, cache, logits_to_keep)
        return self.lm_head(hidden), hidden

    def forward_unchecked(self, input_ids: torch.Tensor, cache: RecurrentCache | None,
                          logits_to_keep: int = 0,
                          keep_rows: torch.Tensor | None = None) -> torch.Tensor:
        """The forward with no validation, no host sync and no Python-side bookkeeping (the
        caller keeps ``cache.seen_tokens``): for graph capture, compilation and hot loops whose
        inputs are known good (tokens the model itself produced). ``keep_rows`` (a device
        index tensor): logits of those positions only (a padded prompt's last real token)."""
        return self.lm_head(self.normed_hidden_unchecked(input_ids, cache, logits_to_keep,
                                                         keep_rows))

    def normed_hidden_unchecked(self, input_ids: torch.Tensor, cache: RecurrentCache | None,
                                logits_to_keep: int = 0,
                                keep_rows: torch.Tensor | None = None) -> torch.Tensor:
        """``forward_unchecked`` up to the LM head: the kept positions' hidden states after
        the final norm."""
        hidden = self.embed_tokens(input_ids)
        for index, block in enumerate(self.layers):
            hidden = block(hidden, None if cache is None else cache.layers[index])
        if cache is not None:
            with torch.no_grad():
                # on the device: graph-safe (a padded forward counts its real tokens only)
                cache.position.add_(input_ids.shape[1] if cache.valid is None else cache.valid)
        if keep_rows is not None:
            hidden = hidden.index_select(1, keep_rows)
        elif logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        return self.norm(hidden)

    def make_tape(self, max_tokens: int) -> Tape:
        """The verifier's tape (unimax.tape) for forwards of up to ``max_tokens`` tokens."""
        cfg = self.config
        is_gdn = [not cfg.is_attention(i) for i in range(cfg.num_hidden_layers)]
        return Tape(is_gdn, max_tokens, cfg.conv_dim, cfg.num_k_heads, cfg.head_k_dim,
                    cfg.num_v_heads, cfg.head_v_dim, self.dtype, self.device)

    def rewind_unchecked(self, cache: RecurrentCache, before: RecurrentCache, tape: Tape,
                         length: int | torch.Tensor, span: int | None = None,
                         copy_to: RecurrentCache | None = None) -> None:
        """Set ``cache`` to the state after the first ``length`` tokens of the forward that
        recorded ``tape`` starting from the state ``before``: every GDN layer at once (layers
        as the batch: the conv window over the taped inputs, the recurrence over the taped
        steps), attention layers by position (entries past it are never read). No weight is
        read, no host sync.

        ``length`` may be a device scalar (a graph per ``span``, not per length: the short
        prefill's padded buckets): the recurrence then runs over the first ``span`` taped
        steps with those at or past ``length`` masked out (g = 0 and beta = 0 leave a GDN state
        exactly as it was), and the conv window is gathered at ``length``.

        ``copy_to`` (the verifier's blocks): the recurrence starts from ``cache``'s own GDN
        states, which the recording forward left as they were before the block (it writes the
        tape only), and keeps them in ``before``'s, whose conv states and position the caller
        copied; the new states go to ``cache`` and to ``copy_to`` (the draft's cache, whose conv
        states and position the caller copies after). On CUDA that is one kernel over the
        states (ops.short_recurrence.rewind_states_) instead of a snapshot and two copies of
        them; elsewhere the same steps one by one."""
        cfg = self.config
        n = tape.conv_input.shape[0]  # GDN layers, in the cache's flat-buffer order
        on_device = isinstance(length, torch.Tensor)
        span = span if on_device else length
        with torch.no_grad():
            if n:
                conv_shape = (n, cfg.conv_dim, cfg.conv_size)
                rec_shape = (n, cfg.num_v_heads, cfg.head_k_dim, cfg.head_v_dim)
                before_conv = before.conv_buffer.view(conv_shape)
                inputs = tape.conv_input[:, :span]
                q, k, v, g, beta = tape.recurrence_inputs(span)
                if on_device:
                    window = conv_window_after(before_conv, inputs, length)
                    g, beta = first_steps_only(g, beta, length)
                else:
                    window = torch.cat([before_conv.to(inputs.dtype), inputs.transpose(1, 2)],
                                       dim=-1)[..., -cfg.conv_size:]
                cache.conv_buffer.view(conv_shape).copy_(window)
                backend = next(b.mixer.backend for b in self.layers
                               if hasattr(b.mixer, "backend"))
                state, saved = (c.recurrent_buffer.view(rec_shape) for c in (cache, before))
                if copy_to is None:
                    _, recurrent = gated_delta_rule(q, k, v, g, beta, saved, backend=backend)
                    state.copy_(recurrent)
                else:
                    copy = copy_to.recurrent_buffer.view(rec_shape)
                    if backend not in ("auto", "fla") or not rewind_states_(
                            q, k, v, g, beta, state, saved, copy):
                        saved.copy_(state)  # the same, step by step
                        _, recurrent = gated_delta_rule(q, k, v, g, beta, saved,
                                                        backend=backend)
                        state.copy_(recurrent)
                        copy.copy_(recurrent)
            cache.position.copy_(before.position + length)

    @torch.inference_mode()
    def greedy_step(self, token: torch.Tensor, cache: RecurrentCache) -> torch.Tensor:
        """Feed one token per sequence (B, 1), return the argmax next token (B, 1)."""
        if token.dim() != 2 or token.shape[1] != 1:
            raise ValueError(f"greedy_step takes one token per sequence, shape (B, 1); "
                             f"got shape {tuple(token.shape)}")
        logits = self(input_ids=token, past_key_values=cache, use_cache=True,
                      logits_to_keep=1).logits
        return logits[:, -1].argmax(dim=-1, keepdim=True)

    # --- validation: clear errors instead of index errors from inside a kernel --------------

    def check_input_ids(self, input_ids: torch.Tensor) -> None:
        if not isinstance(input_ids, torch.Tensor):
            raise TypeError(f"input_ids must be a torch.Tensor of token ids, "
                            f"got {type(input_ids).__name__}")
        if input_ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"input_ids must hold integer token ids (int64), got {input_ids.dtype}")
        if input_ids.dim() != 2:
            raise ValueError(f"input_ids must have shape (batch, tokens), "
                             f"got shape {tuple(input_ids.shape)}")
        if input_ids.shape[1] == 0:
            raise ValueError("empty prompt: input_ids has no tokens; give at least one token")
        vocab = self.config.vocab_size
        bad = (input_ids < 0) | (input_ids >= vocab)
        if bool(bad.any()):
            row, col = (int(i) for i in bad.nonzero()[0])
            raise ValueError(f"token id {int(input_ids[row, col])} at position {col} of sequence "
                             f"{row} is outside the vocabulary [0, {vocab}); check the tokenizer "
                             "matches the model")

    def check_cache(self, cache: RecurrentCache, batch_size: int) -> None:
        if not isinstance(cache, RecurrentCache):
            raise TypeError(f"past_key_values must be a RecurrentCache from "
                            f"model.make_recurrent_cache(), got {type(cache).__name__}")
        if cache.batch_size != batch_size:
            raise ValueError(f"cache was made for batch size {cache.batch_size} but input_ids has "
                             f"batch size {batch_size}; use model.make_recurrent_cache("
                             f"batch_size={batch_size})")
        if cache.specs != self.layer_state_specs():
            raise ValueError("cache was made for a model of another shape; use this model's "
                             "make_recurrent_cache()")
        if cache.device != self.device:
            raise ValueError(f"cache lives on {cache.device} but the model on {self.device}")

    def check_room(self, cache: RecurrentCache, new_tokens: int) -> None:
        """Attention layers hold at most config.max_context tokens: refuse before overflowing."""
        if cache.has_attention and cache.seen_tokens + new_tokens > self.config.max_context:
            raise ValueError(f"the conversation would reach {cache.seen_tokens + new_tokens} "
                             f"tokens, over this model's context of {self.config.max_context} "
                             "(max_context): start a new conversation or raise max_context")

    def set_backend(self, backend: str) -> None:
        """Choose the gated delta rule kernel for every layer ('auto', 'fla', 'chunk',
        'recurrent'); the tests and benchmarks compare them on the same weights."""
        for block in self.layers:
            if hasattr(block.mixer, "backend"):
                block.mixer.backend = backend

    @classmethod
    def random(cls, config: GDNConfig, device: torch.device | str = "cpu",
               dtype: torch.dtype = torch.float32, seed: int = 0) -> GDNForCausalLM:
        """A model with deterministic random weights in realistic ranges, built directly on
        ``device`` (tests, benchmarks, the tiny preset). The gate parameters stay fp32."""
        with torch.device("meta"):
            model = cls(config)
        model.to_empty(device=device)
        if config.tie_word_embeddings:  # to_empty gives each module its own tensor: re-tie
            model.lm_head.weight = model.embed_tokens.weight
        for name, param in model.named_parameters():
            if not name.endswith(("A_log", "dt_bias")):
                param.data = param.data.to(dtype)
        model.init_random_weights(seed)
        return model.eval()

    @torch.no_grad()
    def init_random_weights(self, seed: int = 0, std: float = 0.02) -> None:
        """Deterministic random weights (per seed and device type) in realistic ranges."""
        gen = torch.Generator(device=self.device).manual_seed(seed)
        for name, param in self.named_parameters():
            shape, dev = param.shape, param.device
            if name.endswith("A_log"):
                values = torch.empty(shape, device=dev).uniform_(1.0, 16.0, generator=gen).log()
            elif name.endswith("dt_bias"):
                values = torch.empty(shape, device=dev).uniform_(-4.0, 0.0, generator=gen)
            elif name.endswith(("norm.weight", "q_norm.weight", "k_norm.weight")):
                base = 0.0 if self.config.norm_offset else 1.0
                values = base + 0.1 * torch.randn(shape, device=dev, generator=gen)
            elif name.endswith("conv_weight"):
                values = 0.3 * torch.randn(shape, device=dev, generator=gen)
            else:
                values = std * torch.randn(shape, device=dev, generator=gen)
            param.copy_(values.to(param.dtype))
