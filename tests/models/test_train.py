"""The demo-model pipeline on a micro scale (the real run is on a GPU): corpus, tokenizer,
training loop, export that unimax loads, and the recorded checkpoint hash."""

import hashlib
import json
import subprocess
import sys

import pytest
import torch

import unimax
from helpers import ROOT
from train import corpus as corpus_mod
from train.tokenizer import train_tokenizer
from train.train import main as train_main


def build_corpus(path) -> dict:
    """The corpus CLI in a fresh process, as users run it: in a process that has imported torch
    and friends, some stdlib objects are patched (inspect.getfile) and the corpus differs."""
    run = subprocess.run([sys.executable, "-m", "train.corpus", str(path)], cwd=ROOT,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("demo")
    info = build_corpus(root / "corpus.jsonl")
    train_tokenizer(root / "corpus.jsonl", root / "tok", vocab_size=512)
    return root, info


def test_corpus_is_deterministic_and_split_by_name(built, tmp_path):
    root, info = built
    # reprs with memory addresses (defaults in signatures) once made every run differ
    assert build_corpus(tmp_path / "again.jsonl")["sha256"] == info["sha256"]
    assert info["examples"] > 1000
    record = json.loads((ROOT / "models" / "unimax-demo" / "train_record.json").read_text())
    if info["python"] == "3.11.7":  # the Python the shipped model's corpus was built with
        assert info["sha256"] == record["corpus_sha256"]
    examples = corpus_mod.read_corpus(root / "corpus.jsonl")
    train_keys = {e["key"] for e in examples if e["split"] == "train"}
    held_keys = {e["key"] for e in examples if e["split"] == "heldout"}
    assert held_keys and not train_keys & held_keys  # no name is in both splits
    json_dumps = [e for e in examples if e["key"] == "json.dumps"]
    assert any("JSON" in e["messages"][1]["content"] for e in json_dumps)


def test_tokenizer_round_trips_with_chat_template(built):
    root, _ = built
    tok = unimax.load_tokenizer(root / "tok")
    text = "Serialize ``obj`` to a JSON formatted ``str``. Grüße 42"
    assert tok.decode(tok(text, add_special_tokens=False).input_ids) == text
    ids = tok.apply_chat_template([{"role": "user", "content": "hi"}],
                                  add_generation_prompt=True, return_dict=False)
    assert tok.decode(ids).endswith("<|im_start|>assistant\n")
    assert tok.eos_token == "<|im_end|>"


@pytest.fixture(scope="module")
def trained(built):
    """A micro demo model trained and exported as the real one is (its folder, its record)."""
    root, _ = built
    out = root / "model"
    record = train_main(["--corpus", str(root / "corpus.jsonl"), "--tokenizer",
                         str(root / "tok"), "--out", str(out), "--steps", "40", "--batch", "4",
                         "--seq", "64", "--hidden", "64", "--layers", "2", "--heads", "2",
                         "--head-dim", "16", "--mlp", "128", "--lr", "3e-3", "--log-every",
                         "10", "--eval-every", "20", "--max-shard-mb", "0.05",
                         "--device", "cpu"])
    return out, record


def test_training_reduces_loss_and_exports_a_loadable_model(trained):
    out, record = trained
    log = [json.loads(line) for line in (out / "train_log.jsonl").read_text().splitlines()]
    assert log[-1]["loss"] < log[0]["loss"] - 0.5
    shards = sorted(out.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1 and (out / "model.safetensors.index.json").is_file()
    assert record["model_sha256"] == hashlib.sha256(
        b"".join(f.read_bytes() for f in shards)).hexdigest()
    assert 1 < record["heldout_perplexity"] < 600
    evaluated = [r for r in log if "heldout_perplexity" in r]
    assert [r["step"] for r in evaluated] == [19, 39]
    assert record["best_step"] == min(evaluated, key=lambda r: r["heldout_perplexity"])["step"]
    assert abs(record["heldout_perplexity_shipped_bf16"] / record["heldout_perplexity"] - 1) < 0.05
    model = unimax.load_model(out)
    tok = unimax.load_tokenizer(out)
    ids = torch.tensor([tok.apply_chat_template([{"role": "user", "content": "What does "
                                                  "json.dumps do?"}],
                                                add_generation_prompt=True, return_dict=False)])
    assert unimax.exact_greedy_tokens(model, ids, 5).shape == (1, 5)
    assert model.config.eos_token_id == tok.eos_token_id


def test_size_limit_is_enforced(built, tmp_path):
    root, _ = built
    with pytest.raises(SystemExit, match="over --max-mb 0.1"):
        train_main(["--corpus", str(root / "corpus.jsonl"), "--tokenizer", str(root / "tok"),
                    "--out", str(tmp_path), "--max-mb", "0.1", "--device", "cpu"])


def test_an_mtp_module_trains_and_ships_into_the_model_folder(built, trained, tmp_path):
    """train.mtp on the micro model (its chain's second step trained too): the frozen model's
    next-next-token loss goes down, the module ships into a copy of the folder as Qwen's checkpoints
    carry one (the sharded index lists it), loads back as model.mtp with its trained weights, and
    the folder's record holds the new weights' sha256 and the drafts' measured acceptance."""
    import shutil

    from train.mtp import main as mtp_main
    from unimax.export import weights_sha256

    root, _ = built
    folder, _ = trained
    model_dir = tmp_path / "model"
    shutil.copytree(folder, model_dir)
    before = unimax.load_model(model_dir, device="cpu")
    assert before.mtp is None
    record = mtp_main(["--model", str(model_dir), "--corpus", str(root / "corpus.jsonl"),
                       "--out", str(tmp_path / "mtp"), "--steps", "30", "--batch", "4",
                       "--seq", "48", "--log-every", "10", "--prompts", "2", "--new", "12",
                       "--block", "3", "--device", "cpu", "--chain", "2", "--ship"])
    log = [json.loads(line) for line in (tmp_path / "mtp" / "mtp_log.jsonl").read_text()
           .splitlines()]
    assert log[-1]["loss"] < log[0]["loss"] - 0.5
    model = unimax.load_model(model_dir, device="cpu")
    assert model.mtp is not None and model.config.mtp_layers == 1
    index = json.loads((model_dir / "model.safetensors.index.json").read_text())
    assert index["weight_map"]["mtp.fc.weight"] == "mtp.safetensors"
    kept = json.loads((model_dir / "train_record.json").read_text())
    assert kept["model_sha256"] == weights_sha256(model_dir) == record["shipped_sha256"]
    assert kept["mtp"]["heldout"]["drafted"] > 0
    assert 0 <= kept["mtp"]["heldout"]["acceptance"] <= 1
    # the base model's weights untouched: its logits as before
    ids = torch.tensor([[5, 6, 7, 8]])
    torch.testing.assert_close(model(input_ids=ids).logits, before(input_ids=ids).logits)
