"""A full draft whose LM head scores part of the vocabulary (unimax.draft_vocab): its logits
are the full FP8 head's on those tokens and -inf elsewhere; verified decoding with it is exact
greedy decoding on pure and hybrid models, including where the exact model picks tokens the
draft cannot propose; bad choices are refused by name. (Verified sampling with it: the chi-square
test in test_speculative.)"""

import json
import subprocess
import sys

import pytest
import torch

import unimax
from helpers import ROOT
from unimax import build_engine
from unimax.draft_vocab import SubsetHead
from unimax.fp8 import quantize_view


@torch.inference_mode()
def test_subset_head_is_the_full_fp8_heads_rows(pure_or_hybrid):
    model = pure_or_hybrid
    vocab = model.config.vocab_size
    ids = [1, 5, 7, vocab - 1]
    full = quantize_view(model, "full").lm_head
    view = quantize_view(model, "full", vocab=ids)
    assert isinstance(view.lm_head, SubsetHead) and view.lm_head.rows.out_features == len(ids)
    x = torch.randn(3, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    got, expected = view.lm_head(x), full(x)
    assert got.shape == expected.shape == (3, vocab)
    assert torch.equal(got[:, ids], expected[:, ids])  # rows quantized per row, as the full's
    outside = torch.ones(vocab, dtype=torch.bool)
    outside[ids] = False
    assert torch.isneginf(got[:, outside]).all()
    assert quantize_view(model, "full", vocab=2).lm_head.ids.tolist() == [0, 1]


def test_verified_with_a_draft_vocabulary_is_exact_greedy(pure_or_hybrid):
    """The draft scores half the vocabulary: the exact model's reply uses tokens from both
    halves, so blocks are rejected at tokens the draft could not propose, and what the
    engine emits is still the exact greedy reply (default grad mode, as users call it)."""
    model = pure_or_hybrid
    vocab = model.config.vocab_size
    x = torch.randint(0, vocab, (1, 20), generator=torch.Generator().manual_seed(4))
    expected = unimax.exact_greedy_tokens(model, x, 40)[0].tolist()
    half = vocab // 2
    assert any(t < half for t in expected) and any(t >= half for t in expected)
    engine = build_engine(model, decode="fp8", draft="full", block_size=4,
                          draft_vocab=half)
    drafted = []
    run_block = engine.decode_graph.run_block

    def spy(n, record=False):
        out = run_block(n, record)
        drafted.extend(out[0].tolist())
        return out

    engine.decode_graph.run_block = spy
    got = engine.generate(x, 40, mode="verified", draft_block=4)
    assert got.tokens == expected
    assert drafted and max(drafted) < half  # the draft proposed its subset only
    assert got.verify.rejected_blocks > 0


@pytest.mark.parametrize("kwargs,match", [
    (dict(decode="bf16", draft_vocab=8), "full FP8 draft"),
    (dict(decode="fp8", draft="tail", draft_vocab=8), "full draft only"),
    (dict(decode="fp8", draft="full", draft_vocab=0), "must be 1..89"),
    (dict(decode="fp8", draft="full", draft_vocab=[3, 3]), "distinct"),
    (dict(decode="fp8", draft="full", draft_vocab=[0, 89]), "must lie in 0..88"),
    (dict(decode="fp8", draft="full", draft_vocab=[]), "non-empty"),
])
def test_bad_draft_vocabularies_are_refused_by_name(kwargs, match):
    from test_engine import CONFIG

    model = unimax.GDNForCausalLM(CONFIG).eval()
    with pytest.raises(ValueError, match=match):
        build_engine(model, **kwargs)
    with pytest.raises(TypeError, match="number of tokens or a list"):
        build_engine(model, decode="fp8", draft="full", draft_vocab=True)


def test_ranked_ids_take_stops_then_the_most_frequent():
    from unimax.draft_vocab import ranked_ids

    text = [[7, 7, 7, 3, 3, 9, 9, 5], [3, 9, 1]]  # counts: 3 and 9 three times, 7 three, 5, 1
    assert ranked_ids(text, 3) == [3, 7, 9]  # (a three-way tie: all kept)
    assert ranked_ids(text, 2) == [3, 7]  # ties broken by the lower id
    assert ranked_ids(text, 3, always=[2]) == [2, 3, 7]  # a stop id first, whatever its count
    assert ranked_ids(text, 7) == [0, 1, 2, 3, 5, 7, 9]  # then the lowest unused ids
    with pytest.raises(ValueError, match="more than its size 1"):
        ranked_ids(text, 1, always=[2, 4])


def test_vocab_coverage_counts_held_out_tokens_inside_the_head():
    """bench/vocab_coverage.py: the share of a held-out text's tokens inside the ranked head
    and inside ids 0..N-1, counted by hand on a toy tokenizer (one id per character)."""
    sys.path.insert(0, str(ROOT / "bench"))
    from vocab_coverage import coverage

    def encode(text):
        return [ord(c) - ord("a") for c in text]

    # rank text: "z" x3, "y" x2, "a" once; the eos id 25 ("z") is also always in
    report = coverage(encode, ["zzzyya"], ["zyab", "c"], [1, 2, 3], vocab_size=26, always=[25])
    ranked = [r["ranked"] for r in report["rows"]]
    first = [r["first"] for r in report["rows"]]
    # test tokens z y a b c: head {z}: 1/5; {z, y}: 2/5; {z, y, a}: 3/5
    assert ranked == [1 / 5, 2 / 5, 3 / 5]
    # ids 0..N-1: {a}: a; {a, b}: a b; {a, b, c}: a b c
    assert first == [1 / 5, 2 / 5, 3 / 5]
    assert (report["rank_tokens"], report["test_tokens"], report["test_distinct"]) == (6, 5, 5)
    with pytest.raises(ValueError, match="size 27"):
        coverage(encode, ["a"], ["a"], [27], vocab_size=26)


def test_vocab_coverage_cli_on_a_real_tokenizer(tmp_path):
    """The bench's command line on a tokenizer folder written by the tokenizers library, as a
    checkpoint's is: every held-out token is inside a head as large as the vocabulary."""
    from test_tokenizer_cli import write_fast_tokenizer

    write_fast_tokenizer(tmp_path, vocab_size=90)
    (tmp_path / "rank.txt").write_text("the cat sat on the mat. the dog sat too.\n")
    (tmp_path / "test.txt").write_text("a cat and a dog on the mat\n")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "vocab_coverage.py"), "--tokenizer", str(tmp_path),
         "--rank", str(tmp_path / "rank.txt"), "--test", str(tmp_path / "test.txt"),
         "--sizes", "8", "90", "--json", str(tmp_path / "c.json")],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads((tmp_path / "c.json").read_text())["rows"]
    assert [r["size"] for r in rows] == [8, 90]
    assert rows[1]["ranked"] == rows[1]["first"] == 1.0
    assert 0 < rows[0]["ranked"] < 1
    missing = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "vocab_coverage.py"), "--tokenizer", str(tmp_path),
         "--rank", str(tmp_path / "nope.txt"), "--test", str(tmp_path / "test.txt")],
        capture_output=True, text=True, timeout=300)
    assert missing.returncode != 0 and "cannot read" in missing.stderr
