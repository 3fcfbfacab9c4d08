"""How much of a text a draft vocabulary (unimax.draft_vocab) covers, for a real tokenizer: the
share of a held-out text's tokens that lie inside the N ids a draft head would score, ranked
from another text (``ranked_ids``, as a preset's ``draft_vocab_text`` ranks them, the
tokenizer's end-of-sequence id always in) and, for comparison, ids 0..N-1. CPU only, no model.

A token outside the head ends its block there (the exact model emits it), so with k drafts a
block and a per-token agreement a, the agreement with the head is about a x coverage. Where the
head pays depends on the shape: at ~4B on the H200 the 32k head made the draft step 0.636 ->
0.600 BF16 steps (bench/RESULTS.md), and it breaks even at ~98.6% coverage (docs/design.md).
This says which side of that a tokenizer and a kind of text fall on before a preset turns the
head on; the acceptance panel says it for the chats actually served.

usage: python bench/vocab_coverage.py --tokenizer DIR --rank A.txt [...] --test B.txt [...]
       [--sizes 8192 16384 32768 65536] [--json FILE]

DIR: a model or tokenizer folder that transformers' AutoTokenizer loads (tokenizer.json ...).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from unimax.draft_vocab import ranked_ids  # noqa: E402


def coverage(encode: Callable[[str], list[int]], rank_texts: Sequence[str],
             test_texts: Sequence[str], sizes: Sequence[int], vocab_size: int,
             always: Sequence[int] = ()) -> dict:
    """Per size N: the share of ``test_texts``' tokens inside the N ids ranked from
    ``rank_texts`` ("ranked") and inside ids 0..N-1 ("first"); with the token counts."""
    rank_ids = [encode(t) for t in rank_texts]
    test_ids = [token for t in test_texts for token in encode(t)]
    if not test_ids:
        raise ValueError("the test texts hold no tokens")
    rows = []
    for size in sizes:
        if not 1 <= size <= vocab_size:
            raise ValueError(f"size {size}: a draft head holds 1..{vocab_size} ids")
        chosen = set(ranked_ids(rank_ids, size, always))
        rows.append({"size": size,
                     "ranked": sum(t in chosen for t in test_ids) / len(test_ids),
                     "first": sum(t < size for t in test_ids) / len(test_ids)})
    return {"rank_tokens": sum(map(len, rank_ids)), "rank_distinct": len(set().union(*rank_ids)),
            "test_tokens": len(test_ids), "test_distinct": len(set(test_ids)),
            "vocab_size": vocab_size, "rows": rows}


def read(paths: Sequence[Path]) -> list[str]:
    texts = []
    for path in paths:
        try:
            texts.append(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as err:
            raise SystemExit(f"vocab_coverage: cannot read {path} as UTF-8 text ({err})") from err
    return texts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokenizer", type=Path, required=True)
    parser.add_argument("--rank", type=Path, nargs="+", required=True,
                        help="texts to rank the ids from (like the chats to be served)")
    parser.add_argument("--test", type=Path, nargs="+", required=True,
                        help="held-out texts whose tokens are counted")
    parser.add_argument("--sizes", type=int, nargs="+", default=[8192, 16384, 32768, 65536])
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    from transformers import AutoTokenizer  # (a real checkpoint's tokenizer, as the app loads)
    tokenizer = AutoTokenizer.from_pretrained(str(args.tokenizer))
    always = [] if tokenizer.eos_token_id is None else [tokenizer.eos_token_id]
    report = coverage(lambda text: tokenizer(text, add_special_tokens=False)["input_ids"],
                      read(args.rank), read(args.test), args.sizes, len(tokenizer), always)
    print(f"{args.tokenizer}: vocabulary {report['vocab_size']}; ranked from "
          f"{report['rank_tokens']} tokens ({report['rank_distinct']} distinct), tested on "
          f"{report['test_tokens']} ({report['test_distinct']} distinct)")
    print(f"{'size':>8} {'ranked':>8} {'first N':>8}")
    for row in report["rows"]:
        print(f"{row['size']:>8} {100 * row['ranked']:>7.2f}% {100 * row['first']:>7.2f}%")
    if args.json:
        args.json.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
