"""PDL "auto" (the kernel configuration's pdl, the default): each graph decoder times its largest
block with plain launches and with programmatic dependent launch of its fused GEMVs, signalled at
each program's start and at its end (its pdl_trigger "auto"), keeps the fastest graph, and captures
every later block in that setting (unimax.graph.MaxTurboGraphDecoder.choose_pdl); the verifier does
the same with its full verify block (unimax.verifier.Verifier.choose_pdl). On the CPU there are no
graphs and no PDL: a runner that really runs each body once (through GraphRunner's own prepare and
forget) stands in for capture, and "times" a body by the PDL setting its launches asked for. The
real thing on the GPU: tests/gpu/test_gpu_tma.py::test_pdl_auto_is_timed_per_decoder_on_gpu."""

import pytest
import torch

from helpers import kernels_for_test
from unimax import GDNConfig, GDNForCausalLM
from unimax.fast_step import gemv_view
from unimax.fp8 import quantize_view
from unimax.graph import GraphRunner, MaxTurboGraphDecoder, pdl_candidate, trial_run
from unimax.ops import pdl

CONFIG = GDNConfig(vocab_size=97, hidden_size=64, num_hidden_layers=2, num_k_heads=2,
                   num_v_heads=4, head_k_dim=16, head_v_dim=16, intermediate_size=128)
FP8_WEIGHT = torch.zeros(2, 2).to(torch.float8_e4m3fn)
BF16_WEIGHT = torch.zeros(2, 2, dtype=torch.bfloat16)
BLOCK = 4


def asked_now() -> bool | str:
    """The PDL setting a fused GEMV launched here now would take (from what it asks for an FP8
    and a BF16 weight), with "@end" where it would signal the next kernel at its end."""
    fp8, bf16 = pdl.pdl_wanted(FP8_WEIGHT), pdl.pdl_wanted(BF16_WEIGHT)
    setting = {(False, False): False, (True, False): "fp8", (True, True): True}[(fp8, bf16)]
    if setting and pdl.pdl_trigger() == "end":
        return pdl.pdl_label(setting, "end")
    return setting


def timed(faster, *settings) -> dict:
    """Replay times by setting (as ``asked_now`` names them): ``faster`` 1.5, the rest 2.0."""
    return {setting: 1.5 if setting == faster else 2.0 for setting in settings}


def labels(times: dict) -> dict:
    """``times`` as the owners' tables name their settings (pdl.pdl_label)."""
    return {str(setting): ms for setting, ms in times.items()}


class Replayable:
    def __init__(self, setting):
        self.setting = setting

    def replay(self) -> None:
        pass


class StandInRunner(GraphRunner):
    """A GraphRunner whose capture runs the body once, eagerly, leaving no trace (as capture's
    warm-ups), and whose "graph" remembers the PDL setting the body's launches asked for (seen
    at each call of ``owner.attribute``: the forward its blocks run); its replay time is
    ``times[setting]`` (``times(key)[setting]`` where times is a function of the graph's key).
    ``captures``: (key, setting) in order."""

    def __init__(self, times: dict, owner, attribute: str = "_step"):
        super().__init__(torch.device("cpu"), use_graphs=False, timed=True)
        self.use_graphs = True
        self.times, self.captures, self.asked = times, [], []
        forward = getattr(owner, attribute)

        def spied(*args, **kwargs):
            self.asked.append(asked_now())
            return forward(*args, **kwargs)

        setattr(owner, attribute, spied)
        self.key_now = None

    def prepare(self, key, fn, writes, buffers=()) -> None:
        self.key_now = key
        super().prepare(key, fn, writes, buffers)

    def capture(self, fn, writes, buffers):
        self.asked.clear()
        with trial_run(writes, buffers):
            fn()
        assert len(set(self.asked)) == 1, self.asked  # (every step of a block alike)
        setting = self.asked[0]
        self.captures.append((self.key_now, setting))
        times = self.times(self.key_now) if callable(self.times) else self.times
        return Replayable(setting), times[setting]


def decoder_with(monkeypatch, times: dict, full: bool = True, possible: bool = True):
    model = GDNForCausalLM.random(CONFIG, device="cpu", dtype=torch.bfloat16, seed=0)
    view = gemv_view(quantize_view(model, "full") if full else model)
    decoder = MaxTurboGraphDecoder(view, block_size=BLOCK, use_graphs=False)
    decoder.runner = StandInRunner(times, decoder)
    monkeypatch.setattr(pdl, "pdl_possible", lambda device: possible)
    return decoder, decoder.runner


