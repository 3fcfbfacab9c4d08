"""The model's shape and numerics, independent of the checkpoint layout it came from."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class GDNConfig:
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_k_heads: int
    num_v_heads: int
    head_k_dim: int
    head_v_dim: int
    intermediate_size: int
    conv_size: int = 4
    norm_eps: float = 1e-6
    # Decoder RMSNorms scale by (norm_offset + w): 0 for fla (w), 1 for Qwen3.5 (1 + w).
    norm_offset: float = 0.0
    tie_word_embeddings: bool = False
    gate_activation: str = "silu"  # output gate of the mixer's norm: "silu" or "sigmoid"
    allow_neg_eigval: bool = False  # beta = 2 * sigmoid(b): fla's negative-eigenvalue variant
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    max_position_embeddings: int | None = None
    source_layout: str = "unknown"  # "fla" or "qwen3_5": where the weights came from
    # Hybrid models (Qwen3.5): which layers are gated attention instead of GDN, and their shape.
    layer_types: tuple[str, ...] | None = None  # None: every layer "linear_attention"
    num_attention_heads: int = 0
    num_key_value_heads: int = 0
    attn_head_dim: int = 0
    rope_theta: float = 10000.0
    partial_rotary_factor: float = 1.0
    max_context: int = 4096  # length of each attention layer's static KV buffer
    # Qwen3.5's multi-token-prediction module (unimax.mtp): 0 (none loaded) or 1 layer, gated
    # attention of the shape above
    mtp_layers: int = 0

    def __post_init__(self) -> None:
        positive = ("vocab_size", "hidden_size", "num_hidden_layers", "num_k_heads",
                    "num_v_heads", "head_k_dim", "head_v_dim", "intermediate_size", "conv_size")
        for name in positive:
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"config {name} must be a positive integer, got {value!r}")
        if self.num_v_heads % self.num_k_heads:
            raise ValueError(f"config num_v_heads ({self.num_v_heads}) must be a multiple of "
                             f"num_k_heads ({self.num_k_heads})")
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_hidden_layers:
                raise ValueError(f"config has {len(self.layer_types)} layer_types for "
                                 f"{self.num_hidden_layers} layers")
            unknown = set(self.layer_types) - {"linear_attention", "full_attention"}
            if unknown:
                raise ValueError(f"unknown layer type {sorted(unknown)[0]!r}; supported: "
                                 "linear_attention, full_attention")
            if self.has_attention and min(self.num_attention_heads, self.num_key_value_heads,
                                          self.attn_head_dim) < 1:
                raise ValueError("attention layers need num_attention_heads, "
                                 "num_key_value_heads and attn_head_dim >= 1")
        if self.mtp_layers not in (0, 1):
            raise ValueError(f"config mtp_layers must be 0 or 1 (Qwen3.5's one MTP layer), got "
                             f"{self.mtp_layers!r}")
        if self.gate_activation not in ("silu", "sigmoid"):
            raise ValueError(f"config gate_activation must be 'silu' or 'sigmoid', "
                             f"got {self.gate_activation!r}")

    def is_attention(self, index: int) -> bool:
        return self.layer_types is not None and self.layer_types[index] == "full_attention"

    @property
    def has_attention(self) -> bool:
        return self.layer_types is not None and "full_attention" in self.layer_types

    @property
    def key_dim(self) -> int:
        return self.num_k_heads * self.head_k_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim

    @property
    def conv_dim(self) -> int:
        """Channels of the short conv: q, k and v side by side."""
        return 2 * self.key_dim + self.value_dim

    @property
    def in_proj_sizes(self) -> tuple[int, int, int, int, int, int]:
        """Rows of the merged input projection, in order: q, k, v, z (gate), b, a."""
        return (self.key_dim, self.key_dim, self.value_dim, self.value_dim,
                self.num_v_heads, self.num_v_heads)
