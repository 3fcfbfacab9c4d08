"""The real app launched on a free port with its default preset (the shipped demo model), driven
by gradio_client."""

import pytest
from app_server import running_app
from gradio_client import Client

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
