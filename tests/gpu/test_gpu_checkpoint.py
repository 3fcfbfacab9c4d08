"""GPU (UNIMAX_ALLOW_FLA=1 pytest -m gpu): a checkpoint written by transformers' Qwen3.5 loads
on CUDA to the CPU's logits and greedy tokens. A file of its own so that tests/gpu.sh runs
it in a process of its own (at the end of tests/gpu/test_gpu.py it was cut by
that process's 560 s)."""

import pytest
import torch

import unimax
from helpers import rel_err, require_fla, write_qwen_checkpoint

pytestmark = pytest.mark.gpu


@torch.inference_mode()
def test_checkpoint_on_cuda_matches_cpu(tmp_path):
    require_fla()
    write_qwen_checkpoint(tmp_path, seed=3)
    cpu = unimax.load_model(tmp_path, device="cpu", dtype="float32")
    gpu = unimax.load_model(tmp_path, device="cuda", dtype="float32")
    ids = torch.randint(0, 97, (1, 150))
    expected = cpu(input_ids=ids).logits
    got = gpu(input_ids=ids.cuda()).logits.cpu()
    assert rel_err(got, expected) < 5e-3
    greedy_cpu = unimax.exact_greedy_tokens(cpu, ids, 16)
    greedy_gpu = unimax.exact_greedy_tokens(gpu, ids.cuda(), 16).cpu()
    assert torch.equal(greedy_cpu, greedy_gpu)
