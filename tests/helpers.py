"""Tiny random checkpoints written by the reference libraries themselves, and comparisons."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import torch

from unimax import GDNConfig, GDNForCausalLM, exact_greedy_tokens, kernels

ROOT = Path(__file__).resolve().parents[1]


def cache_states(cache) -> list[torch.Tensor]:
    """Every GDN layer's conv and recurrent state of a cache, in layer order."""
    return [t for layer in cache.layers
            for t in (*getattr(layer, "conv_states", {}).values(),
                      *getattr(layer, "recurrent_states", {}).values())]


def kernels_for_test(monkeypatch, **changes) -> kernels.KernelConfig:
    """The configuration in force with ``changes``, put in force on the test's thread for the
    rest of the test: the ops and views a test drives, and the engines it builds after (an
    engine keeps the configuration in force when it is built)."""
    config = kernels.active().but(**changes)
    monkeypatch.setattr(kernels._ACTIVE, "config", config, raising=False)
    return config


# The GPU tests' model (tests/gpu/test_gpu_engine.py, test_gpu_verified.py, test_gpu_fused.py;
# test_gpu_hybrid.py's rewind test takes its config)
GPU_CONFIG = GDNConfig(vocab_size=512, hidden_size=256, num_hidden_layers=4, num_k_heads=2,
                       num_v_heads=4, head_k_dim=64, head_v_dim=64, intermediate_size=512)


def gpu_model():
    m = GDNForCausalLM.random(GPU_CONFIG, device="cuda", dtype=torch.bfloat16, seed=2)
    m.init_random_weights(seed=2, std=0.08)
    return m


def gpu_prompt(length, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randint(0, GPU_CONFIG.vocab_size, (1, length), device="cuda", generator=gen)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()  # (callers pass outputs made in grad mode)
    return float((a - b).norm() / b.norm())


def assert_in_proj_conv_matches_twin(project, gen: torch.Generator, label="") -> None:
    """The GDN in-projection with the convolution folded in, at a 4B model's shapes (GPU):
    ``project(x, weight, scale, norm, state, conv_w)`` (the op, or fused_gemv at a named
    form) gives the twin's outputs (ops.in_proj_conv.fused_in_proj_conv_ref) and rolls the
    windows in place with the projection's new inputs, FP8 and BF16 weights."""
    from unimax.fp8 import quantize_rows
    from unimax.ops.in_proj_conv import fused_in_proj_conv_ref

    w = torch.randn(12352, 2560, device="cuda", generator=gen) / 50
    norm = (1 + 0.1 * torch.randn(2560, device="cuda", generator=gen)).to(torch.bfloat16)
    conv_w = torch.randn(8192, 4, device="cuda", generator=gen).to(torch.bfloat16)
    x = 4 * torch.randn(1, 2560, device="cuda", generator=gen).to(torch.bfloat16)
    start = torch.randn(1, 8192, 4, device="cuda", generator=gen).to(torch.bfloat16)
    for weight, scale in (quantize_rows(w), (w.to(torch.bfloat16), None)):
        got_state, want_state = start.clone(), start.clone()
        got = project(x, weight, scale, norm, got_state, conv_w)
        want = fused_in_proj_conv_ref(x, weight, scale, 12352, 2560, norm, 1e-6, 1.0,
                                      want_state, conv_w)
        what = (label, weight.dtype)
        assert rel_err(got.float(), want.float()) < 1e-2, what
        assert torch.equal(got_state[..., :3], start[..., 1:]), what
        assert rel_err(got_state[..., 3].float(), want_state[..., 3].float()) < 1e-2, what


def assert_replays_match_eager(call, x: torch.Tensor, gen: torch.Generator, label="") -> None:
    """``call()`` (reading x) captured in a CUDA graph after a warm-up call outside it (compiles
    and autotuning): three replays, each after new values in x, equal eager calls bit for bit
    (a kernel's per-launch state, such as split-K's counters, set back by each launch)."""
    call()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = call()
    for _ in range(3):
        x.copy_(torch.randn(x.shape, device=x.device, generator=gen))
        graph.replay()
        assert torch.equal(out, call()), label


@torch.no_grad()
def randomize_(module: torch.nn.Module, seed: int) -> None:
    """Every parameter random in a realistic range (reference inits leave norms at 0 or 1,
    which would hide a wrong norm offset or a missing gate)."""
    gen = torch.Generator().manual_seed(seed)
    for name, param in module.named_parameters():
        if name.endswith("A_log"):
            values = torch.empty(param.shape).uniform_(1.0, 16.0, generator=gen).log()
        elif name.endswith("dt_bias"):
            values = torch.empty(param.shape).uniform_(-4.0, 0.0, generator=gen)
        elif "norm" in name:
            values = 0.5 + 0.5 * torch.rand(param.shape, generator=gen)
        elif "conv" in name:
            values = 0.3 * torch.randn(param.shape, generator=gen)
        else:
            values = 0.05 * torch.randn(param.shape, generator=gen)
        param.copy_(values)


def qwen_text_config(num_layers=2, vocab=97, hidden=64, k_heads=2, v_heads=4, tie=True,
                     layer_types=None):
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=96, num_hidden_layers=num_layers,
        layer_types=layer_types or ["linear_attention"] * num_layers,
        linear_num_key_heads=k_heads, linear_num_value_heads=v_heads, linear_key_head_dim=16,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, tie_word_embeddings=tie,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-6)


