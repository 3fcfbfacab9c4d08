"""The fast decode step (``build_engine(compile_step=True)``): a view of the decode model whose
plain BF16 linears run the Triton GEMV at decode's few rows, compiled by inductor.

Why both: a plain captured step is ~1,400 small kernels (norms, gates, conv, reshapes as
separate launches); inductor fuses those, and then the projections are most of the step, where
cuBLAS's M=1 tiles read a 1024 x 8224 projection at ~1.5 TB/s (bench/profile_step.py). The GEMV
(ops/gemv.py) reads the same weights with nothing else. Prefill and verification (many rows) keep
cuBLAS; so does the CPU. The view shares every weight with the model it was made from.
"""

from __future__ import annotations

import importlib.util

import torch
from torch import nn

from . import fused_draft, kernels
from .fp8 import shallow_view
from .gemv_linear import GemvLinear
from .layers import GatedDeltaNetMixer, SwiGLUMLP
from .ops import gemv_swiglu, in_proj_tape
from .ops.gemv import GEMV_ROWS, PROGRAM_ROWS


class GemvSwiGLUMLP(SwiGLUMLP):
    """A view's MLP (the same two linears) whose gate-up product and SwiGLU run as one op
    (ops.gemv_swiglu: the activation in the tensor-core kernel's epilogue, or cuBLAS and one
    activation kernel, timed per shape) for the verifier's blocks: more than PROGRAM_ROWS and at
    most GEMV_ROWS rows, on CUDA, with the kernel configuration's ``swiglu_epilogue`` (read per
    call: an A/B builds a second engine with it off). One-token steps take unimax.fused_draft's
    folded forms; everything else the plain MLP."""

    def __init__(self, mlp: SwiGLUMLP):
        nn.Module.__init__(self)
        self.intermediate_size = mlp.intermediate_size
        self.gate_up_proj, self.down_proj = mlp.gate_up_proj, mlp.down_proj

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        if (kernels.active().swiglu_epilogue and x2.is_cuda
                and PROGRAM_ROWS < x2.shape[0] <= GEMV_ROWS):
            act = gemv_swiglu.small_m_swiglu(x2, self.gate_up_proj.weight)
            return self.down_proj(act.reshape(*x.shape[:-1], self.intermediate_size))
        return super().forward(x)


class GemvRecordingMixer(GatedDeltaNetMixer):
    """A view's GDN mixer (the same weights) whose in-projection writes the verifier's tape in
    its GEMM's epilogue when it records a verify block (ops.in_proj_tape, where that op is
    ``wanted``: the tape's kernel launch per layer gone); every other forward is the mixer's
    own."""

    def __init__(self, mixer: GatedDeltaNetMixer):
        nn.Module.__init__(self)
        self.__dict__.update(mixer.__dict__)  # (its settings, and its modules and parameters:)
        for table in ("_modules", "_parameters", "_buffers"):  # (tables of its own, shared
            setattr(self, table, dict(getattr(mixer, table)))  # entries: no weight copied)

    def forward(self, x: torch.Tensor, state) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        if not (in_proj_tape.wanted(x2) and self._block_record(x, state)):
            return super().forward(x, state)
        cfg = self.config
        projected = in_proj_tape.in_proj_tape(
            x2, self.in_proj.weight, state.conv_states[0], self.conv_weight, self.A_log,
            self.dt_bias, *state.tape.buffers, cfg.conv_dim, cfg.value_dim,
            cfg.allow_neg_eigval)
        parts = self._split(projected.reshape(*x.shape[:-1], -1))
        return self._gated_out(*self._core(*parts, state, tape_written=True))


def gemv_view(model, fuse: bool | None = None):
    """``model`` (exact, or an FP8 view) with every plain ``nn.Linear`` swapped for a GemvLinear
    on the same weight, each MLP whose gate-up became one for a GemvSwiGLUMLP and each GDN
    mixer whose in-projection did for a GemvRecordingMixer; FP8 linears
    already run their own GEMV, and with ``fuse`` (default: the kernel configuration's
    ``fuse_fp8``) the blocks holding them fold their small kernels into those GEMVs
    (unimax.fused_draft; the BF16 GEMVs' blocks too with its ``fuse_bf16``; the exact model
    itself never)."""
    view = shallow_view(model)
    names = [name for name, m in view.named_modules() if type(m) is nn.Linear]
    for name in names:
        parent_name, _, child = name.rpartition(".")
        parent = view.get_submodule(parent_name) if parent_name else view
        setattr(parent, child, GemvLinear(getattr(parent, child)))
    for block in getattr(view, "layers", ()):  # BF16 MLPs: gate-up and SwiGLU as one op
        if type(block.mlp) is SwiGLUMLP and isinstance(block.mlp.gate_up_proj, GemvLinear):
            block.mlp = GemvSwiGLUMLP(block.mlp)
        if type(block.mixer) is GatedDeltaNetMixer and isinstance(block.mixer.in_proj,
                                                                  GemvLinear):
            block.mixer = GemvRecordingMixer(block.mixer)  # (its tape in the in-projection)
    config = kernels.active()
    if config.fuse_fp8 if fuse is None else fuse:
        fused_draft.fuse_blocks(view, bf16=config.fuse_bf16)
    return view


def fast_step_unavailable(device: torch.device) -> str | None:
    """Why the fast step cannot run on ``device`` (a sentence for a warning), or None."""
    if device.type != "cuda":
        return (f"compile_step is for CUDA decoding; the model is on {device}, so the step runs "
                "uncompiled")
    if importlib.util.find_spec("triton") is None:
        return ("compile_step needs Triton (it comes with PyTorch's CUDA wheels on Linux); "
                "not importable here, so the step runs uncompiled")
    return None
