"""The real app launched on a free port with its default preset (the shipped demo model), driven
by gradio_client."""

import pytest
from app_server import free_port, running_app
from gradio_client import Client

from app import chosen_preset, parse_args
from app import main as app_main


@pytest.fixture(scope="module")
def client():
    with running_app() as url:
        yield Client(url, verbose=False)


@pytest.mark.parametrize("mode", ["bf16", "fp8", "verified"])
def test_chat_streams_in_each_mode(client, mode):
    job = client.submit("Hello there", mode, api_name="/chat")
    updates = list(job)
    final = job.result()
    assert final and len(updates) >= 2  # streamed, not one blob
    assert all(final.startswith(u) for u in updates)  # each update extends the last
    stats = client.predict(api_name="/stats")
    assert stats["mode"] == mode
    for key in ("mode", "bridge_mib", "bridge_ms", "acceptance_rate", "decode_tok_s",
                "prefill_tok_s", "ttft_ms", "prefilled_tokens"):
        assert key in stats
    assert stats["prefilled_tokens"] > 0 and stats["bridge_mib"] > 0
    if mode == "verified":
        assert 0 <= stats["acceptance_rate"] <= 1


def test_bad_inputs_get_errors(client):
    with pytest.raises(Exception, match="unknown mode 'turbo'"):
        client.predict("Hello", "turbo", api_name="/chat")
    with pytest.raises(Exception, match="empty message"):
        client.predict("   ", "bf16", api_name="/chat")
    with pytest.raises(Exception, match="over this model's context setting"):
        client.predict("hello " * 6000, "bf16", api_name="/chat")  # > max_context tokens
    assert client.predict("still serving", "bf16", api_name="/chat")