@pytest.mark.parametrize("faster", [False, "fp8", "fp8@end"])
def test_auto_keeps_the_faster_block_and_captures_the_rest_so(monkeypatch, faster):
    """The full-FP8 draft: its largest block captured plain, then with PDL on its FP8 GEMVs
    signalled at the start, then at the end; the fastest graph kept (with its time), the
    others dropped; the smaller blocks captured once each, in the kept setting."""
    times = timed(faster, False, "fp8", "fp8@end")
    kernels_for_test(monkeypatch, pdl="auto")
    decoder, runner = decoder_with(monkeypatch, times)
    decoder.capture_blocks()
    largest = (BLOCK, False)
    assert (decoder.pdl, decoder.pdl_trigger) == {False: (False, "start"), "fp8": (
        "fp8", "start"), "fp8@end": ("fp8", "end")}[faster]
    assert decoder.pdl_ms == labels(times)
    assert runner.graphs[largest].setting == faster
    assert runner.replay_ms[largest] == times[faster]
    assert runner.captures == [(largest, False), (largest, "fp8"), (largest, "fp8@end")] + [
        ((n, False), faster) for n in range(1, BLOCK)]
    # eager blocks (no graph for their key) run in the choice too, and outside a decoder's
    # blocks "auto" asks for nothing
    runner.asked.clear()
    decoder._block(2, False)
    assert set(runner.asked) == {faster}
    assert asked_now() is False


def test_auto_times_the_bf16_step_with_pdl_on_every_gemv(monkeypatch):
    """A BF16 fast step (its blocks' GEMVs BF16): "auto" times True (every fused GEMV) against
    plain launches; the first block a reply runs chooses, before its own capture."""
    kernels_for_test(monkeypatch, pdl="auto")
    times = {False: 1.0, True: 0.9, "True@end": 0.95}
    decoder, runner = decoder_with(monkeypatch, times, full=False)
    decoder.run_block(2)
    assert decoder.pdl is True and decoder.pdl_trigger == "start"
    assert decoder.pdl_ms == labels(times)
    assert runner.captures == [((BLOCK, False), False), ((BLOCK, False), True),
                               ((BLOCK, False), "True@end"), ((2, False), True)]


def test_a_set_trigger_is_the_only_one_timed(monkeypatch):
    """pdl_trigger set (a bench's A/B): "auto" times plain launches against PDL signalled
    there only."""
    kernels_for_test(monkeypatch, pdl="auto", pdl_trigger="end")
    times = timed("fp8@end", False, "fp8@end")
    decoder, runner = decoder_with(monkeypatch, times)
    decoder.capture_blocks()
    assert (decoder.pdl, decoder.pdl_trigger, decoder.pdl_ms) == ("fp8", "end", labels(times))
    assert runner.captures[:2] == [((BLOCK, False), False), ((BLOCK, False), "fp8@end")]


@pytest.mark.parametrize("setting", [False, "fp8"])
def test_a_set_pdl_or_no_pdl_on_the_device_times_nothing(monkeypatch, setting):
    """PDL set (False, True or "fp8": a bench's A/B) is used as set, untimed; so is "auto"
    where the device has no programmatic launch (an L4, a CPU): plain launches."""
    kernels_for_test(monkeypatch, pdl=setting)
    decoder, runner = decoder_with(monkeypatch, {False: 1.0, "fp8": 0.5, "fp8@end": 0.5})
    decoder.capture_blocks()
    assert decoder.pdl is False and decoder.pdl_ms == {}
    assert runner.captures == [((n, False), setting) for n in range(1, BLOCK + 1)]

    kernels_for_test(monkeypatch, pdl="auto")
    decoder, runner = decoder_with(monkeypatch, {False: 1.0, "fp8": 0.5, "fp8@end": 0.5},
                                   possible=False)
    decoder.capture_blocks()
    assert decoder.pdl is False and decoder.pdl_ms == {}
    assert runner.captures == [((n, False), False) for n in range(1, BLOCK + 1)]


