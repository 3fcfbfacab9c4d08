"""``python -m unimax generate``: greedy continuation of a prompt, with the exact model (the plain
reference, one step per token) or with one of the app's engines (bf16, fp8, verified)."""

from __future__ import annotations

import argparse
import sys
import time

import torch

from .build import build_engine
from .checkpoint import load_model, load_tokenizer
from .detokenize import IncrementalDetokenizer
from .modes import APP_MODES, DRAFTS, MODES

VERIFIED_DRAFT = "full"  # the shipped GPU presets' draft: about half a BF16 step's bytes


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m unimax", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="continue a prompt (greedy)")
    gen.add_argument("--model", required=True, help="checkpoint folder or hub id")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--device", default=None, help="cpu or cuda (default: cuda if available)")
    gen.add_argument("--dtype", default="auto", help="bfloat16, float32, ... (default: auto)")
    gen.add_argument("--chat", action="store_true",
                     help="wrap the prompt in the tokenizer's chat template")
    gen.add_argument("--ignore-eos", action="store_true", help="do not stop at end-of-sequence")
    gen.add_argument("--mode", default="exact", choices=("exact", *MODES),
                     help="exact: the plain reference, one greedy step per token (default); "
                     "bf16, fp8, verified: the app's engines, their graphs captured and the "
                     "fast step compiled first on a GPU (verified prints its acceptance)")
    gen.add_argument("--draft", default=None, choices=DRAFTS,
                     help=f"verified mode's draft (default {VERIFIED_DRAFT}: every linear FP8)")
    return parser


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def generate(args: argparse.Namespace) -> int:
    if args.max_new_tokens < 1:
        raise ValueError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if not args.prompt.strip():
        raise ValueError("--prompt is empty; give some text to continue")
    if args.draft is not None and args.mode != "verified":
        raise ValueError(f"--draft is verified mode's draft; use it with --mode verified "
                         f"(this is --mode {args.mode})")
    model = load_model(args.model, device=args.device, dtype=args.dtype)
    tokenizer = load_tokenizer(args.model)
    if args.chat:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("--chat: this tokenizer has no chat template; drop --chat")
        ids = tokenizer.apply_chat_template([{"role": "user", "content": args.prompt}],
                                            add_generation_prompt=True, return_dict=False)
    else:
        ids = tokenizer(args.prompt).input_ids
    input_ids = torch.tensor([ids], device=model.device)
    eos = None if args.ignore_eos else tokenizer.eos_token_id

    if args.mode != "exact":
        return _engine_generate(args, model, tokenizer, input_ids, eos)
    cache = model.make_recurrent_cache()
    _sync(model.device)
    start = time.perf_counter()
    logits = model(input_ids=input_ids, past_key_values=cache, logits_to_keep=1).logits
    token = logits[:, -1].argmax(-1, keepdim=True)
    _sync(model.device)
    prefill_s = time.perf_counter() - start

    generated = [int(token)]
    detok = IncrementalDetokenizer(tokenizer)
    sys.stdout.write(detok.add(generated))
    start = time.perf_counter()
    while len(generated) < args.max_new_tokens and generated[-1] != eos:
        token = model.greedy_step(token, cache)
        generated.append(int(token))  # a host sync per token: this CLI is the plain reference
        sys.stdout.write(detok.add(generated[-1:]))
        sys.stdout.flush()
    decode_s = time.perf_counter() - start
    sys.stdout.write(detok.flush() + "\n")
    steps = len(generated) - 1
    print(f"[{len(ids)} prompt tokens: prefill {len(ids) / prefill_s:.1f} tok/s; "
          f"{len(generated)} new tokens: decode "
          f"{(steps / decode_s) if steps else float('nan'):.1f} tok/s; {model.device}, "
          f"{model.dtype}]", file=sys.stderr)
    return 0


def _engine_generate(args, model, tokenizer, input_ids: torch.Tensor, eos: int | None) -> int:
    """The app's engine for ``args.mode`` (unimax.modes), built and warmed before timing;
    its tokens streamed per block."""
    spec = APP_MODES[args.mode]
    draft = (args.draft or VERIFIED_DRAFT) if spec.verified else spec.draft
    engine = build_engine(model, decode=spec.decode, draft=draft, compile_step="auto")
    start = time.perf_counter()
    engine.capture_graphs(verified=spec.verified)  # (a no-op off CUDA)
    warm_s = time.perf_counter() - start
    detok = IncrementalDetokenizer(tokenizer)

    def on_block(tokens: list[int]) -> bool:
        sys.stdout.write(detok.add(tokens))
        sys.stdout.flush()
        return True

    result = engine.generate(input_ids, args.max_new_tokens, mode=spec.engine_mode,
                             stop_ids=() if eos is None else (eos,), on_block=on_block)
    sys.stdout.write(detok.flush() + "\n")
    steps = len(result.tokens) - 1
    decode = f"{steps / result.decode_seconds:.1f}" if steps and result.decode_seconds else "nan"
    line = (f"[{result.prefill_tokens} prompt tokens: prefill "
            f"{result.prefill_tokens / result.prefill_seconds:.1f} tok/s; "
            f"{len(result.tokens)} new tokens: decode {decode} tok/s; {args.mode}")
    v = result.verify  # None where the reply ended at its first token: nothing was drafted
    if spec.verified:
        line += f" ({draft} draft)" + (": nothing drafted" if v is None else (
            f": acceptance {v.acceptance_rate:.3f}, {v.drafted_tokens} drafted, "
            f"{v.accepted_draft_tokens} accepted, {v.rejected_blocks} blocks rejected"))
    print(f"{line}; bridge {result.bridge.mib:.2f} MiB; warm-up {warm_s:.1f} s; "
          f"{model.device}, {model.dtype}]", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return generate(args)
    except (ValueError, FileNotFoundError, RuntimeError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
