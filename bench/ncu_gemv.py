"""Why the draft's fused FP8 GEMVs stream ~2.5 TB/s where the BF16 ones reach ~3.25 (GPU, under
Nsight Compute): each 4B decode linear with the draft's prologue and residual, at the tile the
timed choice took on the H200 (bench/RESULTS.md, fifteenth session), as FP8 and as BF16, and
FP8 without its prologue (what the prologue costs), FP8 and BF16 through the TMA forms
(ops.fused_gemv.TMA_FORMS: W's tiles pipelined into shared memory), the in-projection with the
convolution folded in (ops.in_proj_conv), each launched twice (the table reads the second);
then the FP8 LM head's plain GEMV, which streams ~4.3 TB/s in the step, for contrast.

usage: ncu --clock-control none --cache-control all -k regex:gemv --csv --page raw \
           --print-units base \
           --metrics "$(python3 bench/ncu_gemv.py --metrics)" python3 bench/ncu_gemv.py > F
       python3 bench/ncu_gemv.py --table F    the table: per launch its time, DRAM rate,
           occupancy, instructions per weight byte, and the warps' stall reasons
       (bash bench/gpu_bench.sh ncu runs both)
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gemv import linear_shapes  # noqa: E402
from shapes import SHAPES  # noqa: E402

from unimax.fp8 import quantize_rows  # noqa: E402
from unimax.ops.fused_gemv import fused_gemv  # noqa: E402
from unimax.ops.gemv import gemv  # noqa: E402

# linear (in a layer's order) -> (prologue, residual?, the FP8 kernel and the BF16 kernel the
# H200's timed choice took for gdn-4b, sixteenth session, with no TMA forms offered)
LINEARS = {
    "in_proj": ("rms", False, "rows16@16x256x4", "rows@16x256x4"),
    "out_proj": ("gated_silu", True, "rows@4x1024x4", "rows@4x512x4"),
    "gate_up": ("rms", False, "rows16@32x256x4", "rows@8x256x4"),
    "down": ("swiglu", True, "split16@16x512x8", "rows@4x1024x4"),
}


# the TMA forms at the tiles that came nearest the plain ones (bench/tma_gemv.py, sixteenth
# session): FP8 weights with FP16 and with fp32 products
TMA_KERNELS = ("tma16@32x256x4x4", "tma@32x256x4x4", "tma16@64x128x4x4", "tma@64x128x4x4")


def launches(cfg) -> list[tuple[str, str, int, int, str, bool, str]]:
    """(label, weight kind, N, K, prologue, residual?, kernel) in launch order."""
    sizes = linear_shapes(cfg)
    out = []
    for name, (prologue, residual, fp8, bf16) in LINEARS.items():
        n, k, _ = sizes[name]
        out.append((f"{name} fp8 {fp8}", "fp8", n, k, prologue, residual, fp8))
        out.append((f"{name} fp8-noprologue {fp8}", "fp8", n, k, "none", residual, fp8))
        out.append((f"{name} bf16 {bf16}", "bf16", n, k, prologue, residual, bf16))
        for tma in TMA_KERNELS:  # W through TMA, pipelined (ops.fused_gemv.TMA_FORMS)
            out.append((f"{name} fp8 {tma}", "fp8", n, k, prologue, residual, tma))
    fp8 = LINEARS["in_proj"][2]  # the in-projection with the convolution folded in
    n, k, _ = sizes["in_proj"]
    out.append((f"in_proj fp8+conv {fp8}", "fp8", n, k, "rms+conv", False, fp8))
    out.append(("lm_head fp8 rows16@16x256x4 (gemv)", "fp8", cfg.vocab_size, cfg.hidden_size,
                "head", False, "rows16@16x256x4"))
    return out


def run(label, kind, n, k, prologue, residual, kernel, head, conv_dim) -> None:
    conv = prologue == "rms+conv"  # (ops.in_proj_conv's form: its first conv_dim outputs)
    prologue = prologue.removesuffix("+conv")
    torch.manual_seed(0)
    base = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    weight, scale = quantize_rows(base) if kind == "fp8" else (base, None)
    width = 2 * k if prologue == "swiglu" else k  # (swiglu: gate then up)
    x = torch.randn(1, width, device="cuda", dtype=torch.bfloat16)
    z = torch.randn(1, k, device="cuda", dtype=torch.bfloat16) if prologue.startswith(
        "gated") else None
    norm = torch.rand(head if prologue.startswith("gated") else k, device="cuda",
                      dtype=torch.bfloat16) if prologue in ("rms", "gated_silu") else None
    r = torch.randn(1, n, device="cuda", dtype=torch.bfloat16) if residual else None
    state = torch.randn(1, conv_dim, 4, device="cuda", dtype=torch.bfloat16) if conv else None
    conv_w = torch.randn(conv_dim, 4, device="cuda", dtype=torch.bfloat16) if conv else None
    for _ in range(2):
        if prologue == "head":  # (the plain GEMV: unimax.ops.gemv)
            gemv(x, weight, scale, kernel=kernel)
            continue
        fused_gemv(x, weight, scale, n, k, prologue, norm_weight=norm, z=z, residual=r,
                   kernel=kernel, conv_state=state, conv_weight=conv_w)
    torch.cuda.synchronize()


STALLS = ("long_scoreboard", "lg_throttle", "wait", "math_pipe_throttle", "no_instruction",
          "not_selected", "selected", "short_scoreboard", "barrier", "branch_resolving",
          "dispatch_stall", "mio_throttle", "drain", "membar")
METRICS = ("gpu__time_duration.sum", "dram__bytes_read.sum",
           "dram__throughput.avg.pct_of_peak_sustained_elapsed",
           "sm__warps_active.avg.pct_of_peak_sustained_active", "launch__registers_per_thread",
           "launch__grid_size", "launch__block_size", "launch__occupancy_limit_registers",
           "sm__inst_executed.sum", "smsp__issue_active.avg.pct_of_peak_sustained_active",
           "smsp__average_warps_active_per_issue_active.ratio",
           *(f"smsp__average_warps_issue_stalled_{s}_per_issue_active.ratio" for s in STALLS))


def number(text: str) -> float:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return float("nan")


def table(path: Path, labels: list[str]) -> None:
    """ncu's raw CSV (one row per profiled launch, two per label) -> one line per label (its
    second launch): the cycles a warp waits per issued instruction, split by reason."""
    import csv

    lines = path.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith('"ID"'))
    rows = list(csv.DictReader(lines[start:]))[1:]  # (the row after the header: units)
    rows = [r for r in rows if "gemv" in r.get("Kernel Name", "")]
    print(f"{'launch':42} {'us':>6} {'TB/s':>5} {'dram%':>5} {'occ%':>5} {'regs':>4} "
          f"{'grid':>5} {'inst/B':>6} {'issue%':>6} {'cyc/is':>6}  top stalls (cycles/issue)")
    for label, pair in zip(labels, zip(rows[::2], rows[1::2], strict=True), strict=False):
        r = {k: number(v) for k, v in pair[1].items() if k in METRICS}
        us = r["gpu__time_duration.sum"] / 1e3  # (ns)
        stalls = sorted(((r[f"smsp__average_warps_issue_stalled_{s}_per_issue_active.ratio"], s)
                         for s in STALLS), reverse=True)[:4]
        print(f"{label:42} {us:6.2f} {r['dram__bytes_read.sum'] / us / 1e6:5.2f} "
              f"{r['dram__throughput.avg.pct_of_peak_sustained_elapsed']:5.1f} "
              f"{r['sm__warps_active.avg.pct_of_peak_sustained_active']:5.1f} "
              f"{r['launch__registers_per_thread']:4.0f} {r['launch__grid_size']:5.0f} "
              f"{r['sm__inst_executed.sum'] * 32 / r['dram__bytes_read.sum']:6.2f} "
              f"{r['smsp__issue_active.avg.pct_of_peak_sustained_active']:6.1f} "
              f"{r['smsp__average_warps_active_per_issue_active.ratio']:6.1f}  "
              + " ".join(f"{name} {value:.1f}" for value, name in stalls))


def main() -> None:
    cfg = SHAPES["gdn-4b"]
    plan = launches(cfg)
    if "--metrics" in sys.argv:
        print(",".join(METRICS))
    elif "--table" in sys.argv:
        table(Path(sys.argv[sys.argv.index("--table") + 1]), [row[0] for row in plan])
    else:
        for row in plan:
            run(*row, head=cfg.head_v_dim, conv_dim=cfg.conv_dim)


if __name__ == "__main__":
    main()
