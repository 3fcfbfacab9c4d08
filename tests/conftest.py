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


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run on the lent H200: pytest -m gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
