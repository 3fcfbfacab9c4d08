"""How much acceptance the draft's weight precision costs (CPU or GPU): verified mode on a trained
model with the full draft at FP8 (the product's: float8_e4m3fn, a scale per output row) beside
the same draft with its linears rounded to fewer bits (integers of BITS bits, symmetric, round to
nearest, a scale per row or per GROUP columns; emulated: the rounded weights are stored
dequantized in BF16, so the speed is not that of a low-bit kernel, only the acceptance is the
format's). Every block drafts k = --block tokens (no draft-length policy), so the rows' acceptance
rates compare one draft's agreement with the exact model at the same positions.

usage: python bench/draft_bits.py MODEL_DIR CORPUS.jsonl [--prompts 20] [--new 128]
       [--formats fp8 int8 int4/128 int4/64 int4/32 int4 skip:5 skipmlp:3,4] [--fp8-head]
       [--device cpu] [--json FILE]

A format is fp8, intB (a scale per row) or intB/G (a scale per G columns), either with +fit
(levels -2^(B-1)..2^(B-1)-1 and a scale fit for least squared error: fit_scale), or an FP8
draft that skips layers: skip:L,... (whole layers) or skipmlp:L,... (their MLPs only; layers
count from 0), emulated by zeroing the skipped parts' output projections (skip_in_the_draft).
Why: at 4B on the H200 the FP8 draft step is 0.64 of a BF16 step, about half of it bytes
(bench/RESULTS.md); a 4-bit draft would halve those bytes, and on an L4 (byte-bound) nearly
halve the step, at whatever acceptance it keeps, which is what this measures. The verifier is
the exact model in every row, so each row's output is exact greedy decoding whatever the
draft.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from acceptance import heldout_questions, prompt_ids  # noqa: E402

import unimax  # noqa: E402
from unimax.fp8 import FP8Linear  # noqa: E402


def parse_format(name: str) -> tuple[int, int | None, bool] | None:
    """fp8 -> None; intB -> (B, None, False); intB/G -> (B, G, False); +fit after either ->
    (..., True); skip:L,... and skipmlp:L,... -> None (an FP8 draft with layers skipped:
    parse_skip)."""
    if name == "fp8" or parse_skip(name):
        return None
    base, plus, fit = name.partition("+")
    if plus and fit != "fit":
        raise ValueError(f"unknown draft format {name!r}: the only suffix is +fit (int4/128+fit)")
    bits, slash, group = base.removeprefix("int").partition("/")
    if not name.startswith("int") or not bits.isdigit() or (slash and not group.isdigit()):
        raise ValueError(f"unknown draft format {name!r}: use fp8, intB or intB/G (e.g. int4/128)")
    if not 2 <= int(bits) <= 8 or (group and int(group) < 1):
        raise ValueError(f"{name!r}: bits must be 2..8 and a group at least 1 column")
    return int(bits), int(group) if group else None, bool(plus)


def round_weight(weight: torch.Tensor, bits: int, group: int | None,
                 fit: bool = False) -> torch.Tensor:
    """``weight`` (N, K) rounded to symmetric ``bits``-bit integers times a scale per row
    (``group`` None) or per ``group`` columns (absmax / (2^(bits-1) - 1), round to nearest;
    ``fit``: levels down to -2^(bits-1) and fit_scale's scale); returned dequantized in
    weight's dtype."""
    n, k = weight.shape
    group = group or k
    pad = (-k) % group
    w = torch.nn.functional.pad(weight.float(), (0, pad)).reshape(n, -1, group)
    top = 2 ** (bits - 1) - 1
    if fit:
        scale = fit_scale(w, bits)
        q = torch.round(w / scale).clamp(-top - 1, top)
    else:
        scale = w.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / top
        q = torch.round(w / scale).clamp(-top, top)
    return (q * scale).reshape(n, -1)[:, :k].to(weight.dtype)


# The absmax scale's multiples fit_scale tries: clipping a group's few largest weights buys a
# finer step for all the others, which often lowers the group's squared error.
CLIPS = tuple(1.0 - 0.025 * i for i in range(13))  # 1.0 .. 0.7


def fit_scale(w: torch.Tensor, bits: int) -> torch.Tensor:
    """Per group (w's last axis; w fp32) the scale s whose rounding q = clamp(round(w / s),
    -2^(bits-1), 2^(bits-1) - 1) leaves the least squared error, found by search: both signs of
    s (the sign decides which side of zero gets the extra level -2^(bits-1), so a group's
    largest weight can take it whatever its sign), each clip in CLIPS, then each one's least-
    squares scale for its q (sum w q / sum q q). Returns s (..., 1). Why: at 4 bits the plain
    absmax / 7 spends a level on one weight and leaves 15 of the 16 codes in use; the fit's
    error is lower on every group by construction (the plain scale is among the candidates),
    yet on the demo model it bought no acceptance (int4/128 with an FP8 head over 180 prompts:
    0.942 against absmax's 0.941, its rounding error 9.6% against 11.7%; sixty-second
    session), so the product's int4 draft (unimax.int4) keeps absmax / 7. A real checkpoint's
    outlier channels may differ: that is what the format is here to measure."""
    low, high = -2 ** (bits - 1), 2 ** (bits - 1) - 1
    top = w.amax(dim=-1, keepdim=True).clamp(min=0)
    bottom = (-w.amin(dim=-1, keepdim=True)).clamp(min=0)
    # Positive s: the positive side has `high` levels, the negative one -low; negative s the
    # other way round. The absmax scale of each sign is the larger of its two sides' needs.
    bases = (torch.maximum(top / high, bottom / -low).clamp(min=1e-12),
             -torch.maximum(bottom / high, top / -low).clamp(min=1e-12))
    best_scale = w.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / high  # plain
    best_err = ((torch.round(w / best_scale) * best_scale - w) ** 2).sum(dim=-1, keepdim=True)
    for base in bases:
        for clip in CLIPS:
            scale = base * clip
            for _ in range(2):  # the candidate, then its least-squares scale
                q = torch.round(w / scale).clamp(low, high)
                err = ((q * scale - w) ** 2).sum(dim=-1, keepdim=True)
                better = err < best_err
                best_err = torch.where(better, err, best_err)
                best_scale = torch.where(better, scale, best_scale)
                qq = (q * q).sum(dim=-1, keepdim=True)
                ls = (w * q).sum(dim=-1, keepdim=True) / qq.clamp(min=1)
                scale = torch.where((qq > 0) & (ls != 0), ls, scale)
    return best_scale


def parse_skip(name: str) -> tuple[str, list[int]] | None:
    """skip:L,... -> ("layer", [L, ...]); skipmlp:L,... -> ("mlp", [L, ...]); else None."""
    kind, colon, layers = name.partition(":")
    if not colon or kind not in ("skip", "skipmlp"):
        return None
    if not layers or not all(part.isdigit() for part in layers.split(",")):
        raise ValueError(f"{name!r}: name the layers to skip, e.g. skip:5 or skipmlp:3,4")
    return ("layer" if kind == "skip" else "mlp"), [int(part) for part in layers.split(",")]


def skip_in_the_draft(engine, what: str, layers: list[int]) -> int:
    """The draft's layers ``layers`` (``what`` "layer": mixer and MLP; "mlp": the MLP only)
    made to add nothing to the residual stream, as if a layer-skipping draft did not run them:
    their output projections (out_proj, down_proj) replaced by zero linears. The exact model
    and the verifier are untouched, so the output stays exact greedy decoding. A skipped
    layer's recurrent state still advances in the draft, but it feeds only that layer's own
    (zeroed) output and is resynced from the verifier after each block, so the draft's tokens
    are those of a draft that does not run the layer. Returns how many linears were zeroed."""
    view = engine.decode_model
    count = len(view.layers)
    if any(not 0 <= layer < count for layer in layers):
        raise ValueError(f"skip: layers must be 0..{count - 1}, got {layers}")
    names = [f"layers.{layer}.{part}" for layer in layers
             for part in (("mixer.out_proj", "mlp.down_proj") if what == "layer"
                          else ("mlp.down_proj",))]
    dtype = next(t.dtype for t in view.parameters() if t.element_size() > 1)  # (not FP8)
    for name in names:
        old = view.get_submodule(name)
        zero = nn.Linear(old.in_features, old.out_features, bias=False,
                         device=old.weight.device, dtype=dtype)
        with torch.no_grad():
            zero.weight.zero_()
        parent_name, _, child = name.rpartition(".")
        setattr(view.get_submodule(parent_name), child, zero)
    return len(names)


def lower_the_draft(engine, model, bits: int, group: int | None, fit: bool = False,
                    head: bool = True) -> int:
    """Every FP8 linear of ``engine``'s draft (but its LM head unless ``head``) replaced by a
    BF16 linear holding the exact model's weight rounded to ``bits`` (round_weight); returns
    how many."""
    view = engine.decode_model
    names = [name for name, m in view.named_modules()
             if isinstance(m, FP8Linear) and (head or name != "lm_head")]
    for name in names:
        exact = model.get_submodule(name)
        linear = nn.Linear(exact.in_features, exact.out_features, bias=False,
                           device=exact.weight.device, dtype=exact.weight.dtype)
        with torch.no_grad():
            linear.weight.copy_(round_weight(exact.weight.detach(), bits, group, fit))
        parent_name, _, child = name.rpartition(".")
        setattr(view.get_submodule(parent_name) if parent_name else view, child, linear)
    return len(names)


@torch.inference_mode()
def run_format(model, name: str, prompts, new: int, block: int, references,
               head: bool = True) -> dict:
    engine = unimax.build_engine(model, decode="fp8", draft="full", block_size=block)
    spec, skip = parse_format(name), parse_skip(name)
    lowered = lower_the_draft(engine, model, *spec, head=head) if spec else 0
    lowered += skip_in_the_draft(engine, *skip) if skip else 0
    name += "" if head or not spec else " +fp8 head"
    drafted = accepted = rejected = equal = tokens = blocks = 0
    per_prompt = []
    start = time.perf_counter()
    for ids, reference in zip(prompts, references, strict=True):
        result = engine.generate(ids, new, mode="verified", draft_block=block)
        report = result.verify
        drafted += report.drafted_tokens
        accepted += report.accepted_draft_tokens
        rejected += report.rejected_blocks
        tokens += report.generated_tokens
        blocks += report.verifier_blocks
        per_prompt.append(report.acceptance_rate)
        equal += result.tokens == reference
    # A few replies that settle where this draft disagrees can hold most of the rejections:
    # the per-prompt median and the share of prompts at 0.9 or more say how widespread they are.
    per_prompt.sort()
    return {"format": name, "linears_lowered": lowered, "acceptance": accepted / drafted,
            "tokens_per_block": tokens / blocks, "median_prompt": per_prompt[len(per_prompt) // 2],
            "prompts_at_0.9": sum(a >= 0.9 for a in per_prompt) / len(per_prompt),
            "drafted": drafted, "rejected_blocks": rejected, "equal_to_exact": equal,
            "prompts": len(prompts), "seconds": time.perf_counter() - start}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("model")
    parser.add_argument("corpus")
    parser.add_argument("--prompts", type=int, default=20)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--block", type=int, default=8)
    parser.add_argument("--formats", nargs="+",
                        default=["fp8", "int8", "int4/128", "int4/64", "int4/32", "int4"])
    parser.add_argument("--fp8-head", action="store_true",
                        help="keep the LM head at FP8 in the lowered drafts (on the demo model "
                             "the head's rounding decides most of what a 4-bit draft loses)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    for name in args.formats:
        try:
            parse_format(name)
        except ValueError as err:
            parser.error(str(err))
    model = unimax.load_model(args.model, device=args.device, dtype=torch.bfloat16)
    tokenizer = unimax.load_tokenizer(args.model)
    prompts = [prompt_ids(tokenizer, q, args.device)
               for q in heldout_questions(args.corpus, args.prompts)]
    references = [unimax.exact_greedy_tokens(model, ids, args.new)[0].tolist()
                  for ids in prompts]
    rows = []
    for name in args.formats:
        rows.append(run_format(model, name, prompts, args.new, args.block, references,
                               head=not args.fp8_head))
        print(json.dumps(rows[-1]), flush=True)
    print(f"\n{args.model}: {len(prompts)} prompts x {args.new} tokens, k = {args.block}")
    print(f"{'draft':>19} {'acceptance':>10} {'median':>7} {'>=0.9':>6} {'tok/blk':>7} "
          f"{'rejected':>8} {'exact':>7}")
    for row in rows:
        print(f"{row['format']:>19} {row['acceptance']:>10.3f} {row['median_prompt']:>7.3f} "
              f"{row['prompts_at_0.9']:>6.0%} {row['tokens_per_block']:>7.2f} "
              f"{row['rejected_blocks']:>8} {row['equal_to_exact']:>4}/{row['prompts']}")
    if args.json:
        args.json.write_text(json.dumps({"device": args.device, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
