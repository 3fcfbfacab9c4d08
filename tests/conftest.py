import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

# An importable flash-linear-attention makes transformers run its Qwen3.5 reference through
# Triton kernels, which fail on CPU tensors. Hide fla unless a GPU run asks for it
# (UNIMAX_ALLOW_FLA=1 pytest -m gpu); fla's own reference runs in a child process.
if os.environ.get("UNIMAX_ALLOW_FLA") != "1":
    sys.modules.setdefault("fla", None)


# Test files whose tools the GPU machine's image lacks (the app's client, the browser driver):
# not collected in a `-m gpu` run there; everywhere else a missing tool is an error, not a skip.
APP_TOOLS = {"test_app.py": "gradio_client", "test_browser.py": "playwright"}


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