def test_the_candidate_follows_the_fused_gemvs():
    """What "auto" times against plain launches: the FP8 GEMVs of a fused FP8 view (full draft
    or tail), every GEMV of a fused BF16 view, nothing where no block is fused (the exact
    model, an unfused view)."""
    model = GDNForCausalLM.random(CONFIG, device="cpu", dtype=torch.bfloat16, seed=0)
    assert pdl_candidate(gemv_view(quantize_view(model, "full"))) == "fp8"
    assert pdl_candidate(gemv_view(quantize_view(model, "tail"))) == "fp8"
    assert pdl_candidate(gemv_view(model)) is True
    assert pdl_candidate(gemv_view(model, fuse=False)) is False
    assert pdl_candidate(model) is False


def test_auto_pdl_names_a_bad_setting(monkeypatch):
    with pytest.raises(ValueError, match="setting must be False, True or 'fp8', got 'auto'"):
        with pdl.auto_pdl("auto"):
            pass
    kernels_for_test(monkeypatch, pdl="auto")
    with pdl.auto_pdl("fp8"):
        assert asked_now() == "fp8"
        with pdl.auto_pdl(True):
            assert asked_now() is True
        assert asked_now() == "fp8"
    assert asked_now() is False
    with pytest.raises(ValueError, match="trigger must be 'start' or 'end', got 'auto'"):
        with pdl.auto_pdl("fp8", "auto"):
            pass
    with pdl.auto_pdl("fp8", "end"):
        assert pdl.pdl_trigger() == "end" and asked_now() == "fp8@end"
        with pdl.auto_pdl(True):
            assert asked_now() is True
        assert asked_now() == "fp8@end"
    assert pdl.pdl_trigger() == "start" and asked_now() is False
    # PDL set: the trigger set, or the start under "auto"; a bad one is named
    kernels_for_test(monkeypatch, pdl=True)
    with pdl.auto_pdl("fp8", "end"):
        assert pdl.pdl_trigger() == "start" and asked_now() is True
    kernels_for_test(monkeypatch, pdl_trigger="end")
    assert pdl.pdl_trigger() == "end" and asked_now() == "True@end"
    with pytest.raises(ValueError, match="pdl_trigger must be 'start', 'end' or 'auto', got"):
        kernels_for_test(monkeypatch, pdl_trigger="late")


def test_a_launch_signals_where_its_block_says(monkeypatch):
    """What a kernel is launched with (pdl.pdl_launch, which ops.gemv's tensor-core
    GEMMs take too) on a device with programmatic launch: nothing outside a chosen block, PDL
    signalled at the block's trigger inside one, nothing for a weight its setting leaves out."""
    kernels_for_test(monkeypatch, pdl="auto")
    monkeypatch.setattr(pdl, "pdl_possible", lambda device: True)
    assert pdl.pdl_launch(BF16_WEIGHT, FP8_WEIGHT) == {}
    for trigger in pdl.PDL_TRIGGERS:
        with pdl.auto_pdl("fp8", trigger):
            assert pdl.pdl_launch(BF16_WEIGHT, FP8_WEIGHT) == {
                "PDL": True, "PDL_LATE": trigger == "end", "launch_pdl": True}
            assert pdl.pdl_launch(BF16_WEIGHT, BF16_WEIGHT) == {}


def verifier_with(monkeypatch, times: dict, compiled: bool = True, possible: bool = True):
    """A verified engine's verifier (full-FP8 draft) on a stand-in runner; ``compiled``: its
    forwards stand for compiled ones (the eager forward under the compiled one's name: on the
    GPU those run the Triton GEMMs PDL applies to)."""
    from unimax import build_engine

    model = GDNForCausalLM.random(CONFIG, device="cpu", dtype=torch.bfloat16, seed=0)
    verifier = build_engine(model, decode="fp8", draft="full", block_size=BLOCK).verifier
    if compiled:
        verifier.compiled = verifier.forward
    verifier.runner = StandInRunner(times, verifier, "compiled" if compiled else "forward")
    monkeypatch.setattr(pdl, "pdl_possible", lambda device: possible)
    return verifier, verifier.runner