def test_bad_preset_and_model_path(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("mode: turbo\n")
    assert app_main(["--preset", str(bad)]) == 2
    assert "'mode' has the value 'turbo'" in capsys.readouterr().err
    assert app_main(["--model", str(tmp_path / "missing")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_a_non_utf8_preset_and_a_list_config_are_named_in_one_line(tmp_path, capsys):
    """Both gave tracebacks."""
    latin = tmp_path / "latin.yaml"
    latin.write_bytes("examples: [\"caf\xe9\"]\n".encode("latin-1"))
    assert app_main(["--preset", str(latin), "--port", str(free_port())]) == 2
    err = capsys.readouterr().err.strip()
    assert "not UTF-8" in err and str(latin) in err and len(err.splitlines()) == 1
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("[1, 2]")
    assert app_main(["--model", str(model), "--port", str(free_port())]) == 2
    err = capsys.readouterr().err.strip()
    assert "JSON list, not the object" in err and len(err.splitlines()) == 1


def test_an_immediate_restart_finds_its_port_free():
    """The port check bound without SO_REUSEADDR, so for ~60 s after a restart (the old
    server's connections in TIME_WAIT) the app refused to start."""
    import socket

    from app import port_problem

    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port))
        conn, _ = server.accept()
        conn.close()  # the server side closes first: its end lingers in TIME_WAIT
        client.close()
    assert port_problem("127.0.0.1", port) is None


def test_command_line_model_drops_the_presets_examples():
    """The default preset's example questions are about the demo model's docs: another model
    given by --model gets none (its preset's mode and settings stay)."""
    default = chosen_preset(parse_args([]))
    assert default.model == "unimax-demo" and "What does json.dumps do?" in default.examples
    assert chosen_preset(parse_args(["--model", "unimax-demo", "--mode", "fp8"])).examples \
        == default.examples
    other = chosen_preset(parse_args(["--model", "Qwen/Qwen3.5-0.8B", "--mode", "verified"]))
    assert other.examples == () and other.mode == "verified"
    assert other.max_context == default.max_context


@pytest.mark.parametrize("cuda_build", [None, "12.8"])
def test_a_gpu_preset_without_a_gpu_says_so_before_loading(tmp_path, capsys, monkeypatch,
                                                             cuda_build):
    """The shipped GPU presets say device: cuda; on a machine without one the app names that
    (and a CPU-only PyTorch) in one line, where it used to announce a CPU run and then fail to
    load on the device."""
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", cuda_build)
    preset = tmp_path / "gpu.yaml"
    preset.write_text("model: tiny-random\ndevice: cuda\n")
    assert app_main(["--preset", str(preset), "--port", str(free_port())]) == 2
    out = capsys.readouterr()
    assert "running on the CPU" not in out.out
    err = out.err.strip()
    assert "asks for device: cuda" in err and "device: cpu" in err and len(err.splitlines()) == 1
    assert ("CPU build" in err) == (cuda_build is None)


def test_upload_size_is_capped(client):
    """Gradio's upload route took 20 MiB: the app caps it (app.MAX_UPLOAD)."""
    import httpx  # gradio's own HTTP client

    url = client.src.rstrip("/") + "/gradio_api/upload"
    small = httpx.post(url, files={"files": ("a.json", b"{}")}, timeout=30)
    assert small.status_code == 200
    big = httpx.post(url, files={"files": ("b.json", b"x" * (3 << 20))}, timeout=30)
    assert big.status_code in (400, 413) and "size" in big.text.lower(), big.text[:200]


def test_port_in_use_or_out_of_range_fails_before_loading(capsys, monkeypatch):
    import socket

    import unimax.service

    monkeypatch.setattr(unimax.service, "EngineService",
                        lambda *a, **k: pytest.fail("the model loaded before the port check"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert app_main(["--port", str(port)]) == 2
    err = capsys.readouterr().err.strip()
    assert f"cannot serve on 127.0.0.1:{port}" in err and "--port" in err
    assert len(err.splitlines()) == 1
    assert app_main(["--port", "70000"]) == 2
    assert "outside 1..65535" in capsys.readouterr().err


def test_corrupt_weights_named_in_one_line(tmp_path, capsys):
    from helpers import write_qwen_checkpoint

    write_qwen_checkpoint(tmp_path, seed=0)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:300])  # a truncated download
    capsys.readouterr()
    port = str(free_port())
    assert app_main(["--model", str(tmp_path), "--port", port]) == 2
    err = capsys.readouterr().err.strip()
    assert str(weights) in err and "truncated or corrupt" in err and len(err.splitlines()) == 1
    weights.write_text("not weights at all")
    assert app_main(["--model", str(tmp_path), "--port", port]) == 2
    assert str(weights) in capsys.readouterr().err


def test_exports_are_cleaned_up(tmp_path):
    import json
    import os
    import subprocess
    import sys
    import time

    from helpers import ROOT
    from ui.chat_tab import Exports

    exports = Exports(max_age_s=60)
    first = exports.write({"a": 1})
    assert json.loads(open(first).read()) == {"a": 1}
    os.utime(first, (time.time() - 120, time.time() - 120))
    second = exports.write({"b": 2})
    assert not os.path.exists(first) and os.path.exists(second)
    child = ("from ui.chat_tab import Exports; e = Exports(); print(e.write({'x': 1}))")
    path = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True,
                          check=True, cwd=ROOT
                          ).stdout.strip()
    assert path.endswith(".json") and not os.path.exists(os.path.dirname(path))


def test_api_page_lists_only_the_public_endpoints(client):
    info = client.view_api(return_format="dict", print_info=False)
    assert set(info["named_endpoints"]) == {"/chat", "/stats"}
    assert not info["unnamed_endpoints"]
    params = info["named_endpoints"]["/chat"]["parameters"]
    assert [p["parameter_name"] for p in params] == ["message", "mode"]
    assert params[0]["python_type"]["type"] == "str"
    assert all(m in params[1]["python_type"]["type"] for m in ("bf16", "fp8", "verified"))
    # typed returns, not "Any": the reply text, and the stats object
    returns = {name: [r["python_type"]["type"] for r in info["named_endpoints"][name]["returns"]]
               for name in ("/chat", "/stats")}
    assert returns == {"/chat": ["str"], "/stats": ["dict(str, Any)"]}, returns
