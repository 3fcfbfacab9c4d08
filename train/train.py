"""Train the demo model: a small pure-GDN LM on the stdlib-docstring chat corpus, exported in the
Qwen3.5 text layout with its tokenizer. Reproducible from a seed; logs loss as JSON lines; records
the checkpoint's sha256, the corpus hash and the held-out perplexity in train_record.json.

usage: python -m train.train --corpus C.jsonl --tokenizer TOK_DIR --out OUT_DIR [--steps N] ...
(uses flash-linear-attention's kernels on a GPU when installed; runs anywhere, slowly)
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import platform
import random
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from unimax import GDNConfig, GDNForCausalLM, load_model, load_tokenizer
from unimax.export import save_checkpoint

from .corpus import read_corpus
from .tokenizer import render


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--corpus", required=True)
    p.add_argument("--tokenizer", required=True)
    p.add_argument("--out", required=True)
    add_schedule_args(p, steps=3000, batch=32, seq=512, lr=2e-3, warmup=100, log_every=50)
    p.add_argument("--hidden", type=int, default=384)
    p.add_argument("--layers", type=int, default=6)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--mlp", type=int, default=1024)
    p.add_argument("--kernel", default="torch", choices=("torch", "fla"),
                   help="gated delta rule for training: 'torch' (our chunked WY form, through "
                        "autograd) or 'fla'. fla 0.6.0's backward refuses Hopper GPUs with "
                        "Triton < 3.7.1 (wrong gradients, fla issue #640); the H200 image has "
                        "Triton 3.6, so the demo model was trained with 'torch'")
    p.add_argument("--max-mb", type=float, default=25.0, help="refuse a bigger checkpoint")
    p.add_argument("--eval-every", type=int, default=0,
                   help="held-out loss every N steps; the best step's weights are exported "
                        "(early stopping: the corpus is small). 0: export the last step")
    p.add_argument("--max-shard-mb", type=float, default=None,
                   help="split the safetensors into shards of at most this size")
    return p.parse_args(argv)


def add_schedule_args(p: argparse.ArgumentParser, steps: int, batch: int, seq: int, lr: float,
                      warmup: int, log_every: int) -> None:
    """The options every trainer here takes (their defaults its own): the steps, the batches,
    the learning rate's warm-up and cosine decay (``lr_at``), the seed, the device, the log."""
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--batch", type=int, default=batch)
    p.add_argument("--seq", type=int, default=seq)
    p.add_argument("--lr", type=float, default=lr)
    p.add_argument("--warmup", type=int, default=warmup)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--log-every", type=int, default=log_every)


