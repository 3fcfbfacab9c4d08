import os
import sys
from pathlib import Path

import pytest
import torch

# tests/ (helpers, app_server) and each component's folder: a test imports another's helpers
# by module name (from test_engine import erring_engine), wherever the two live
HERE = Path(__file__).resolve().parent
for folder in (HERE, *sorted(p for p in HERE.iterdir() if p.is_dir() and
                             p.name not in ("__pycache__",))):
    sys.path.insert(0, str(folder))

# The CPU suite's models are tiny: an op is microseconds of work, and a second intra-op thread
# costs more in hand-offs than it saves (a verified reply of test_speculative.py's: 19 ms with
# two threads, 6.6 with one, on a 2-core machine). UNIMAX_TEST_THREADS sets another count.
if not torch.cuda.is_available():
    torch.set_num_threads(int(os.environ.get("UNIMAX_TEST_THREADS", "1")))

# An importable flash-linear-attention makes transformers run its Qwen3.5 reference through
# Triton kernels, which fail on CPU tensors. Hide fla unless a GPU run asks for it
# (UNIMAX_ALLOW_FLA=1 pytest -m gpu); fla's own reference runs in a child process.
if os.environ.get("UNIMAX_ALLOW_FLA") != "1":
    sys.modules.setdefault("fla", None)


# Test files whose tools the GPU machine's image lacks (the app's client, the browser driver):
# not collected in a `-m gpu` run there; everywhere else a missing tool is an error, not a skip.
APP_TOOLS = {"test_app.py": "gradio_client", "test_browser.py": "playwright",
             "test_openai_api.py": "openai", "test_openai_logprobs.py": "openai",
             "test_page_logic.py": "gradio"}


def pytest_ignore_collect(collection_path, config):
    needs = APP_TOOLS.get(Path(str(collection_path)).name)
    if needs and "gpu" in (config.getoption("-m") or ""):
        import importlib.util

        return importlib.util.find_spec(needs) is None or None
    return None


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the lent H200: pytest -m gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="module", params=["pure", "hybrid"])
def pure_or_hybrid(request, tmp_path_factory):
    """A small fp32 CPU model, each test twice: pure GDN (test_engine's CONFIG), and a hybrid
    Qwen3.5 checkpoint written by transformers (GDN and attention layers alternating, KV
    buffers of 300 tokens)."""
    from test_engine import CONFIG

    import unimax
    from helpers import write_qwen_checkpoint

    if request.param == "pure":
        model = unimax.GDNForCausalLM(CONFIG).eval()
        model.init_random_weights(seed=3, std=0.1)
        return model
    path = tmp_path_factory.mktemp("hybrid")
    write_qwen_checkpoint(path, seed=6, num_layers=4,
                          layer_types=["linear_attention", "full_attention"] * 2)
    return unimax.load_model(path, device="cpu", dtype="float32", max_context=300)


@pytest.fixture(scope="module")
def api_server():
    """The real app (python app.py) on its default preset, the demo model: one per test module
    of the OpenAI API."""
    from app_server import running_app

    with running_app() as url:
        yield url


@pytest.fixture(scope="module")
def api_client(api_server):
    """The official ``openai`` client on that app."""
    import openai

    return openai.OpenAI(base_url=api_server + "v1", api_key="unused", max_retries=0,
                         timeout=120)
