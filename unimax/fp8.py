"""FP8 linear layers and the quantized views of a model: the state-safe tail and the full draft.

An FP8Linear holds float8_e4m3fn weights with one scale per output channel. On CUDA with FP8
(compute capability >= 8.9: L4, H100/H200) the default, ``fp8_gemv``, keeps the activations in
BF16 and streams the FP8 weights through a Triton GEMV at decode's M <= 4 (ops/gemv.py): on
the H200 x1.69 faster than BF16 on a 248k-row LM head, where cuBLAS's FP8 GEMM with per-token
activation quantization (``fp8_act``, ``fp8_tensorwise``; kept for measurement) gained x1.02 and
lost on the MLP (RESULTS.md). Elsewhere ("emulated") the same function runs in plain torch from
the same stored weights and scales: dequantize, fp32 matmul. ``emulated_act`` is the plain twin
of ``fp8_act`` (quantized activations); ``weight_only`` dequantizes and runs a BF16 matmul.

Quantization is a module swap on a *view*: a shallow copy of the module tree that shares every
parameter with the exact model, with only the chosen Linear modules replaced. The exact model is
never modified and the network is never copied.
"""

from __future__ import annotations

import copy
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from .ops.gemv import GEMV_ROWS, gemv_ref, small_m_linear

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448
FP8_KERNELS = ("fp8_gemv", "fp8_act", "fp8_tensorwise", "weight_only", "emulated", "emulated_act")
_warned: set[str] = set()


def fp8_supported(device: torch.device) -> bool:
    return (device.type == "cuda" and torch.cuda.is_available()
            and torch.cuda.get_device_capability(device) >= (8, 9))


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row absmax scaling: x ~= q * scale[:, None]. x (M, K) -> q (M, K) fp8, scale (M,)."""
    amax = x.abs().amax(dim=-1).float().clamp(min=1e-12)
    scale = amax / FP8_MAX
    q = (x.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


class FP8Linear(nn.Module):
    """y = x W^T with W stored in FP8 (N, K) and per-output-channel fp32 scales (N,)."""

    def __init__(self, linear: nn.Linear, mode: str | None = None):
        super().__init__()
        if linear.bias is not None:
            raise ValueError("FP8Linear supports bias-free linears only (every GDN linear is)")
        weight = linear.weight.detach()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # _scaled_mm wants both matrix dims divisible by 16: pad the weight with zero rows
        # (e.g. a merged q/k/v/z/b/a projection; sliced off after the matmul) and zero columns
        # (the input gets as many zero columns per call: only odd, small shapes pay for that).
        pad_rows = (-self.out_features) % 16
        self.pad_cols = (-self.in_features) % 16
        weight = F.pad(weight, (0, self.pad_cols, 0, pad_rows))
        q, scale = quantize_rows(weight)
        self.register_buffer("weight", q)
        self.register_buffer("weight_scale", scale)
        self.register_buffer("weight_scale_row", scale[None, :].contiguous())  # (1, N)
        self.mode = mode or default_mode(weight.device)
        if self.mode not in FP8_KERNELS:
            raise ValueError(f"unknown FP8 mode {self.mode!r}; use one of "
                             f"{', '.join(FP8_KERNELS)}")
        self.rowwise = True  # _scaled_mm with (M,1) x (1,N) scales; off if the GPU lacks it

    @property
    def is_emulated(self) -> bool:
        return self.mode.startswith("emulated")

    def dequantized_weight(self, dtype: torch.dtype) -> torch.Tensor:
        return (self.weight.float() * self.weight_scale[:, None]).to(dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, self.in_features)
        if self.pad_cols:
            x2 = F.pad(x2, (0, self.pad_cols))
        if self.mode == "fp8_act":
            y = self._scaled_mm(x2)
        elif self.mode == "fp8_tensorwise":
            y = self._scaled_mm_tensorwise(x2, *quantize_rows(x2))
        elif self.mode in ("fp8_gemv", "emulated"):
            if not x2.is_cuda or self.mode == "emulated":
                y = gemv_ref(x2, self.weight, self.weight_scale)
            elif x2.shape[0] <= GEMV_ROWS:
                y = small_m_linear(x2, self.weight, self.weight_scale)
            else:  # the same function for larger M: FP8 weights, BF16 activations
                y = F.linear(x2, self.dequantized_weight(x.dtype))
        elif self.mode == "weight_only":
            y = F.linear(x2, self.dequantized_weight(x.dtype))
        else:  # emulated_act
            # The same numbers as fp8_act: quantized activations times quantized weights.
            q, scale = quantize_rows(x2)
            y = (q.float() * scale[:, None]) @ self.dequantized_weight(torch.float32).t()
            y = y.to(x.dtype)
        if y.shape[-1] != self.out_features:
            y = y[:, : self.out_features]
        return y.reshape(*shape[:-1], self.out_features)

    def _scaled_mm(self, x2: torch.Tensor) -> torch.Tensor:
        q, scale = quantize_rows(x2)
        if self.rowwise:
            try:
                return torch._scaled_mm(q, self.weight.t(), scale_a=scale[:, None],
                                        scale_b=self.weight_scale_row, out_dtype=x2.dtype)
            except RuntimeError:
                # Some builds / GPUs have no row-wise kernel. Decided at warm-up, before capture.
                self.rowwise = False
        return self._scaled_mm_tensorwise(x2, q, scale)

    def _scaled_mm_tensorwise(self, x2, q, scale):
        """Unit tensor-wise scales (the plain cuBLAS FP8 GEMM), then the per-token and
        per-channel scales as one multiply of the fp32 output. Benchmarked against row-wise."""
        one = torch.ones((), device=x2.device, dtype=torch.float32)
        y = torch._scaled_mm(q, self.weight.t(), scale_a=one, scale_b=one,
                             out_dtype=torch.float32)
        return (y * scale[:, None] * self.weight_scale_row).to(x2.dtype)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, mode={self.mode}"


def default_mode(device: torch.device) -> str:
    if fp8_supported(device):
        return "fp8_gemv"
    if device.type == "cuda" and "no-fp8" not in _warned:
        _warned.add("no-fp8")
        cap = ".".join(map(str, torch.cuda.get_device_capability(device)))
        warnings.warn(f"FP8 was requested but this GPU (compute capability {cap}) has no FP8 "
                      "matmul (needs 8.9+); FP8 layers are emulated with dequantized weights, "
                      "which is slower than BF16", stacklevel=3)
    return "emulated"


def shallow_view(module: nn.Module) -> nn.Module:
    """A new module tree whose every parameter and buffer *is* the original's (same storage)."""
    view = copy.copy(module)
    view._parameters = dict(module._parameters)
    view._buffers = dict(module._buffers)
    view._modules = {name: shallow_view(child) if child is not None else None
                     for name, child in module._modules.items()}
    return view