def write_qwen_checkpoint(path: Path, seed: int = 0, **config_kwargs):
    """Qwen3_5ForCausalLM with random weights, saved by transformers; returns the model."""
    from transformers import Qwen3_5ForCausalLM

    torch.manual_seed(seed)
    model = Qwen3_5ForCausalLM(qwen_text_config(**config_kwargs)).eval()
    randomize_(model, seed)
    model.save_pretrained(path)
    return model


FLA_SITE_ENV = "UNIMAX_FLA_SITE"


def fla_site() -> str | None:
    """Folder holding flash-linear-attention (+ triton) installed apart from the test process:
    an importable fla makes transformers route its CPU reference through Triton."""
    site = os.environ.get(FLA_SITE_ENV)
    return site if site and Path(site, "fla").is_dir() else None


def run_fla_script(args: list[str]) -> dict:
    """Run tests/fla_reference.py in a child process that can import fla; return its JSON."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([fla_site(), str(ROOT)]))
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "fla_reference.py"), *args],
                          env=env, capture_output=True, text=True, timeout=600)
    if proc.returncode != 0:
        raise AssertionError(f"fla reference script failed:\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run_with_triton(code: str, needs: str = "triton", interpret: bool = True) -> str:
    """Run ``code`` in a child process with the packages .ci/run installs apart (triton, fla)
    on its path, under Triton's CPU interpreter (chosen at import, so never in the test
    process) unless ``interpret`` is False; skip where ``needs`` is not installed. Returns its
    stdout; fails with its stderr."""
    import pytest

    site = os.environ.get(FLA_SITE_ENV, str(ROOT / ".deps" / "fla-site"))
    if not Path(site, needs).is_dir():
        pytest.skip(f"{needs} is not installed beside fla (.ci/run puts it in .deps/fla-site)")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), site])}
    env.pop("TRITON_INTERPRET", None)
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout


def verifier_recordings(seed: int = 4, after=None) -> list[tuple]:
    """The tiny model's verifier view (unimax.verifier.exact_view) compiled whole (fullgraph,
    inductor's CPU backend), then eager: each records a block of 9 tokens on a 20-token prompt's
    state, as the verifier does. Per forward, compiled first: (logits, every tape tensor,
    ``after(forward, block, cache)`` if given)."""
    from unimax.tiny import TINY_CONFIG
    from unimax.verifier import exact_view

    model = GDNForCausalLM.random(TINY_CONFIG, seed=seed)
    view = exact_view(model)
    compiled = torch.compile(view.forward_unchecked, fullgraph=True, dynamic=False)
    gen = torch.Generator().manual_seed(2)
    prompt = torch.randint(0, TINY_CONFIG.vocab_size, (1, 20), generator=gen)
    block = torch.randint(0, TINY_CONFIG.vocab_size, (1, 9), generator=gen)
    out = []
    with torch.inference_mode():
        for forward in (compiled, view.forward_unchecked):
            cache = view.make_recurrent_cache()
            model(input_ids=prompt, past_key_values=cache, use_cache=True)
            tape = model.make_tape(9)
            with cache.recording(tape):
                logits = forward(block, cache, logits_to_keep=9)
            more = () if after is None else after(forward, block, cache)
            out.append((logits, *(t.clone() for t in tape.tensors()), *more))
    return out


def assert_verified_exact_on_gpu(model, seed: int, new: int = 64) -> None:
    """Verified replies of the compiled engine (k = 8, full and tail FP8 drafts) to an 80-token
    prompt are exact greedy up to BF16 near-ties against the one-token eager reference."""
    import unimax
    from unimax.reference import first_divergence, is_near_tie

    for draft in ("full", "tail"):
        x = gpu_prompt(80, seed=seed)
        engine = unimax.build_engine(model, decode="fp8", draft=draft, block_size=8,
                                     compile_step=True)
        got, report = engine.generate_verified(x, new)
        reference = unimax.exact_greedy_tokens(model, x, new)[0].tolist()
        divergence = first_divergence(model, x, got[0].tolist(), reference)
        assert is_near_tie(divergence), (draft, divergence)
        print(draft, "acceptance", report.acceptance_rate, "rejected", report.rejected_blocks)


def spied(fn, name, calls: list):
    """``fn`` that first appends ``name`` to ``calls``: which of several spied calls ran, in
    what order."""
    def wrapper(*args, **kwargs):
        calls.append(name)
        return fn(*args, **kwargs)
    return wrapper


def verifier_launches(engine, monkeypatch, record=lambda key: key) -> list:
    """What every verifier graph launch of ``engine`` from now on records: ``record(key)``
    (the graph's key: ("verify", k, span, window) or ("exact", steps, window), "sampled" last
    for sampling graphs; ``record`` may add the caches' state at launch), in launch order."""
    launched = []
    run = engine.verifier.runner.run

    def spy(key, fn, *args, **kwargs):
        launched.append(record(key))
        return run(key, fn, *args, **kwargs)

    monkeypatch.setattr(engine.verifier.runner, "run", spy)
    return launched


def stop_case(model, x_len: int, y_len: int, seed: int, cut: int) -> tuple:
    """``two_turns``' inputs: prompts x and y (random ids, seeds ``seed`` and ``seed + 1``),
    the exact model's 30 free-running greedy tokens after x, and a stop id: the first of them
    past ``cut`` not among the ones before it (a stop inside a later block)."""
    x, y = (torch.randint(0, model.config.vocab_size, (1, n),
                          generator=torch.Generator().manual_seed(s))
            for n, s in ((x_len, seed), (y_len, seed + 1)))
    free = exact_greedy_tokens(model, x, 30)[0].tolist()
    stop = next(t for t in free[cut:] if t not in free[:cut])
    return x, y, free, stop


def two_turns(engine, x, y, n: int, stop: int, **run) -> tuple:
    """A verified reply to ``x`` of up to n tokens cut by the ``stop`` id, then a second turn of
    12 on ``y`` over the kept state: (first, second, the exact cache's states, its tokens
    seen). ``run``: more generate arguments for both (e.g. draft_block)."""
    first = engine.generate(x, n, mode="verified", stop_ids=[stop], **run)
    second = engine.generate(y, 12, mode="verified", keep_state=True, **run)
    return (first, second, [s.clone() for s in cache_states(engine.exact_cache)],
            engine.exact_cache.seen_tokens)


def assert_same_turns(a: tuple, b: tuple, stop: int, free: list[int]) -> None:
    """Two engines' ``two_turns``: both replies stop at the stop id with the free-running exact
    tokens, the second turns agree, and so do the kept states (to rounding: blocks cut
    elsewhere round elsewhere) and their lengths."""
    (a1, a2, a_state, a_seen), (b1, b2, b_state, b_seen) = a, b
    assert a1.stopped == b1.stopped == "stop" and a1.tokens[-1] == stop
    assert a1.tokens == b1.tokens == free[:len(a1.tokens)]
    assert a2.tokens == b2.tokens
    assert a_seen == b_seen
    for p, q in zip(a_state, b_state, strict=True):
        assert rel_err(p, q) < 1e-5


def require_fla() -> None:
    """The GPU tests' check that fla's kernels are there: a failure, not a skip (a GPU run
    without them would silently test the torch forms)."""
    import pytest

    from unimax.ops.gated_delta import fla_ops

    if fla_ops() is None:
        pytest.fail("flash-linear-attention is not importable: install it and run with "
                    "UNIMAX_ALLOW_FLA=1")


# Qwen3.5's generation prompt: thinking on leaves a <think> block open for the reply
QWEN35_THINKING_TAIL = ("{% if add_generation_prompt %}{% if enable_thinking is defined and "
                        "enable_thinking is false %}<think>\n\n</think>\n\n{% else %}<think>\n"
                        "{% endif %}{% endif %}")


def qwen35_template(thinking: bool) -> str:
    """Qwen3.5's chat template, in the demo's ChatML: the tools in a system turn with the call
    format the model is to write, calls in assistant turns, tool results in a user turn; and
    with ``thinking``, its thinking block: the generation prompt opens one (``<think>\\n``) or,
    with enable_thinking false, writes it closed and empty, and a reply after the last user
    message is written back with its block, earlier ones without."""
    last_query = ("{%- set ns = namespace(last_query=-1) %}{%- for m in messages %}"
                  "{%- if m.role == 'user' %}{%- set ns.last_query = loop.index0 %}{%- endif %}"
                  "{%- endfor %}")
    reply = ("{%- if loop.index0 > ns.last_query %}{{- '<|im_start|>assistant\\n<think>\\n\\n"
             "</think>\\n\\n' + m.content }}{%- else %}{{- '<|im_start|>assistant\\n' + "
             "m.content }}{%- endif %}") if thinking else \
        "{{- '<|im_start|>assistant\\n' + m.content }}"
    return (
        (last_query if thinking else "")
        + "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n\\nYou have access to the "
        "following functions:\\n\\n<tools>' }}{%- for tool in tools %}{{- '\\n' + tool | "
        "tojson }}{%- endfor %}{{- '\\n</tools>\\n\\nIf you choose to call a function ONLY "
        "reply in the following format with NO suffix:\\n\\n<tool_call>\\n<function="
        "example_function_name>\\n<parameter=example_parameter_1>\\nvalue_1\\n</parameter>"
        "\\n</function>\\n</tool_call>' }}{%- if messages[0].role == 'system' %}{{- '\\n\\n' "
        "+ messages[0].content }}{%- endif %}{{- '<|im_end|>\\n' }}"
        "{%- elif messages[0].role == 'system' %}{{- '<|im_start|>system\\n' + "
        "messages[0].content + '<|im_end|>\\n' }}{%- endif %}"
        "{%- for m in messages %}"
        "{%- if m.role == 'user' %}{{- '<|im_start|>user\\n' + m.content + '<|im_end|>\\n' }}"
        "{%- elif m.role == 'assistant' %}" + reply
        + "{%- for call in m.tool_calls or [] %}"
        "{%- set call = call.function if call.function is defined else call %}"
        "{%- if not loop.first or m.content %}{{- '\\n' }}{%- endif %}"
        "{{- '<tool_call>\\n<function=' + call.name + '>\\n' }}"
        "{%- for key, value in call.arguments | items %}{{- '<parameter=' + key + '>\\n' }}"
        "{{- value if value is string else value | tojson }}{{- '\\n</parameter>\\n' }}"
        "{%- endfor %}{{- '</function>\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
        "{%- elif m.role == 'tool' %}"
        "{%- if loop.first or loop.previtem.role != 'tool' %}{{- '<|im_start|>user' }}"
        "{%- endif %}{{- '\\n<tool_response>\\n' + m.content + '\\n</tool_response>' }}"
        "{%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
        "{%- endif %}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
        + (QWEN35_THINKING_TAIL if thinking else ""))


QWEN35_TOOLS_TEMPLATE = qwen35_template(thinking=False)
QWEN35_TEMPLATE = qwen35_template(thinking=True)


def demo_variant(path: Path, template: str | None = None, tail: str = "",
                 renamed: dict[str, str] | None = None) -> Path:
    """A copy of the demo model with another chat ``template`` (and ``tail`` added to it).
    ``renamed``: piece strings of its sentencepiece vocabulary to replace, e.g. a piece its
    reply to a question uses as "▁</think>", so that the reply closes a thinking block (the ids,
    and so the model's reply, stay as they are; only their text changes)."""
    import shutil

    shutil.copytree(ROOT / "models" / "unimax-demo", path)
    config_path = path / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = (template or config["chat_template"]) + tail
    config_path.write_text(json.dumps(config))
    if renamed:
        from sentencepiece import sentencepiece_model_pb2

        proto = sentencepiece_model_pb2.ModelProto()
        proto.ParseFromString((path / "tokenizer.model").read_bytes())
        for piece in proto.pieces:
            piece.piece = renamed.get(piece.piece, piece.piece)
        (path / "tokenizer.model").write_bytes(proto.SerializeToString())
    return path


def thinking_demo_model(path: Path, renamed: dict[str, str] | None = None) -> Path:
    """The demo model with Qwen3.5's thinking switch in its chat template (see demo_variant)."""
    return demo_variant(path, tail=QWEN35_THINKING_TAIL, renamed=renamed)


def reference_chat_reply(folder, messages: list[dict], n: int,
                         **template_kwargs) -> tuple[str, int]:
    """The exact model's greedy reply to a conversation (up to its turn's end, at most ``n``
    tokens) as text, from transformers' own rendering of the prompt (not the app's), and the
    prompt's length in tokens."""
    import torch
    from transformers import AutoTokenizer

    import unimax

    tok = AutoTokenizer.from_pretrained(folder)
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                  return_dict=False, **template_kwargs)
    model = unimax.load_model(str(folder), device="cpu", dtype="float32")
    out = unimax.exact_greedy_tokens(model, torch.tensor([ids]), n)[0].tolist()
    ends = {tok.eos_token_id, tok.convert_tokens_to_ids("<|im_end|>")}
    out = out[:next((i for i, t in enumerate(out) if t in ends), len(out))]  # the turn's end
    return tok.decode(out, skip_special_tokens=True), len(ids)


