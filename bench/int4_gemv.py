"""What an int4 draft body's linears would cost at M = 1 (GPU), beside the FP8 ones the draft
runs now and the BF16 ones of the exact step: the measurement bench/draft_bits.py's acceptance
figures wait for (an int4 body with group scales and the LM head at FP8 kept 0.94 of the demo
model's drafts against FP8's 0.963; the block model says that buys ~1.47x BF16-only at 4B and
acceptance 0.95 against FP8's 1.16x, if an int4 GEMV runs near its bytes). What it measured
(bench/RESULTS.md, thirty-ninth and fortieth sessions): only the half2x form, with x made ready
before the kernel, runs near its bytes (0.82 of the bandwidth; the 4B body 1041 us a step
against the fused FP8 forms' 1481).

Per draft linear of a shape (in_proj, out_proj, gate_up, down), in CUDA-graph replays over
weight copies (ops.timing.graph_us, as the engine's timed choices):
  bf16      cuBLAS (F.linear)
  fp8       the draft's fused FP8 GEMV at its timed choice (prologue and residual included,
            as unimax.fused_draft runs it), and the plain FP8 GEMV (ops.gemv "rows")
  int4/G    torch's tinygemm (aten._weight_int4pack_mm, the kernel gpt-fast and torchao use;
            its best inner-K tiling) and Triton GEMVs of ours (int4_gemv_kernel, fp32
            sums, "triton", and with MAGIC, no int-to-float conversions, "magic";
            int4_gemv_half2_kernel, packed FP16
            dequantization and sums, "half2"; with x made ready outside, "half2x", and by a
            launch of its own inside the timed graph, "half2p"; each at its best tile), each
            with a scale per G columns, symmetric, as draft_bits.round_weight
Each int4 result is checked against x @ dequantized(W).T first. The int4 kernels are plain
GEMVs: the draft's prologues (RMSNorm, gated SiLU, SwiGLU) and residual adds are not fused
into them, so their per-step sum is a lower bound on what an int4 draft body's linears cost.
Prints us and the fraction of the copy bandwidth per linear, and the per-step sums.

--fused: the fused int4 form (ops.int4_fused, what the compiled int4 draft runs with
fused_draft.FUSE_INT4 on) per draft linear at every tile, beside half2x on ready x at the same
tile: what the prologue costs; and at its best tile under programmatic dependent launch
(fused_pdl_start / fused_pdl_end: signalled at each trigger, the calls chained in the graph as
a step chains them; compute capability 9+).

usage: python bench/int4_gemv.py [--shapes gdn-4b gdn24-0.8b] [--groups 32 128] [--wide]
       [--linears 65536x4096 ...] [--fused] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from gemv import FOLDS, bench_copies, fused_row, linear_shapes  # noqa: E402
from shapes import SHAPES  # noqa: E402

from unimax.fp8 import quantize_rows  # noqa: E402
from unimax.int4 import dequantize_int4, pack_nibbles, quantize_int4  # noqa: E402, F401
from unimax.ops.int4_gemv import prepare_x  # noqa: E402
from unimax.ops.timing import graph_us  # noqa: E402

# The Triton kernel's tiles (BLOCK_N, BLOCK_K, warps), each tried per linear and group
TILES = ((4, 1024, 4), (8, 512, 4), (8, 1024, 4), (8, 1024, 8), (16, 512, 4), (16, 1024, 8),
         (4, 2048, 8), (8, 2048, 8))
# --wide: more bytes in flight per program (an int4 row holds half an FP8 row's bytes)
WIDE_TILES = ((2, 2048, 4), (4, 2048, 4), (16, 2048, 8), (32, 1024, 8), (32, 512, 4),
              (64, 512, 8), (2, 4096, 8), (4, 4096, 8), (8, 4096, 8),
              (32, 128, 4), (64, 128, 4), (32, 256, 4), (64, 256, 8),  # (one group a step)
              (128, 128, 4), (256, 128, 4), (128, 256, 8))  # (rows past a CTA's: x reused?)
INNER_K_TILES = (2, 4, 8)  # tinygemm's choices
FORMS = ("triton", "magic", "half2", "half2x", "half2p")  # our kernels (int4_gemv)
F16_SCALE = ("half2", "half2x", "half2p")  # the forms that take an FP16 scale


def stored_nibbles(q: torch.Tensor) -> torch.Tensor:
    """q in -7..7 -> the stored nibble values q + 8 (uint8, 1..15), as every layout here keeps
    them."""
    return (q.to(torch.int16) + 8).to(torch.uint8)


def prepare_x_launch(x: torch.Tensor, block: int = 1024) -> torch.Tensor:
    """prepare_x in one Triton launch (int4_gemv_kernel.prepare_x_kernel)."""
    from int4_gemv_kernel import prepare_x_kernel

    half = x.shape[-1] // 2
    out = torch.empty(2, half, device=x.device, dtype=torch.float16)
    prepare_x_kernel[(-(-half // block),)](x.contiguous(), out, half, BLOCK=block)
    return out


def int4_gemv(x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor,
              tile: tuple[int, int, int] = (8, 1024, 4), form: str = "triton") -> torch.Tensor:
    """x (1, K) @ the packed weight's dequantized transpose -> (1, N), by a FORMS kernel:
    "triton" int4_gemv_kernel, "magic" the same with MAGIC,
    "half2" int4_gemv_half2_kernel (GPU only; K a multiple of BLOCK_K), "half2x" the same with
    PRE_X (x as prepare_x makes it, or made here), "half2p" that with x made here by one more
    launch (prepare_x_launch; what a draft pays if its prologue is a kernel of its own); the
    last three take an FP16 scale (convert it once, not per call)."""
    if form not in FORMS:
        raise ValueError(f"int4_gemv: form {form!r} is not one of {FORMS}")
    n, k = packed.shape[0], 2 * packed.shape[1]
    if form == "half2p" and x.shape == (1, k):
        x = prepare_x_launch(x)
    if form in ("half2x", "half2p"):
        x = x if x.dtype == torch.float16 else prepare_x(x)
        if x.shape != (2, k // 2):
            raise ValueError(f"int4_gemv: {form} takes x (1, {k}) or as prepare_x makes it, "
                             f"(2, {k // 2}); got {tuple(x.shape)}")
        x = x.view(1, k)  # (only its size is checked below)
    group = k // scale.shape[1]
    block_n, block_k, warps = tile
    if x.shape != (1, k) or block_k % group:
        raise ValueError(f"int4_gemv: x {tuple(x.shape)} must be (1, {k}), and the tile's "
                         f"BLOCK_K {block_k} a multiple of the group {group}")
    if (form in F16_SCALE) != (scale.dtype == torch.float16):
        raise ValueError(f"int4_gemv: the forms {F16_SCALE} take an FP16 scale, the others not")
    if form.startswith("half2") and k % block_k:
        raise ValueError(f"int4_gemv: the {form} form needs K ({k}) a multiple of BLOCK_K "
                         f"({block_k})")
    from int4_gemv_kernel import int4_gemv_kernel

    from unimax.ops.int4_gemv_kernels import int4_gemv_kernel as int4_gemv_half2_kernel

    y = torch.empty(1, n, device=x.device, dtype=x.dtype)
    grid = (-(-n // block_n),)
    args = (x.contiguous(), packed, scale, y, n, k, packed.stride(0), scale.stride(0))
    if form in F16_SCALE:
        int4_gemv_half2_kernel[grid](*args, GROUP=group, BLOCK_N=block_n, BLOCK_K=block_k,
                                     PRE_X=form != "half2", num_warps=warps)
    else:
        int4_gemv_kernel[grid](*args, GROUP=group, BLOCK_N=block_n, BLOCK_K=block_k,
                               MAGIC=form == "magic", num_warps=warps)
    return y


def tinygemm_pack(q: torch.Tensor, scale: torch.Tensor, inner_k_tiles: int,
                  even_high: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """q and scale (quantize_int4) in tinygemm's CUDA layout: the weight through
    aten._convert_weight_to_int4pack (from (N, K / 2) uint8, column 2j in the high nibble as
    torchao packs it for torch >= 2.5, or in the low one: int4_rows keeps the order whose
    result checks) and scales_and_zeros (K / group, N, 2), the zero 0: tinygemm dequantizes
    (u - 8) * scale + zero, u the stored nibble (the CPU twin's test checks that much)."""
    u = stored_nibbles(q)
    even, odd = u[:, 0::2], u[:, 1::2]
    pairs = (even << 4) | odd if even_high else even | (odd << 4)
    packed = torch.ops.aten._convert_weight_to_int4pack(pairs, inner_k_tiles)
    return packed, scales_and_zeros(scale)


def scales_and_zeros(scale: torch.Tensor) -> torch.Tensor:
    """scale (N, K / group) -> tinygemm's (K / group, N, 2): each group's scale and a zero of
    0 (symmetric)."""
    return torch.stack([scale, torch.zeros_like(scale)], dim=2).transpose(0, 1).contiguous()


def tinygemm(x: torch.Tensor, packed: torch.Tensor, scales_and_zeros: torch.Tensor,
             group: int) -> torch.Tensor:
    return torch.ops.aten._weight_int4pack_mm(x, packed, group, scales_and_zeros)


def check(y: torch.Tensor, ref: torch.Tensor, what: str) -> float:
    """The relative error of ``y`` against the fp32 reference; over 2% is a wrong kernel (BF16
    output rounding is ~0.4%)."""
    err = ((y.float() - ref).norm() / ref.norm().clamp(min=1e-12)).item()
    if not err < 0.02:
        raise AssertionError(f"{what}: relative error {err:.3g} against the dequantized weight")
    return err


def fastest(what: str, options, time_one) -> tuple[float, object] | None:
    """(us, option) of the option ``time_one`` times fastest; one that raises (a tile past the
    registers, a wrong result) is reported and left out. None where all raise."""
    best = None
    for option in options:
        try:
            us = time_one(option)
        except Exception as e:
            print(f"{what} {option}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        if best is None or us < best[0]:
            best = (us, option)
    return best


def check_quietly(y: torch.Tensor, ref: torch.Tensor) -> float | None:
    """check's error, or None where it fails."""
    try:
        return check(y, ref, "")
    except AssertionError:
        return None


def bandwidth_fraction(nbytes: int, us: float, bandwidth: float) -> float:
    return nbytes / (us * 1e-6) / bandwidth


def int4_rows(name: str, n: int, k: int, group: int, bandwidth: float,
              tiles: tuple = TILES) -> dict:
    """One linear's int4 kernels at one group size: each checked, then timed."""
    torch.manual_seed(0)
    weight = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    q, scale = quantize_int4(weight, group)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    ref = x.float() @ dequantize_int4(q, scale).t()
    nbytes = n * k // 2 + scale.nbytes
    row = {"name": name, "N": n, "K": k, "group": group, "MB": nbytes / 1e6}
    packed = pack_nibbles(q)
    for label in FORMS:
        form_scale = scale.half() if label in F16_SCALE else scale
        copies = bench_copies(packed, form_scale)

        x_in = prepare_x(x) if label == "half2x" else x

        def time_tile(tile, label=label, form_scale=form_scale, copies=copies, x_in=x_in):
            row.setdefault(f"{label}_err", check(int4_gemv(x_in, packed, form_scale, tile,
                                                           label), ref, f"{name} {label} {tile}"))
            return graph_us(lambda i: int4_gemv(x_in, *copies[i], tile, label), len(copies))

        best = fastest(f"{name} int4/{group} {label}", [t for t in tiles if t[1] % group == 0],
                       time_tile)
        if best:
            row.update({f"{label}_us": best[0], f"{label}_tile": list(best[1]),
                        f"{label}_bw": bandwidth_fraction(nbytes, best[0], bandwidth)})
    try:  # the nibble order: torchao's (the even column high), or else the other
        even_high = check_quietly(tinygemm(x, *tinygemm_pack(q, scale, 8), group),
                                  ref) is not None
    except RuntimeError as e:  # (no tinygemm for this GPU: time_tinygemm reports it)
        print(f"{name} tinygemm: {e}", flush=True)
        even_high = True

    def time_tinygemm(inner_k_tiles) -> float:
        weights = tinygemm_pack(q, scale, inner_k_tiles, even_high)
        row.setdefault("tinygemm_err", check(tinygemm(x, *weights, group), ref,
                                             f"{name} tinygemm {inner_k_tiles}"))
        t_copies = bench_copies(*weights)
        return graph_us(lambda i: tinygemm(x, *t_copies[i], group), len(t_copies))

    best = fastest(f"{name} int4/{group} tinygemm", INNER_K_TILES, time_tinygemm)
    if best:
        row.update(tinygemm_us=best[0], tinygemm_inner_k_tiles=best[1],
                   tinygemm_bw=bandwidth_fraction(nbytes, best[0], bandwidth),
                   tinygemm_even_high=even_high)
    return row


def reference_rows(cfg, name: str, n: int, k: int, bandwidth: float) -> dict:
    """One linear's BF16 (cuBLAS) and FP8 (the fused draft GEMV at its timed choice, and the
    plain GEMV) times."""
    from unimax.ops import gemv as gemv_mod

    torch.manual_seed(0)
    base = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
    row = {"name": name, "N": n, "K": k}
    weights = bench_copies(base, None)
    us = graph_us(lambda i: F.linear(x, weights[i][0]), len(weights))
    row.update(bf16_us=us, bf16_bw=bandwidth_fraction(base.nbytes, us, bandwidth))
    weights = bench_copies(*quantize_rows(base))
    us = graph_us(lambda i: gemv_mod.gemv(x, *weights[i]), len(weights))
    row.update(fp8_us=us, fp8_bw=bandwidth_fraction(n * k, us, bandwidth))
    fused = fused_row(cfg, name, n, k, bandwidth) if cfg is not None else {}
    if "chosen_us" in fused:
        row.update(fp8_fused_us=fused["chosen_us"], fp8_fused_bw=fused["chosen_bw"],
                   fp8_fused_choice=fused["chosen"])
    return row


# --fused: wider tiles too (they paid for the first fused form, whose every program ran the
# prologue over x; bench/RESULTS.md, forty-second session)
FUSED_WIDE_TILES = ((32, 512, 8), (64, 512, 8), (64, 128, 4), (128, 128, 4), (128, 256, 8),
                    (256, 128, 8))


def fused_rows(cfg, name: str, n: int, k: int, bandwidth: float) -> dict:
    """One draft linear's fused int4 form (ops.int4_fused: the prologue's launch, then the GEMV
    with its epilogue) at every tile that fits, beside the same GEMV on x made ready outside
    (half2x: what the prologue costs) and the fused FP8 GEMV's timed choice. Each int4 result
    is checked against the twin first. (The in-projection's convolution is left out here: the
    prologue is what is measured.)"""
    from gemv import fold_inputs

    from unimax.int4 import quantize_packed
    from unimax.ops import fused_gemv
    from unimax.ops.gemv import tile_text
    from unimax.ops.int4_fused import int4_fused, int4_fused_ref
    from unimax.ops.int4_gemv import INT4_TILES, _tile

    prologue, _, _, _, x, z, norm, res = fold_inputs(cfg, name, n, k)
    torch.manual_seed(1)
    packed, scale = quantize_packed(torch.randn(n, k, device="cuda") * 0.02, 128)
    copies = bench_copies(packed, scale)
    nbytes = packed.nbytes + scale.nbytes
    ref = int4_fused_ref(x, packed, scale, prologue, norm, z, res)
    ready = prepare_x(torch.randn(1, k, device="cuda", dtype=torch.bfloat16))
    row = {"name": name, "N": n, "K": k, "prologue": prologue, "MB": nbytes / 1e6,
           "tiles": {}}
    for tile in dict.fromkeys(INT4_TILES + FUSED_WIDE_TILES):
        if tile[1] % 128 or k % tile[1]:
            continue
        try:
            err = check(int4_fused(x, packed, scale, prologue, norm, z, res, tile=tile), ref,
                        f"{name} fused {tile}")
            fused_us = graph_us(lambda i, t=tile: int4_fused(x, *copies[i], prologue, norm, z,
                                                             res, tile=t), len(copies))
            ready_us = graph_us(lambda i, t=tile: int4_gemv(ready, *copies[i], t, "half2x"),
                                len(copies))
        except Exception as e:  # (a tile past the registers)
            print(f"{name} {tile}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        row["tiles"][tile_text(tile)] = {"fused_us": fused_us, "half2x_us": ready_us,
                                         "err": err}
    for form in ("fused", "half2x"):
        best = min(row["tiles"], key=lambda t, f=form: row["tiles"][t][f + "_us"])
        us = row["tiles"][best][form + "_us"]
        row.update({f"{form}_us": us, f"{form}_tile": best,
                    f"{form}_bw": bandwidth_fraction(nbytes, us, bandwidth)})
    # the fused form at its best tile under programmatic dependent launch, the calls chained
    # in the graph as a step chains them (each trigger; compute capability 9+ only)
    # (PDL "auto", the default: auto_pdl sets what it means, as each graph owner does)
    tile = _tile(row["fused_tile"])
    for trigger in fused_gemv.PDL_TRIGGERS if fused_gemv.pdl_possible(x.device) else ():
        with fused_gemv.auto_pdl(True, trigger):
            check(int4_fused(x, packed, scale, prologue, norm, z, res, tile=tile), ref,
                  f"{name} fused pdl@{trigger}")
            row[f"fused_pdl_{trigger}_us"] = graph_us(
                lambda i: int4_fused(x, *copies[i], prologue, norm, z, res, tile=tile),
                len(copies))
    fp8 = fused_row(cfg, name, n, k, bandwidth)
    if "chosen_us" in fp8:
        row.update(fp8_fused_us=fp8["chosen_us"], fp8_fused_choice=fp8["chosen"])
    return row


def fused_main(shape: str, bandwidth: float, json_path: Path | None) -> None:
    """--fused: the fused int4 form per draft linear of ``shape``, every tile, and the
    per-step sums."""
    cfg = SHAPES[shape]
    rows = []
    for name, (n, k, calls) in linear_shapes(cfg).items():
        if name in FOLDS:
            rows.append({"calls": calls, **fused_rows(cfg, name, n, k, bandwidth)})
            print(json.dumps(rows[-1]), flush=True)
            if json_path:
                json_path.write_text(json.dumps(rows, indent=1))
    print(f"\ncopy bandwidth {bandwidth / 1e9:.0f} GB/s; {shape}, M = 1, us per call: the "
          "fused int4 form at each tile / half2x on ready x at the same tile")
    for r in rows:
        cells = "  ".join(f"{t} {v['fused_us']:.1f}/{v['half2x_us']:.1f}"
                          for t, v in r["tiles"].items())
        print(f"{r['name']:9} {r['N']:>6}x{r['K']:<6} {r['prologue']:10} {cells}")
    labels = {"fused": "fused_tile", "fused_pdl_start": "fused_tile",
              "fused_pdl_end": "fused_tile", "half2x": "half2x_tile",
              "fp8_fused": "fp8_fused_choice"}  # (where each form's tile is named)
    for form, label in labels.items():
        if all(form + "_us" in r for r in rows):
            total = sum(r[form + "_us"] * r["calls"] for r in rows)
            tiles = ", ".join(f"{r['name']} {r[label]}" for r in rows)
            print(f"per step, best tiles: {form} {total:.0f} us ({tiles})")


def parse_linear(text: str) -> tuple[int, int]:
    """"NxK" -> (N, K)."""
    n, sep, k = text.partition("x")
    if not sep or not n.isdigit() or not k.isdigit():
        raise argparse.ArgumentTypeError(f"{text!r}: write a linear as NxK, e.g. 32768x4096")
    return int(n), int(k)


def run_shape(shape: str, groups: list[int], bandwidth: float, tiles: tuple = TILES,
              linears: list[tuple[int, int]] = ()) -> list[dict]:
    """A shape's draft body linears, or (shape "linears") the given (N, K) with no fused
    FP8 row (no model's prologue to fold)."""
    cfg = SHAPES.get(shape)
    items = ({name: v for name, v in linear_shapes(cfg).items()
              if name in FOLDS}  # (the LM head stays FP8: draft_bits --fp8-head)
             if cfg is not None else {f"{n}x{k}": (n, k, 1) for n, k in linears})
    rows = []
    for name, (n, k, calls) in items.items():
        row = {"shape": shape, "calls": calls, **reference_rows(cfg, name, n, k, bandwidth)}
        for group in groups:
            int4 = int4_rows(name, n, k, group, bandwidth, tiles)
            row.update({f"int4/{group} {key}": value for key, value in int4.items()
                        if key not in ("name", "N", "K", "group")})
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def table(rows: list[dict], groups: list[int]) -> list[str]:
    cols = ["bf16", "fp8", "fp8_fused"] + [f"int4/{g} {kind}" for g in groups
                                           for kind in (*FORMS, "tinygemm")]
    lines = [f"{'shape':11} {'linear':11} " + "".join(f"{c:>22}" for c in cols)]
    for r in rows:
        cells = "".join(f"{r[c + '_us']:>13.1f} ({r[c + '_bw']:.2f})" if c + "_us" in r
                        else f"{'-':>22}" for c in cols)
        lines.append(f"{r['shape']:11} {r['name']:11} {cells}")
    for shape in dict.fromkeys(r["shape"] for r in rows if r["shape"] != "linears"):
        sel = [r for r in rows if r["shape"] == shape]
        sums = {c: sum(r[c + "_us"] * r["calls"] for r in sel) for c in cols
                if all(c + "_us" in r for r in sel)}
        lines.append(f"per step, {shape} (body linears x layers): "
                     + ", ".join(f"{c} {v:.0f} us" for c, v in sums.items()))
    return lines


def main() -> None:
    from decode import copy_bandwidth

    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", nargs="*", default=["gdn-4b"], choices=sorted(SHAPES))
    parser.add_argument("--groups", nargs="+", type=int, default=[32, 128])
    parser.add_argument("--wide", action="store_true",
                        help="the Triton kernel's WIDE_TILES too")
    parser.add_argument("--linears", nargs="+", type=parse_linear, default=[],
                        help="also these NxK linears (e.g. 65536x4096: large enough that the "
                             "H200 is byte-bound, as an L4 is at a 4B model's sizes)")
    parser.add_argument("--fused", action="store_true",
                        help="instead: the fused int4 form (ops.int4_fused) per draft linear "
                             "of the first shape, every tile, beside half2x on ready x")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    bandwidth = copy_bandwidth()
    if args.fused:
        fused_main(args.shapes[0], bandwidth, args.json)
        return
    tiles = TILES + WIDE_TILES if args.wide else TILES
    rows = []
    for shape in args.shapes + (["linears"] if args.linears else []):
        rows += run_shape(shape, args.groups, bandwidth, tiles, args.linears)
        if args.json:
            args.json.write_text(json.dumps(rows, indent=1))
    print(f"\ncopy bandwidth {bandwidth / 1e9:.0f} GB/s; M = 1, us per call (fraction of copy "
          "bandwidth; int4 bytes include the scales)")
    print("\n".join(table(rows, args.groups)))


if __name__ == "__main__":
    main()
