"""Train an MTP module (unimax.mtp) for a trained model, the model itself frozen: the demo model's
next-next-token predictor, so that verified mode's MTP drafts show on a trained model.

Each step feeds the frozen model a window of the corpus, takes its hidden states after the final
norm, and trains the MTP module to predict token t + 2 from (h_t, the embedding of token t + 1),
through the model's own (frozen) LM head. Reproducible from a seed; logs the loss as JSON lines.
Then measures what the drafts are for: through a verified engine (``draft="mtp"``) on held-out
prompts, how many drafts the exact model accepts, per position of a block.

usage: python -m train.mtp --model models/unimax-demo --corpus C.jsonl --out OUT_DIR
       [--steps 600] [--batch 8] [--seq 256] [--lr 3e-3] [--seed 0] [--device cpu] [--ship]
Writes OUT_DIR/mtp.safetensors (Qwen3.5's ``mtp.*`` names, BF16), mtp_log.jsonl and
mtp_record.json (the arguments, the losses, the acceptance). ``--ship``: the module added to the
model's folder as Qwen's checkpoints carry one (its tensors in the index, the config's
``mtp_num_hidden_layers``), the folder's training record given the new weights' sha256 and the
MTP's record.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from unimax import GDNForCausalLM, build_engine, load_model, load_tokenizer
from unimax.checkpoint import mtp_sources, parse_config, resolve_model_dir
from unimax.export import weights_sha256
from unimax.mtp import MTPHead

from .corpus import read_corpus
from .train import add_schedule_args, batches, lr_at, token_stream


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", required=True)
    p.add_argument("--corpus", required=True)
    p.add_argument("--out", required=True)
    add_schedule_args(p, steps=600, batch=8, seq=256, lr=3e-3, warmup=50, log_every=25)
    p.add_argument("--chain", type=int, default=1,
                   help="MTP steps trained per position: 2 also trains the second draft of a "
                        "chain on the module's own output")
    p.add_argument("--prompts", type=int, default=12, help="held-out prompts measured")
    p.add_argument("--new", type=int, default=48, help="reply tokens per measured prompt")
    p.add_argument("--block", type=int, default=4, help="drafts per measured block")
    p.add_argument("--ship", action="store_true", help="add the module to the model's folder")
    return p.parse_args(argv)


def ship(model_dir: Path, out: Path, record: dict) -> str:
    """``out``'s module into the checkpoint folder ``model_dir``; the weights' new sha256."""
    shutil.copy(out / "mtp.safetensors", model_dir / "mtp.safetensors")
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():  # (a sharded folder: the loader reads the tensors the index lists)
        data = json.loads(index.read_text())
        with safe_open(out / "mtp.safetensors", "pt") as handle:
            data["weight_map"].update(dict.fromkeys(handle.keys(), "mtp.safetensors"))
        index.write_text(json.dumps(data, indent=1))
    config = model_dir / "config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()),
                                  "mtp_num_hidden_layers": 1}, indent=1))
    sha = weights_sha256(model_dir)
    train_record = model_dir / "train_record.json"
    if train_record.is_file():
        kept = json.loads(train_record.read_text())
        train_record.write_text(json.dumps({**kept, "model_sha256": sha, "mtp": record},
                                           indent=1))
    return sha


def mtp_tensors(head: MTPHead) -> dict[str, torch.Tensor]:
    """The module's weights under Qwen3.5's names: the loader's own table (``mtp_sources``)
    read backwards, each merged weight split into the checkpoint tensors it came from."""
    ours = {f"mtp.{name}": t for name, t in head.state_dict().items()}
    out = {}
    for name, pieces in mtp_sources(head.config, "mtp.").items():
        parts = ours[name].split([shape[0] for _, shape in pieces])
        out.update({src: part for (src, _), part in zip(pieces, parts, strict=True)})
    return {name: t.detach().to("cpu", torch.bfloat16).contiguous().clone()
            for name, t in out.items()}


def mtp_loss(model, head: MTPHead, batch: torch.Tensor, chain: int = 1) -> torch.Tensor:
    """Cross-entropy of the MTP's predictions over a batch of windows (``chain`` + 1 tokens
    longer than the rows): of token t + 2 from (h_t, token t + 1); with ``chain`` > 1, the
    steps after it too as a draft chains them, fed the module's own last output and the next
    true token (teacher-forced: at drafting time the token is its own draft, the true one
    when it is right), each step's loss weighted alike."""
    rows = batch.shape[1] - 1 - chain
    with torch.no_grad():
        hidden = model(input_ids=batch[:, :rows + 1], return_hidden=True).hidden[:, :rows]
    losses = []
    for step in range(chain):  # (step j: rows 0 .. rows - 1 - j)
        n = rows - step
        out = head(hidden[:, :n], model.embed_tokens(batch[:, 1 + step:1 + step + n]))
        logits = model.lm_head(out)
        target = batch[:, 2 + step:2 + step + n]
        losses.append(F.cross_entropy(logits.float().flatten(0, 1), target.flatten()))
        hidden = out[:, :-1]
    return sum(losses) / chain