def tail_linear_names(model) -> list[str]:
    """The state-safe tail: the final block's MLP and the LM head. Nothing after the last token
    mixer writes recurrent state, so quantizing these changes logits, never a state."""
    last = f"layers.{len(model.layers) - 1}.mlp"
    return [f"{last}.gate_up_proj", f"{last}.down_proj", "lm_head"]


def quantize_view(model, kind: str = "tail", mode: str | None = None,
                  store: dict | None = None):
    """The model with FP8 linears: ``tail`` (state-safe) or ``full`` (every linear: a draft for
    verified mode only, since it changes the states), or ``int4``: the full draft with its body
    in 4 bits (unimax.int4: every linear but the LM head, which stays FP8; one whose columns no
    int4 group divides stays FP8 too). ``store``: quantized linears by (name, storage, mode),
    shared by every view made with it (unimax.exact.ExactSide.quantized: the tail's FP8 LM
    head and last MLP are the full draft's too, stored once)."""
    if kind == "tail":
        names = tail_linear_names(model)
    elif kind in ("full", "int4"):  # (the MTP module, if any, is no part of a decode step)
        names = [name for name, m in model.named_modules()
                 if isinstance(m, nn.Linear) and not name.startswith("mtp.")]
    else:
        raise ValueError(f"unknown quantization kind {kind!r}; use 'tail', 'full' or "
                         "'int4'")
    view = shallow_view(model)
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = view.get_submodule(parent_name) if parent_name else view
        linear = getattr(parent, child)
        head = name == "lm_head"
        if store is None:
            setattr(parent, child, draft_linear(linear, kind, head, mode))
            continue
        key = (name, "int4" if kind == "int4" and not head else "fp8", mode)
        if key not in store:
            store[key] = draft_linear(linear, kind, head, mode)
        setattr(parent, child, store[key])
    view.quantized = kind
    return view


def draft_linear(linear: nn.Linear, kind: str, head: bool, mode: str | None) -> nn.Module:
    """``linear`` as the ``kind`` view stores it: int4 for the int4 draft's body where a group
    divides its columns, FP8 otherwise."""
    if kind == "int4" and not head:
        from .int4 import Int4Linear, group_for  # (int4 builds on the ops, not on this module)

        group = group_for(linear.in_features)
        if group is not None:
            return Int4Linear(linear, group)
    return FP8Linear(linear, mode=mode)
