"""GPU (UNIMAX_ALLOW_FLA=1 pytest -m gpu): structured output on CUDA, where the grammar's mask
is applied inside the mode's captured graphs (unimax/token_mask.py, unimax/held.py):
BF16-only's held steps, verified mode's drafts under the grammar and its blocks checked against
the grammar's masks. The reply must be the schema's JSON and follow the naive
twin (full forwards without a cache, xgrammar's transformers logits processor): a divergence
only where that reference's top two allowed logits are within BF16 rounding."""

import json

import pytest
import torch

from helpers import DOC_SCHEMA as SCHEMA
from helpers import ROOT, grammar_processor, require_fla
from unimax.presets import Preset
from unimax.service import EngineService
from unimax.settings import GenerationSettings
from unimax.structured import MAX_BLANKS_JSON, response_format

pytestmark = pytest.mark.gpu
DEMO = ROOT / "models" / "unimax-demo"
QUESTION = [{"role": "user", "content": "What does json.dumps do?"}]


@pytest.mark.parametrize("mode, runs", [("bf16", False), ("verified", False),
                                        ("verified", True)])
def test_structured_output_on_gpu(mode, runs):
    """``runs``: verified mode's policy calibrated with a host turn per draft dearer than a
    step (engine.held_host), so the reply takes exact runs of held steps, no drafts."""
    require_fla()
    pytest.importorskip("xgrammar")  # carried in .whl (see tests/gpu.sh)

    service = EngineService(Preset(model=str(DEMO), device="cuda")).start()
    try:
        # the held replies' graphs captured up front, as the app's warm-up does
        # (capture_graphs), before this test thread hands the service its request
        engine = service._engine(mode)
        engine.decode_graph.capture_held()  # (verified mode's drafts under the grammar)
        if mode == "verified":
            engine.verifier.capture_held()  # (its blocks checked against the grammar's masks)
        if runs:
            from unimax.held import HostTurns

            engine.draft_length.calibrate({k: 0.5 * k for k in range(1, engine.block_size + 1)},
                                          {k: 1.0 for k in range(engine.block_size + 1)}, 0.0)
            engine.held_host = HostTurns(draft_ms=1e3, learn=False)
            # (and no probe within the reply: one every 32 exact steps by default)
            engine.draft_length.probe_every = engine.draft_length.probe_every_max = 1000
        fmt = {"type": "json_schema", "json_schema": {"name": "doc", "schema": SCHEMA}}
        handle = service.submit("c", QUESTION, mode, GenerationSettings(max_new_tokens=96),
                                response_format=response_format(fmt))
        events = list(handle.events(timeout=300))
        done = events[-1]
        assert done.kind == "done", done.text
        assert done.data["stats"]["mode"] == mode  # the mode's engine, its captured graphs
        if mode == "verified" and runs:  # exact runs of held steps only
            assert done.data["stats"]["drafted_tokens"] == 0
            assert done.data["stats"]["verifier_blocks"] > 0
        elif mode == "verified":  # drafted under the grammar, each block checked by its masks
            assert done.data["stats"]["drafted_tokens"] > 0
        tokens = done.data["tokens"]
        prompt, stops = service.render(QUESTION), service.stop_ids
        processor = grammar_processor(
            service.tokenizer, service.model.config.vocab_size, stops,
            lambda c: c.compile_json_schema(json.dumps(SCHEMA),
                                            max_whitespace_cnt=MAX_BLANKS_JSON))
        for n in range(len(tokens) + 1):
            ids = torch.tensor([prompt + tokens[:n]], device="cuda")
            with torch.no_grad():
                logits = processor(ids, service.model(input_ids=ids).logits[:, -1].float())
            top2 = logits[0].topk(2)
            want = int(top2.indices[0])
            got = tokens[n] if n < len(tokens) else None
            if got is None and done.data["stopped"] == "length":
                break  # (the reply reached max_new_tokens: nothing after it to compare)
            if got != want and not (got is None and want in stops):
                gap = float(top2.values[0] - top2.values[1])
                print(f"diverged at {n}: reference {want}, reply {got}, gap {gap}")
                assert gap <= 0.0625 and got == int(top2.indices[1])
                break
        if mode == "verified" and not runs:  # sampled: drafts recorded under the masks,
            # blocks checked by the speculative rule on the masked exact distributions
            handle = service.submit("s", QUESTION, mode, GenerationSettings(
                max_new_tokens=96, temperature=1.0, seed=3), response_format=response_format(fmt))
            sampled = list(handle.events(timeout=300))[-1]
            assert sampled.kind == "done", sampled.text
            assert sampled.data["stats"]["drafted_tokens"] > 0
            print("sampled reply", repr(sampled.data["reply"]), sampled.data["stopped"])
            if sampled.data["stopped"] == "stop":
                assert set(json.loads(sampled.data["reply"])) == set(SCHEMA["properties"])
    finally:
        service.stop()
    print(mode, "reply", repr(done.data["reply"]), done.data["stopped"],
          "decode tok/s", done.data["stats"]["decode_tok_s"])
    if done.data["stopped"] == "stop":  # a finished reply is the schema's JSON
        assert set(json.loads(done.data["reply"])) == set(SCHEMA["properties"])
    else:  # the demo model pads its JSON with the blanks the grammar allows (an H100 run:
        # 96 tokens, every one the reference's, before its last value's end)
        assert done.data["stopped"] == "length" and len(done.data["tokens"]) == 96
    value = json.loads(done.data["reply"])
    assert set(value) == set(SCHEMA["properties"]) and isinstance(value["stable"], bool)
