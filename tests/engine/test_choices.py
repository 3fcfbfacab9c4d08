"""Kernel choices remembered (unimax.ops.choices): the shipped table and the disk cache answer
before anything is timed; deferred choices take their default and are timed later, between
replies, for the next start. The timing itself is faked here (it needs a GPU); the lookups,
the deferral, the disk cache and the service's background tuning are the real ones."""

import json
import threading

import pytest
import torch

from unimax.ops import choices, gemv

NAMES = ("rows@a", "rows@b", "cublas")
TIMES = {"rows@a": 9.0, "rows@b": 4.0, "cublas": 6.0}  # the fastest: rows@b


@pytest.fixture
def timing(tmp_path, monkeypatch):
    """A CPU stand-in for the GPU's timing: each candidate's time from TIMES, the calls
    counted; the disk cache in a fresh folder, no shipped table."""
    calls = []

    def fake_time_us(fn, copies, label=""):
        calls.append(label)
        return TIMES[label.rsplit(" ", 1)[1]]

    monkeypatch.setattr(gemv, "_time_us", fake_time_us)
    monkeypatch.setattr(gemv, "_interpreted", lambda: False)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setenv("UNIMAX_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(choices, "SHIPPED", tmp_path / "shipped")
    monkeypatch.setattr(choices, "PENDING", [])
    was = choices.deferred()  # (the app's tests in this process may have deferred them)
    choices.defer(False)
    choices.forget_known()
    yield calls
    choices.defer(was)
    choices.forget_known()


def choose(table, key=(1, 64, 32, "bf16"), names=NAMES, default="rows@a"):
    return gemv.timed_choice(table, key, names, default, True, lambda name, w: None,
                             (torch.empty(64 << 20, dtype=torch.uint8),))  # (2 copies timed)


def test_a_choice_is_timed_at_first_use_by_default_and_not_written(timing, tmp_path):
    table = choices.ChoiceTable("test-now")
    assert choose(table) == "rows@b" and len(timing) == 3
    assert choose(table) == "rows@b" and len(timing) == 3  # kept: timed once
    assert not (tmp_path / "cache").exists()  # benches and tests leave the user's cache alone


def test_a_deferred_choice_takes_its_default_and_is_timed_for_the_next_start(timing):
    choices.defer()
    table = choices.ChoiceTable("test-later")
    assert choose(table) == "rows@a" and timing == []  # nothing timed before the reply
    assert len(choices.PENDING) == 1
    assert choose(table) == "rows@a" and len(choices.PENDING) == 1  # (once per key)
    assert choices.tune_pending() == 1 and len(timing) == 3 and not choices.PENDING
    assert table[(1, 64, 32, "bf16")] == "rows@a"  # the live process keeps its graphs' choice
    # the next start: a new process's table, the cache read again, nothing timed
    choices.forget_known()
    timing.clear()
    again = choices.ChoiceTable("test-later")
    assert choose(again) == "rows@b" and timing == []
    # another shape is still unknown: deferred again
    assert choose(again, key=(2, 64, 32, "bf16")) == "rows@a" and len(choices.PENDING) == 1


def test_the_shipped_table_answers_unless_its_kernel_is_gone(timing, tmp_path):
    (tmp_path / "shipped").mkdir()
    table = choices.ChoiceTable("test-shipped")
    key, gone = (1, 64, 32, "bf16"), (3, 64, 32, "bf16")
    (tmp_path / "shipped" / f"{choices.arch()}.json").write_text(json.dumps({"tables": {
        "test-shipped": {repr(key): repr("cublas"), repr(gone): repr("rows@renamed")}}}))
    assert choose(table, key) == "cublas" and timing == []
    assert choose(table, gone) == "rows@b" and len(timing) == 3  # not a candidate: timed
    # the disk cache (this machine's own timing) wins over the shipped table
    choices.remember([(table, key, "rows@a")])
    choices.forget_known()
    assert choose(choices.ChoiceTable("test-shipped"), key) == "rows@a"
    assert choices.snapshot()["test-shipped"][repr(key)] == repr("rows@a")


def test_a_broken_cache_file_is_ignored(timing):
    choices.defer()
    path = choices._cache_file()
    path.parent.mkdir(parents=True)
    path.write_text("{not json")  # (a crash mid-write, an edit by hand)
    assert choose(choices.ChoiceTable("test-broken")) == "rows@a" and timing == []
    assert choices.tune_pending() == 1
    assert json.loads(path.read_text())["tables"]["test-broken"]


def test_the_service_tunes_deferred_choices_on_its_engine_thread_between_replies(timing):
    from unimax.presets import Preset
    from unimax.service import EngineService, GenerationSettings

    choices.defer()
    table = choices.ChoiceTable("test-service")
    for m in range(3):
        choose(table, key=(m, 64, 32, "bf16"))
    assert len(choices.PENDING) == 3
    threads = []
    for pending in choices.PENDING:
        timed = pending.time
        pending.time = lambda timed=timed: (threads.append(threading.current_thread().name),
                                            timed())[1]
    svc = EngineService(Preset(model="tiny-random", block_size=4,
                               generation=GenerationSettings(max_new_tokens=4))).start()
    try:
        finished = []
        svc.warm_up_in_background(on_done=lambda s, err: finished.append(err)).join(120)
        assert finished == [None] and not choices.PENDING
        assert threads == ["unimax-engine"] * 3
        assert svc.warm_up_snapshot()["tuning"] == 0
        choices.forget_known()
        fresh = choices.ChoiceTable("test-service")
        assert all(choose(fresh, key=(m, 64, 32, "bf16")) == "rows@b" for m in range(3))
    finally:
        svc.stop()


def test_a_pdl_choice_is_remembered_and_then_captured_alone(timing, monkeypatch):
    """PDL "auto"'s choice (unimax.graph.timed_pdl_choice): timed by capturing each setting,
    written to the disk cache while choices are deferred (the app), and at the next start the
    remembered setting is the only one captured."""
    from unimax import graph

    monkeypatch.setattr(graph.pdl, "auto_triggers", lambda: ("start", "end"))
    ms = {(False, "start"): 5.0, ("fp8", "start"): 4.0, ("fp8", "end"): 4.5}

    class Runner:
        def __init__(self):
            self.graphs, self.replay_ms, self.captured = {}, {}, []

        def forget(self, key):
            self.graphs.pop(key, None)
            self.replay_ms.pop(key, None)

    def capture_into(runner):
        def capture(setting, trigger):
            runner.captured.append((setting, trigger))
            runner.graphs["block"] = f"graph {setting} {trigger}"
            runner.replay_ms["block"] = ms[setting, trigger]
        return capture

    choices.defer()
    signature = ("decoder", "full", 32, 2560)
    runner = Runner()
    kept = graph.timed_pdl_choice(runner, "block", "fp8", capture_into(runner), signature)
    assert kept[:2] == ("fp8", "start") and len(runner.captured) == 3
    assert runner.graphs["block"] == "graph fp8 start"
    choices.forget_known()  # the next start
    again = Runner()
    kept = graph.timed_pdl_choice(again, "block", "fp8", capture_into(again), signature)
    assert kept == ("fp8", "start", {}) and again.captured == [("fp8", "start")]