@pytest.mark.parametrize("faster", [False, True, "True@end"])
def test_the_verifier_keeps_the_faster_block_and_captures_the_rest_so(monkeypatch, faster):
    """The verifier's full block captured plain, then with PDL on its compiled forwards'
    kernels signalled at the start, then at the end, then its exact run of block_size steps
    the same way; the fastest graph of each kept with its time (the draft-length policy's
    costs), and every other graph captured once in its kind's setting."""
    times = timed(faster, False, True, "True@end")
    kernels_for_test(monkeypatch, pdl="auto")
    verifier, runner = verifier_with(monkeypatch, times)
    verifier.capture()
    full = verifier.graph_key(BLOCK, verifier.span(BLOCK, 0), None, False)
    run = verifier.run_key(BLOCK, None, False)
    kept = {False: (False, "start"), True: (True, "start"), "True@end": (True, "end")}[faster]
    assert (verifier.pdl, verifier.pdl_trigger, verifier.pdl_ms) == (*kept, labels(times))
    assert (verifier.pdl_run, verifier.pdl_run_trigger, verifier.pdl_run_ms) == (
        *kept, labels(times))
    for key in (full, run):
        assert runner.graphs[key].setting == faster and runner.replay_ms[key] == times[faster]
    assert runner.captures[:6] == [(full, False), (full, True), (full, "True@end"),
                                   (run, False), (run, True), (run, "True@end")]
    rest = runner.captures[6:]
    assert {key for key, _ in rest} == set(runner.graphs) - {full, run}
    assert {setting for _, setting in rest} == {faster}
    assert {key[0] for key, _ in rest} == {"exact", "verify"} and len(rest) == 2 * BLOCK - 2
    assert verifier.block_costs_ms()[BLOCK] == times[faster]
    assert verifier.block_costs_ms()[0] == times[faster] / BLOCK  # (per step of the run)
    assert asked_now() is False  # (outside the verifier's blocks "auto" asks for nothing)


def test_the_verifiers_blocks_and_one_token_forwards_choose_apart(monkeypatch):
    """Blocks with drafts (tensor-core GEMMs) faster with PDL signalled at the end, exact runs
    (fused GEMVs) faster plain: each kind keeps its own, and a k = 0 block, one exact step,
    goes with the exact runs."""
    kernels_for_test(monkeypatch, pdl="auto")
    verifier, runner = verifier_with(monkeypatch, lambda key: timed(
        "True@end" if key[0] == "verify" else False, False, True, "True@end"))
    verifier.capture()
    assert (verifier.pdl, verifier.pdl_trigger) == (True, "end")
    assert (verifier.pdl_run, verifier.pdl_run_trigger) == (False, "start")
    settings = dict(runner.captures[6:])
    assert all(setting == ("True@end" if key[0] == "verify" and key[1] > 0 else False)
               for key, setting in settings.items()), settings
    assert verifier.graph_key(0, 1, None, False) in settings


def test_the_verifier_chooses_at_its_first_launch(monkeypatch):
    """Without a capture at start-up, the first block a reply launches chooses first."""
    kernels_for_test(monkeypatch, pdl="auto")
    verifier, runner = verifier_with(monkeypatch, {False: 1.0, True: 0.9, "True@end": 0.95})
    verifier.launch(2)
    full = verifier.graph_key(BLOCK, verifier.span(BLOCK, 0), None, False)
    run = verifier.run_key(BLOCK, None, False)
    assert verifier.pdl is True and verifier.pdl_run is True
    assert runner.captures == [(full, False), (full, True), (full, "True@end"),
                               (run, False), (run, True), (run, "True@end"),
                               (verifier.graph_key(2, verifier.span(2, 0), None, False), True)]


@pytest.mark.parametrize("case", ["eager", "set", "no pdl"])
def test_the_verifier_times_nothing_without_a_choice(monkeypatch, case):
    """Eager forwards (cuBLAS: no kernel of ours to launch early), PDL set, or a device without
    programmatic launch: nothing timed, every graph captured once, plain ("auto") or as set."""
    kernels_for_test(monkeypatch, pdl=True if case == "set" else "auto")
    verifier, runner = verifier_with(monkeypatch, {False: 1.0, True: 0.5, "True@end": 0.5},
                                     compiled=case != "eager", possible=case != "no pdl")
    verifier.capture()
    assert verifier.pdl is False and verifier.pdl_ms == {}
    assert verifier.pdl_run is False and verifier.pdl_run_ms == {}
    assert len(runner.captures) == len({key for key, _ in runner.captures})
    assert {setting for _, setting in runner.captures} == {case == "set"}
