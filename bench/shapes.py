"""The real model shapes the benchmarks run with random weights."""

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from unimax import GDNConfig  # noqa: E402

# flash-linear-attention GDN 1.3B: 21 layers, hidden 2048, 6 heads x 256, expand_v 2.
GDN_1_3B = GDNConfig(vocab_size=32000, hidden_size=2048, num_hidden_layers=21, num_k_heads=6,
                     num_v_heads=6, head_k_dim=256, head_v_dim=512, intermediate_size=5632,
                     norm_offset=0.0, source_layout="fla")
# 24 pure-GDN layers with Qwen3.5-0.8B's sizes (tied 248k vocabulary).
GDN24_0_8B = GDNConfig(vocab_size=248320, hidden_size=1024, num_hidden_layers=24,
                       num_k_heads=16, num_v_heads=16, head_k_dim=128, head_v_dim=128,
                       intermediate_size=3584, norm_offset=1.0, tie_word_embeddings=True,
                       source_layout="qwen3_5")
# Qwen3.5-0.8B itself: the same GDN sizes, every 4th layer gated attention (8 heads, 2 KV heads
# of 256, rotary on a quarter of each head), KV buffers of 4096 tokens.
QWEN35_0_8B = GDNConfig(vocab_size=248320, hidden_size=1024, num_hidden_layers=24,
                        num_k_heads=16, num_v_heads=16, head_k_dim=128, head_v_dim=128,
                        intermediate_size=3584, norm_offset=1.0, tie_word_embeddings=True,
                        source_layout="qwen3_5",
                        layer_types=tuple("full_attention" if i % 4 == 3 else
                                          "linear_attention" for i in range(24)),
                        num_attention_heads=8, num_key_value_heads=2, attn_head_dim=256,
                        rope_theta=1e7, partial_rotary_factor=0.25, max_context=4096)
# ~4.2B, bandwidth-bound on the H200 too (8.5 GB per token): Qwen3.5-4B's sizes as pure GDN,
# and the Qwen3.5-4B-like hybrid (every 4th layer gated attention: 16 heads, 4 KV heads of 256).
# An L4 (300 GB/s) is bandwidth-bound at every shape here; these show it on the H200.
GDN_4B = GDNConfig(vocab_size=248320, hidden_size=2560, num_hidden_layers=32, num_k_heads=16,
                   num_v_heads=32, head_k_dim=128, head_v_dim=128, intermediate_size=9216,
                   norm_offset=1.0, tie_word_embeddings=True, source_layout="qwen3_5")
QWEN35_4B = dataclasses.replace(
    GDN_4B, layer_types=tuple("full_attention" if i % 4 == 3 else "linear_attention"
                              for i in range(32)),
    num_attention_heads=16, num_key_value_heads=4, attn_head_dim=256, rope_theta=1e7,
    partial_rotary_factor=0.25, max_context=2048)
# ~8B pure GDN (16 GB per token): gdn-4b's heads and depth with Qwen3-8B's widths (hidden
# 4096, MLP 12288). On the H200 a step's fixed costs (kernel ramps, small kernels: ~0.5-0.8 ms
# at 32 layers, bench/RESULTS.md, 2026-12-01) are a third of the 4B FP8 draft's time and
# shrink beside the bytes as layers widen: this shape is nearer the byte-bound regime an L4
# is in at every size.
GDN_8B = dataclasses.replace(GDN_4B, hidden_size=4096, intermediate_size=12288)
SHAPES = {"gdn-1.3b": GDN_1_3B, "gdn24-0.8b": GDN24_0_8B, "qwen3.5-0.8b": QWEN35_0_8B,
          "gdn-4b": GDN_4B, "qwen3.5-4b": QWEN35_4B, "gdn-8b": GDN_8B}


def decode_weight_bytes(model) -> int:
    """Bytes one batch-1 decode step must read: every weight once, the embedding only where it is
    the LM head itself (tied, unquantized); the input embedding row itself is negligible."""
    seen, total = set(), 0
    head = getattr(model.lm_head, "weight", None)
    embed_is_head = head is model.embed_tokens.weight
    for name, module in model.named_modules():
        for pname, tensor in list(module.named_parameters(recurse=False)) + list(
                module.named_buffers(recurse=False)):
            if name == "embed_tokens" and not embed_is_head:
                continue
            if pname == "weight_scale_row" or id(tensor) in seen:
                continue
            seen.add(id(tensor))
            total += tensor.numel() * tensor.element_size()
    return total
