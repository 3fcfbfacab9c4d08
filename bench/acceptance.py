"""Verified-mode acceptance on a trained model (GPU): held-out questions of the demo corpus,
greedy, N new tokens each (no stop: every prompt contributes N tokens), for BF16-only, FP8-tail
fast, and verified mode with the FP8-tail and full-FP8 drafts. Also checks every mode's tokens
against the exact one-token reference, and prints sample answers (stopping at the end of turn).

usage: python bench/acceptance.py MODEL_DIR CORPUS.jsonl [--prompts 50] [--new 128]
       [--samples 5] [--temperatures 0.7 1.0] [--device cuda] [--json FILE]

--temperatures adds verified rows that sample (speculative sampling, top-k/top-p off, seed = the
prompt's index): the acceptance of sampled drafts next to the greedy one. Their tokens are not
compared with a reference (sampled text has no single right answer: tests/engine/test_speculative.py
holds its distribution to the exact model's). On the CPU (--device cpu) FP8 is emulated: the
acceptance is the model's, the speed is not a GPU's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))
from decode import VARIANTS  # noqa: E402  (the same rows as the decode benchmark)

import unimax  # noqa: E402
from train.corpus import read_corpus  # noqa: E402


def heldout_questions(corpus: str, count: int) -> list[str]:
    seen, questions = set(), []
    for example in read_corpus(corpus):
        question = example["messages"][0]["content"]
        if example["split"] == "heldout" and question not in seen:
            seen.add(question)
            questions.append(question)
    return questions[:count]


def prompt_ids(tokenizer, question: str, device: str | None = None) -> torch.Tensor:
    """``question`` as a one-turn chat prompt's ids, on ``device`` (default: --device)."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                        add_generation_prompt=True, return_dict=False)
    return torch.tensor([ids], device=device or DEVICE)


DEVICE = "cuda"


@torch.inference_mode()
def run_mode(model, mode_spec, prompts, new, references, temperature=0.0) -> dict:
    name, decode, draft, mode, fp8_mode = mode_spec
    engine = unimax.build_engine(model, decode=decode, draft=draft, block_size=8,
                                 fp8_mode=fp8_mode)

    def sampling(i):
        return unimax.SamplingParams(temperature=temperature, seed=i) if temperature else None

    for i, ids in enumerate(prompts[:2]):  # capture every graph size these runs meet
        engine.generate(ids, new, mode=mode, sampling=sampling(i))
    if temperature:
        name, references = f"{name} @T{temperature:g}", []
    tokens = seconds = drafted = accepted = rejected = equal = 0
    first_divergences = []
    for i, ids in enumerate(prompts):
        result = engine.generate(ids, new, mode=mode, sampling=sampling(i))
        tokens += len(result.tokens) - 1  # the first token comes from the prefill
        seconds += result.decode_seconds
        if i < len(references):
            same = result.tokens == references[i]
            equal += same
            if not same:
                first_divergences.append(next(j for j, (a, b) in enumerate(
                    zip(result.tokens, references[i], strict=False)) if a != b))
        if result.verify is not None:
            drafted += result.verify.drafted_tokens
            accepted += result.verify.accepted_draft_tokens
            rejected += result.verify.rejected_blocks
    row = {"mode": name, "prompts": len(prompts), "new_tokens": new,
           "decode_tok_s": tokens / seconds, "checked": len(references), "equal_to_exact": equal,
           "first_divergences": first_divergences}
    if drafted:
        row.update(acceptance=accepted / drafted, drafted=drafted, rejected_blocks=rejected)
    return row


@torch.inference_mode()
def samples(model, tokenizer, questions, new=96) -> list[dict]:
    engine = unimax.build_engine(model, decode="bf16", block_size=8)
    out = []
    for question in questions:
        result = engine.generate(prompt_ids(tokenizer, question), new,
                                 stop_ids=[tokenizer.eos_token_id])
        out.append({"question": question,
                    "answer": tokenizer.decode(result.tokens, skip_special_tokens=True)})
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("model")
    parser.add_argument("corpus")
    parser.add_argument("--prompts", type=int, default=50)
    parser.add_argument("--new", type=int, default=128)
    parser.add_argument("--samples", type=int, default=5)
    parser.add_argument("--check", type=int, default=None,
                        help="compare with the eager one-token reference on the first N prompts "
                             "only (it is slow); default all")
    parser.add_argument("--temperatures", type=float, nargs="*", default=[])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    global DEVICE
    DEVICE = args.device
    model = unimax.load_model(args.model, device=args.device, dtype=torch.bfloat16)
    tokenizer = unimax.load_tokenizer(args.model)
    questions = heldout_questions(args.corpus, args.prompts)
    prompts = [prompt_ids(tokenizer, q) for q in questions]
    start = time.perf_counter()
    references = [unimax.exact_greedy_tokens(model, ids, args.new)[0].tolist()
                  for ids in prompts[:args.check]]
    print(json.dumps({"reference_seconds": time.perf_counter() - start,
                      "prompts": len(prompts)}), flush=True)
    rows = []
    for spec in VARIANTS:
        rows.append(run_mode(model, spec, prompts, args.new, references))
        print(json.dumps(rows[-1]), flush=True)
        if spec[3] == "verified":
            for temperature in args.temperatures:
                rows.append(run_mode(model, spec, prompts, args.new, references, temperature))
                print(json.dumps(rows[-1]), flush=True)
    answers = samples(model, tokenizer, questions[:args.samples])
    for a in answers:
        print(json.dumps(a, ensure_ascii=False), flush=True)
    if args.json:
        device = torch.cuda.get_device_name() if args.device != "cpu" else "cpu"
        args.json.write_text(json.dumps({"device": device,
                                         "rows": rows, "samples": answers}, indent=1))
    base = rows[0]["decode_tok_s"]
    print(f"\n{'mode':<26}{'tok/s':>8}{'vs bf16':>8}{'accept':>8}{'==exact':>9}")
    for r in rows:
        print(f"{r['mode']:<26}{r['decode_tok_s']:>8.0f}{r['decode_tok_s'] / base:>8.2f}"
              f"{r.get('acceptance', float('nan')):>8.3f}{r['equal_to_exact']:>5}/{r['checked']}")


if __name__ == "__main__":
    main()
