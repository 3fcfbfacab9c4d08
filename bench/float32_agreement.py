"""How exact is the exact reference: the BF16 model's greedy replies (unimax.exact_greedy_tokens,
the one-token reference every fast path is held to) against the same weights computed in float32
(reference.float32_twin), on a trained model's held-out questions. Where the two part, the gap
between the two tokens says how close a call the BF16 reference made: in BF16 ulps of its own
logits, and as float32 sees it beside the distance of the reference's logits from float32. Those
are the calls on which verified mode, a third BF16 computation of the model, may also part from
the one-token reference on the GPU (the near ties the benches report).

usage: python bench/float32_agreement.py MODEL_DIR CORPUS.jsonl [--prompts 60] [--new 96]
       [--device cpu] [--json FILE]

No stop: each reply runs --new tokens; a divergence after the BF16 reply's end of turn is
counted apart ("after eos"), since a chat stops there. CPU or GPU (on the GPU the BF16 model runs
fla's kernels where it has them; the twin the recurrence's torch form).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from acceptance import heldout_questions, prompt_ids  # noqa: E402

import unimax  # noqa: E402
from unimax.reference import first_divergence, float32_twin  # noqa: E402


@torch.inference_mode()
def compare(model, twin, ids: torch.Tensor, new: int, eos: int | None) -> dict:
    """One prompt: the BF16 reply, the float32 one, and where and how closely they part."""
    bf16 = unimax.exact_greedy_tokens(model, ids, new)[0].tolist()
    f32 = unimax.exact_greedy_tokens(twin, ids, new)[0].tolist()
    end = bf16.index(eos) if eos in bf16 else len(bf16)
    row = {"same": bf16 == f32, "reply_tokens": end + 1}
    divergence = first_divergence(model, ids, f32, bf16, twin=twin)
    if divergence is not None:
        row.update(divergence, after_eos=divergence["index"] > end)
    return row


def summary(rows: list[dict]) -> dict:
    parted = [r for r in rows if not r["same"]]
    within = [r for r in parted if not r["after_eos"]]

    def spread(key, of):
        values = sorted(abs(r[key]) for r in of)
        return {"min": values[0], "median": statistics.median(values),
                "max": values[-1]} if values else None

    return {"prompts": len(rows), "same": len(rows) - len(parted),
            "parted_within_reply": len(within), "parted_after_eos": len(parted) - len(within),
            "gap_bf16_ulps": spread("gap_bf16_ulps", within),
            "float32_gap": spread("float32_gap", within),
            "reference_off_float32": spread("reference_off_float32", within),
            "float32_gap_under_reference_off": sum(
                abs(r["float32_gap"]) <= r["reference_off_float32"] for r in within)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("corpus")
    parser.add_argument("--prompts", type=int, default=60)
    parser.add_argument("--new", type=int, default=96)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    model = unimax.load_model(args.model, device=args.device, dtype=torch.bfloat16)
    twin = float32_twin(model)
    tokenizer = unimax.load_tokenizer(args.model)
    start = time.perf_counter()
    rows = []
    for question in heldout_questions(args.corpus, args.prompts):
        ids = prompt_ids(tokenizer, question, args.device)
        rows.append({"question": question,
                     **compare(model, twin, ids, args.new, tokenizer.eos_token_id)})
        if not rows[-1]["same"]:
            print(json.dumps(rows[-1]), flush=True)
        result = {"model": args.model, "device": args.device, "new": args.new,
                  "seconds": time.perf_counter() - start, **summary(rows)}
        if args.json:  # after every prompt: a run cut short keeps what it measured
            args.json.write_text(json.dumps({**result, "rows": rows}, indent=1))
    print(json.dumps(result, indent=1))
    print(f"\n{result['prompts']} prompts x {args.new} tokens: BF16 greedy = float32 greedy on "
          f"{result['same']}; parted within the reply on {result['parted_within_reply']}, "
          f"after its end of turn on {result['parted_after_eos']}")
    for key in ("gap_bf16_ulps", "float32_gap", "reference_off_float32"):
        if result[key]:
            print(f"  {key:<24} min {result[key]['min']:.4g}  median "
                  f"{result[key]['median']:.4g}  max {result[key]['max']:.4g}")


if __name__ == "__main__":
    main()