def lr_at(step: int, args: argparse.Namespace) -> float:
    """Linear warm-up over ``args.warmup`` steps, then cosine decay to a tenth of ``args.lr``."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    progress = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def token_stream(examples, tokenizer) -> list[list[int]]:
    return [tokenizer(render(e["messages"]), add_special_tokens=False).input_ids
            for e in examples]


def batches(docs: list[list[int]], batch: int, seq: int, gen: random.Random):
    """Random windows of seq + 1 tokens from the shuffled, concatenated documents."""
    while True:
        order = list(range(len(docs)))
        gen.shuffle(order)
        stream = [t for i in order for t in docs[i]]
        for _ in range(max(1, len(stream) // (batch * seq))):
            starts = [gen.randrange(0, len(stream) - seq - 1) for _ in range(batch)]
            yield torch.tensor([stream[s:s + seq + 1] for s in starts])


@torch.no_grad()
def heldout_perplexity(model, docs: list[list[int]], device) -> float:
    """exp(mean next-token loss) over whole held-out documents, each from an empty state."""
    total, count = torch.zeros((), device=device), 0
    for doc in docs:
        ids = torch.tensor([doc], device=device)
        logits = model(input_ids=ids[:, :-1]).logits.float()
        total += F.cross_entropy(logits[0], ids[0, 1:], reduction="sum")
        count += ids.shape[1] - 1
    return math.exp(float(total) / max(count, 1))


def main(argv=None) -> dict:
    args = parse_args(argv)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    tokenizer = load_tokenizer(args.tokenizer)
    corpus = read_corpus(args.corpus)
    train_docs = token_stream([e for e in corpus if e["split"] == "train"], tokenizer)
    held_docs = token_stream([e for e in corpus if e["split"] == "heldout"], tokenizer)
    config = GDNConfig(vocab_size=len(tokenizer), hidden_size=args.hidden,
                       num_hidden_layers=args.layers, num_k_heads=args.heads,
                       num_v_heads=args.heads, head_k_dim=args.head_dim,
                       head_v_dim=args.head_dim, intermediate_size=args.mlp, norm_offset=1.0,
                       tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
                       source_layout="qwen3_5")
    model = GDNForCausalLM.random(config, device=device, dtype=torch.float32, seed=args.seed)
    model.set_backend(args.kernel)
    model.train()
    params = sum(p.numel() for p in model.parameters())
    if params * 2 / 2**20 > args.max_mb:
        raise SystemExit(f"{params / 1e6:.1f} M parameters = {params * 2 / 2**20:.1f} MiB in "
                         f"BF16, over --max-mb {args.max_mb}")
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1},
                                   {"params": no_decay, "weight_decay": 0.0}],
                                  lr=args.lr, betas=(0.9, 0.95))

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = (out / "train_log.jsonl").open("w")
    data = batches(train_docs, args.batch, args.seq, random.Random(args.seed))
    autocast = torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else \
        torch.autocast("cpu", enabled=False)
    start, first_loss, loss = time.perf_counter(), None, None
    best = {"step": -1, "perplexity": math.inf, "state": None}
    for step in range(args.steps):
        batch = next(data).to(device)
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args)
        with autocast:
            logits = model(input_ids=batch[:, :-1]).logits
        loss = F.cross_entropy(logits.float().flatten(0, 1), batch[:, 1:].flatten())
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        evaluate = args.eval_every and (step + 1) % args.eval_every == 0
        if step % args.log_every == 0 or step == args.steps - 1 or evaluate:  # host syncs
            value = float(loss.detach())
            first_loss = value if first_loss is None else first_loss
            record = {"step": step, "loss": round(value, 4), "lr": lr_at(step, args),
                      "seconds": round(time.perf_counter() - start, 1)}
            if evaluate:
                model.eval()
                with autocast:
                    record["heldout_perplexity"] = heldout_perplexity(model, held_docs, device)
                model.train()
                if record["heldout_perplexity"] < best["perplexity"]:
                    best = {"step": step, "perplexity": record["heldout_perplexity"],
                            "state": {k: v.detach().clone()
                                      for k, v in model.state_dict().items()}}
            log.write(json.dumps(record) + "\n")
            log.flush()
            print(json.dumps(record), flush=True)
    if best["state"] is not None:
        model.load_state_dict(best["state"])
    model.eval()
    ppl = heldout_perplexity(model, held_docs, device)  # in fp32, as the record states
    sha = save_checkpoint(model, out, dtype=torch.bfloat16, max_shard_mb=args.max_shard_mb,
                          eos_token_id=tokenizer.eos_token_id,
                          unimax_note="UNI MAX demo model trained by train/train.py on Python "
                                      "stdlib docstrings (PSF License 2.0)")
    for name in ("tokenizer.model", "tokenizer_config.json"):
        shutil.copy(Path(args.tokenizer) / name, out / name)
    # The perplexity users get: the shipped BF16 files read back through unimax's loader.
    shipped = load_model(out, device=device, dtype=torch.bfloat16)
    shipped_ppl = heldout_perplexity(shipped, held_docs, device)
    corpus_sha = hashlib.sha256(Path(args.corpus).read_bytes()).hexdigest()
    record = {"model_sha256": sha, "corpus_sha256": corpus_sha, "parameters": params,
              "heldout_perplexity": ppl,
              "heldout_perplexity_shipped_bf16": shipped_ppl, "best_step": best["step"],
              "heldout_tokens": sum(len(d) - 1 for d in held_docs), "first_loss": first_loss,
              "final_loss": float(loss.detach()), "args": vars(args),
              "python": platform.python_version(), "torch": torch.__version__,
              "train_seconds": round(time.perf_counter() - start, 1)}
    (out / "train_record.json").write_text(json.dumps(record, indent=1))
    return record


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:]), indent=1))
