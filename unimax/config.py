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
        if self.gate_activation not in ("silu", "sigmoid"):
            raise ValueError(f"config gate_activation must be 'silu' or 'sigmoid', "
                             f"got {self.gate_activation!r}")

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
