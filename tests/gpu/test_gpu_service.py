"""GPU (UNIMAX_ALLOW_FLA=1 pytest -m gpu): the app's engine service as a shipped GPU preset runs
it (device cuda, BF16, compile_step auto, verified mode's full FP8 draft, every mode warmed up
and its graphs captured as app.py does at start-up), on the shipped demo model: each mode
answers, and verified replies are the exact model's greedy tokens (up to BF16 near-ties): under
the shipped draft-length policy (which may judge exact runs faster) and with every block drafting,
most drafts accepted. The other GPU tests build engines directly; this is what app.py serves.
A file of its own, so that tests/gpu.sh runs it in a process beside the others."""

import dataclasses
import time

import pytest
import torch

import unimax
from helpers import ROOT, require_fla
from unimax.draft_length import DraftLength
from unimax.modes import MODES
from unimax.presets import load_preset
from unimax.reference import first_divergence, is_near_tie
from unimax.service import EngineService, GenerationSettings

pytestmark = pytest.mark.gpu

QUESTIONS = ["What does json.dumps do?", "What does os.path.join do?"]


def test_a_gpu_preset_serves_every_mode_on_gpu():
    require_fla()
    shipped = load_preset(ROOT / "presets" / "qwen3.5-0.8b-l4.yaml")
    assert (shipped.device, shipped.draft, shipped.compile_step) == ("cuda", "full", "auto")
    preset = dataclasses.replace(shipped, model="unimax-demo", max_context=1024,
                                 state_memory_mib=256, host_state_memory_mib=512)
    service = EngineService(preset).start()
    try:
        started = time.perf_counter()
        service.warm_up()
        print(f"warm-up of {', '.join(MODES)}: "
              f"{time.perf_counter() - started:.0f} s")
        verified = service._engine("verified")
        assert not verified.state_safe_draft  # the full draft
        assert verified.draft_length.calibrated  # the graphs' replay times
        model = service.model
        policy = verified.draft_length
        drafted = False
        # the shipped policy first; then every block drafting k_max (an uncalibrated policy),
        # so that the drafts' path is served whatever the policy judged at these costs
        for i, (question, forced) in enumerate([(q, False) for q in QUESTIONS]
                                               + [(q, True) for q in QUESTIONS]):
            if forced:
                verified.draft_length = DraftLength(policy.k_max)
            messages = [{"role": "user", "content": question}]
            prompt = service.render(messages)
            for mode in MODES if not forced else ["verified"]:
                conversation = f"{mode}-{i}"
                handle = service.submit(conversation, messages, mode,
                                        GenerationSettings(max_new_tokens=64))
                events = list(handle.events(timeout=300))
                done = events[-1]
                assert done.kind == "done", (mode, done.text)
                assert done.data["reply"].strip(), mode
                stats = done.data["stats"]
                print(mode, question, repr(done.data["reply"][:60]), stats["decode_tok_s"],
                      stats.get("acceptance_rate"))
                if mode != "verified":
                    continue
                # the kept state's tokens: the prompt and the reply (its stop id included)
                reply = list(service.store.conversations[conversation][-1].tokens[len(prompt):])
                x = torch.tensor([prompt], device=model.device)
                reference = unimax.exact_greedy_tokens(model, x, len(reply))[0].tolist()
                divergence = first_divergence(model, x, reply, reference)
                assert is_near_tie(divergence), (question, divergence)
                if stats.get("acceptance_rate") is None:
                    # no block drafted: the calibrated policy found exact runs faster than
                    # drafts at these costs (the demo model on an H200: 0.7x at 0.96)
                    assert not forced and policy.best(policy.k_max) == 0, stats
                else:
                    drafted = True
                    assert stats["acceptance_rate"] > 0.5, stats
        assert drafted
        verified.draft_length = policy
        race_and_penalties(service)
    finally:
        service.stop()


def race_and_penalties(service):
    """On the warmed service: the A/B race (EngineService.race) interleaves bf16 and verified
    on the GPU, bf16's reply the one it gives alone; penalties change a reply in every mode."""
    settings = GenerationSettings(max_new_tokens=48)
    messages = [{"role": "user", "content": QUESTIONS[1]}]
    alone = {mode: service.submit(f"alone-{mode}", messages, mode, settings).events(timeout=300)
             for mode in ("bf16", "verified")}
    alone = {mode: list(events)[-1] for mode, events in alone.items()}
    handles = service.race([(f"race-{mode}", messages, mode, settings)
                            for mode in ("bf16", "verified")])
    raced = [list(handle.events(timeout=300))[-1] for handle in handles]
    for mode, handle, done in zip(("bf16", "verified"), handles, raced, strict=True):
        assert done.kind == "done" and handle.waited > 0, (mode, done.text)
        print("race", mode, done.data["stats"]["decode_tok_s"], "tok/s; alone",
              alone[mode].data["stats"]["decode_tok_s"])
    assert raced[0].data["tokens"] == alone["bf16"].data["tokens"]
    penalized = dataclasses.replace(settings, presence_penalty=2.0, frequency_penalty=2.0,
                                    repetition_penalty=3.0)
    for mode in MODES:
        plain, pen = (list(service.submit(f"pen-{mode}-{s.repetition_penalty}", messages, mode,
                                          s).events(timeout=300))[-1]
                      for s in (settings, penalized))
        assert pen.kind == "done" and pen.data["tokens"] != plain.data["tokens"], mode
        print("penalized", mode, repr(pen.data["reply"][:60]), pen.data["stats"]["decode_tok_s"])
