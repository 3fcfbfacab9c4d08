"""A bias-free linear that runs the Triton GEMV at decode's few rows on CUDA (ops.gemv), sharing
its weight with the linear it stands for: the fast step's views swap their plain linears for it
(unimax.fast_step), and folded blocks fold its prologues (unimax.fused_draft)."""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn

from .ops.gemv import GEMV_ROWS, small_m_linear


class GemvLinear(nn.Module):
    """A bias-free linear sharing ``linear``'s weight: the GEMV for up to GEMV_ROWS rows on
    CUDA, ``F.linear`` otherwise (the exact model's own path)."""

    fused = False  # set on a view's copy by fused_draft.fuse_blocks(bf16=True)

    def __init__(self, linear: nn.Linear):
        super().__init__()
        if linear.bias is not None:
            raise ValueError("GemvLinear supports bias-free linears only (every GDN linear is)")
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = linear.weight  # the same Parameter: no copy

    def forward(self, x):
        x2 = x.reshape(-1, self.in_features)
        if x2.is_cuda and x2.shape[0] <= GEMV_ROWS:
            y = small_m_linear(x2, self.weight)
        else:
            y = F.linear(x2, self.weight)
        return y.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, gemv"