# A JSON schema of closed choices: the demo model (trained on stdlib docs, not on JSON) finishes
# an object of it (structured-output tests)
DOC_SCHEMA = {"type": "object", "additionalProperties": False,
              "required": ["module", "kind", "stable"],
              "properties": {"module": {"enum": ["json", "os", "re", "sys"]},
                             "kind": {"enum": ["function", "class", "constant"]},
                             "stable": {"type": "boolean"}}}


def grammar_processor(tokenizer, vocab_size: int, stops: list[int], build):
    """xgrammar's own transformers logits processor (the structured-output tests' reference
    mask) over the grammar ``build(compiler)`` compiles for this vocabulary and these stop
    ids."""
    import xgrammar as xgr
    import xgrammar.contrib.hf

    info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                              stop_token_ids=stops)
    return xgrammar.contrib.hf.LogitsProcessor(build(xgr.GrammarCompiler(info)))


def second_choice_every_third(graph) -> None:
    """The decoder's held draft steps made to take their second choice (under the grammar's
    mask and the penalties) every third step: verified blocks meet rejections at every
    position."""
    import itertools

    calls, original = itertools.count(), graph._held_choice

    def wrong(sampled, record=False):
        original(sampled, record)
        if next(calls) % 3 == 1:
            scores = graph.token_mask.apply(graph.held_logits)
            graph.static_token.copy_(scores.topk(2, dim=-1).indices[:, 1:])

    graph._held_choice = wrong
