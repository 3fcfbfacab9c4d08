"""What a draft vocabulary (unimax.draft_vocab) costs in acceptance on a trained model (CPU or
GPU): the demo model (unimax-demo, 4096 tokens) answering held-out questions of its own corpus
in verified mode with the full FP8 draft, its head over all tokens, over the N most frequent
tokens of the corpus's training split (ranked_ids, stop ids always in), and over ids 0..N-1
(the int heuristic). Per row: acceptance, and the share of the reply's tokens in the subset
(how often a block meets a token its draft cannot propose). Every row's reply must be the
full-head row's (exact greedy decoding either way): checked.

usage: python bench/draft_vocab.py [--sizes 256 512 1024 2048] [--prompts 24] [--new 64]
       [--block 8] [--json FILE]

Random weights cannot answer this (their replies use tokens uniformly); the demo's vocabulary
is 60x smaller than Qwen3.5's, so its fractions (N / 4096) are the figures to carry over, and
only roughly: a large vocabulary's tail is longer.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
from acceptance import heldout_questions  # noqa: E402  (the acceptance bench's prompts)

import unimax  # noqa: E402
from train.corpus import read_corpus  # noqa: E402
from train.tokenizer import render  # noqa: E402
from unimax.chat import encode_chat, stop_ids  # noqa: E402
from unimax.demo import DEMO_NAME  # noqa: E402
from unimax.draft_vocab import ranked_ids  # noqa: E402


def corpus(questions: int) -> tuple[list[dict], list[str]]:
    """The demo's training corpus, rebuilt (deterministic per Python version) in a fresh
    process, as train/corpus.py asks, and its first ``questions`` held-out questions."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "corpus.jsonl"
        subprocess.run([sys.executable, "-m", "train.corpus", str(path)], cwd=ROOT, check=True,
                       capture_output=True)
        return read_corpus(path), heldout_questions(str(path), questions)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[256, 512, 1024, 2048])
    parser.add_argument("--prompts", type=int, default=24)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--block", type=int, default=8)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = unimax.load_model(DEMO_NAME, device=device)
    tokenizer = unimax.load_tokenizer(DEMO_NAME)
    vocab = model.config.vocab_size
    stops = stop_ids(tokenizer, model.config.eos_token_id, vocab)
    examples, questions = corpus(args.prompts)
    text = [tokenizer.encode(render(e["messages"]), add_special_tokens=False)
            for e in examples if e["split"] == "train"]
    prompts = [torch.tensor([encode_chat(tokenizer, [{"role": "user", "content": q}])],
                            device=device) for q in questions]
    heads = [("all", None)]
    for size in args.sizes:
        heads += [(f"top {size}", ranked_ids(text, size, always=stops)),
                  (f"ids 0..{size - 1}", size)]
    rows, replies = [], None
    for name, choice in heads:
        engine = unimax.build_engine(model, decode="fp8", draft="full", block_size=args.block,
                                     draft_vocab=choice)
        ids = None if choice is None else set(
            range(choice) if isinstance(choice, int) else choice)
        drafted = accepted = inside = total = 0
        got = []
        for x in prompts:
            result = engine.generate(x, args.new, mode="verified", stop_ids=stops,
                                     draft_block=args.block)
            got.append(result.tokens)
            drafted += result.verify.drafted_tokens
            accepted += result.verify.accepted_draft_tokens
            total += len(result.tokens)
            inside += len(result.tokens) if ids is None else sum(t in ids for t in result.tokens)
        replies = replies or got
        row = {"head": name, "rows": vocab if ids is None else len(ids),
               "acceptance": accepted / max(drafted, 1), "reply_tokens_inside": inside / total,
               "same_replies": got == replies, "tokens": total}
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "device": device, "block": args.block,
                                         "prompts": len(prompts), "new": args.new}, indent=1))
    print(f"\nunimax-demo ({vocab} tokens), {len(prompts)} held-out questions, {args.new} new, "
          f"k = {args.block}, {device}")
    print(f"{'draft head':<16}{'rows':>6}{'share':>7}{'accept':>8}{'inside':>8}  same")
    for r in rows:
        print(f"{r['head']:<16}{r['rows']:>6}{r['rows'] / vocab:>7.3f}{r['acceptance']:>8.3f}"
              f"{r['reply_tokens_inside']:>8.3f}  {r['same_replies']}")


if __name__ == "__main__":
    main()
