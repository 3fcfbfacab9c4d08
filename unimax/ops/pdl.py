"""Programmatic dependent launch (compute capability 9+) of the Triton GEMVs and tensor-core
GEMMs: whether a launch asks for it, and where its signal goes.

The engine's kernel configuration (unimax.kernels: ``pdl``, ``pdl_trigger``) says False,
True, "fp8" (FP8 weights only) or "auto"; under "auto" each owner of graphs (a decoder, the
verifier) times its blocks plain and with PDL and runs them inside ``auto_pdl`` with its
choice (unimax.graph.timed_pdl_choice). Read when a kernel launches, so when a graph is
captured.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

from .. import kernels
from ..kernels import PDL_SETTINGS, PDL_TRIGGERS
from .timing import interpreted

_AUTO = threading.local()  # what PDL "auto" means on this thread now (auto_pdl; else False)


@contextlib.contextmanager
def auto_pdl(setting: bool | str, trigger: str = "start") -> Iterator[None]:
    """Within the block, PDL "auto" means ``setting`` (one of PDL_SETTINGS) on this thread,
    signalled at ``trigger`` (one of PDL_TRIGGERS; where the configuration's ``pdl_trigger``
    is "auto"): a graph decoder runs (and so captures) its blocks in its own choice."""
    if setting not in PDL_SETTINGS:
        raise ValueError(f"auto_pdl: setting must be False, True or 'fp8', got {setting!r}")
    if trigger not in PDL_TRIGGERS:
        raise ValueError(f"auto_pdl: trigger must be 'start' or 'end', got {trigger!r}")
    saved = getattr(_AUTO, "setting", False), getattr(_AUTO, "trigger", "start")
    _AUTO.setting, _AUTO.trigger = setting, trigger
    try:
        yield
    finally:
        _AUTO.setting, _AUTO.trigger = saved


def pdl_wanted(weight: torch.Tensor) -> bool:
    """Whether the configuration's ``pdl`` asks for programmatic launch of a GEMV over
    ``weight`` ("auto": what the ``auto_pdl`` block around the launch says, else no)."""
    pdl = kernels.active().pdl
    setting = getattr(_AUTO, "setting", False) if pdl == "auto" else pdl
    if setting == "fp8":
        return weight.element_size() == 1
    return bool(setting)


def pdl_trigger() -> str:
    """Where a programmatic launch now signals the next kernel: the configuration's
    ``pdl_trigger`` where it is set; "auto": the ``auto_pdl`` block's trigger under ``pdl``
    "auto", else the start."""
    config = kernels.active()
    if config.pdl_trigger != "auto":
        return config.pdl_trigger
    return getattr(_AUTO, "trigger", "start") if config.pdl == "auto" else "start"


def auto_triggers() -> tuple[str, ...]:
    """The triggers PDL "auto" times a candidate setting with: both, or the configuration's
    ``pdl_trigger`` where it is set (a bench's A/B)."""
    return PDL_TRIGGERS if kernels.active().pdl_trigger == "auto" else (pdl_trigger(),)


def pdl_label(setting: bool | str, trigger: str = "start") -> str:
    """A setting's name in the timed choices' tables: "False" (plain), "True" or "fp8"
    signalled at the start, "True@end" or "fp8@end" at the end."""
    return str(setting) if not setting or trigger == "start" else f"{setting}@{trigger}"


def pdl_possible(device: torch.device) -> bool:
    """Whether a launch on ``device`` can be programmatic (``pdl_launch``'s condition)."""
    return device.type == "cuda" and not interpreted() and \
        torch.cuda.get_device_capability(device)[0] >= 9


def pdl_launch(x: torch.Tensor, weight: torch.Tensor) -> dict:
    """The launch's PDL arguments: on (``pdl_wanted``) only on CUDA devices of compute
    capability 9+ (an L4, 8.9, has no programmatic dependent launch), never in the
    interpreter (no PTX)."""
    on = pdl_wanted(weight) and pdl_possible(x.device)
    if not on:
        return {}
    return {"PDL": True, "PDL_LATE": pdl_trigger() == "end", "launch_pdl": True}