def acceptance(model, prompts: list[list[int]], new: int, block: int) -> dict:
    """Verified replies with MTP drafts of ``block`` tokens: the share of drafts accepted, and
    per position of a block the share accepted given the ones before were (the draft-length
    policy's conditional acceptance)."""
    engine = build_engine(model, decode="fp8", draft="mtp", block_size=block)
    reached = [0] * block  # blocks that drafted position j and got there
    kept = [0] * block
    drafted = accepted = 0
    verifier = engine.verifier
    collect = verifier.collect

    def counting(launched, counts):
        tokens = collect(launched, counts)
        k = launched[1]
        m = len(tokens) - 1 if k else 0
        for j in range(min(k, m + 1)):
            reached[j] += 1
            kept[j] += j < m
        return tokens

    verifier.collect = counting
    for prompt in prompts:
        _, report = engine.generate_verified(torch.tensor([prompt], device=model.device), new,
                                             draft_block=block)
        drafted += report.drafted_tokens
        accepted += report.accepted_draft_tokens
    return {"drafted": drafted, "accepted": accepted,
            "acceptance": accepted / max(drafted, 1),
            "per_position": [round(k / r, 4) if r else None
                             for k, r in zip(kept, reached, strict=True)]}


def main(argv=None) -> dict:
    args = parse_args(argv)
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    device = torch.device(args.device)
    model = load_model(args.model, device=device, dtype="float32").eval()
    model.requires_grad_(False)
    tokenizer = load_tokenizer(args.model)
    corpus = read_corpus(args.corpus)
    train_docs = token_stream([e for e in corpus if e["split"] == "train"], tokenizer)
    held = [e for e in corpus if e["split"] == "heldout"]
    # the MTP layer's shape as the loader will read it back: config.json with the module
    raw = json.loads((resolve_model_dir(args.model) / "config.json").read_text())
    config, _ = parse_config({**raw, "mtp_num_hidden_layers": 1})
    config = dataclasses.replace(config, max_context=model.config.max_context)
    head = MTPHead(config).to(device)
    gen = torch.Generator().manual_seed(args.seed)
    with torch.no_grad():
        for name, param in head.named_parameters():  # (norms at 1: Qwen3.5's (1 + w) form)
            param.copy_(torch.zeros_like(param) if name.endswith("norm.weight") else
                        0.02 * torch.randn(param.shape, generator=gen).to(device))
    optimizer = torch.optim.AdamW(head.parameters(), lr=args.lr, betas=(0.9, 0.95),
                                  weight_decay=0.0)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = (out / "mtp_log.jsonl").open("w")
    data = batches(train_docs, args.batch, args.seq + args.chain, random.Random(args.seed))
    start, losses = time.perf_counter(), []
    for step in range(args.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, args)
        loss = mtp_loss(model, head, next(data).to(device), args.chain)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        optimizer.step()
        if step % args.log_every == 0 or step == args.steps - 1:
            losses.append(round(float(loss.detach()), 4))
            record = {"step": step, "loss": losses[-1], "lr": lr_at(step, args),
                      "seconds": round(time.perf_counter() - start, 1)}
            log.write(json.dumps(record) + "\n")
            log.flush()
            print(json.dumps(record), flush=True)
    train_seconds = time.perf_counter() - start
    save_file(mtp_tensors(head), out / "mtp.safetensors", metadata={"format": "pt"})
    # the drafts as the app will run them: the module as shipped (BF16), on held-out prompts
    with_mtp = GDNForCausalLM(config).to(device)
    with_mtp.load_state_dict({**model.state_dict(), **{
        f"mtp.{k}": v.to(torch.bfloat16).float() for k, v in head.state_dict().items()}})
    with_mtp.eval()
    prompts = [tokenizer(f"<|im_start|>user\n{e['messages'][0]['content']}<|im_end|>\n"
                         "<|im_start|>assistant\n", add_special_tokens=False).input_ids
               for e in held[:args.prompts]]
    measured = acceptance(with_mtp, prompts, args.new, args.block)
    record = {"args": vars(args), "first_loss": losses[0], "final_loss": losses[-1],
              "train_seconds": round(train_seconds, 1), "parameters":
              sum(p.numel() for p in head.parameters()), "heldout": measured,
              "torch": torch.__version__}
    (out / "mtp_record.json").write_text(json.dumps(record, indent=1))
    if args.ship:
        record["shipped_sha256"] = ship(resolve_model_dir(args.model), out, record)
    return record


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1:]), indent=1))
