"""GPU (UNIMAX_ALLOW_FLA=1 pytest -m gpu): log-probabilities from the exact model on CUDA
(unimax/logprobs.py: the prompt in chunks through fla's chunked kernels, then one-token steps),
against one full forward of the whole sequence and the exact greedy reference, in BF16, pure
GDN and a Qwen3.5 hybrid checkpoint written by transformers (its KV in the static buffers)."""

import copy

import pytest
import torch

import unimax
from helpers import gpu_model, gpu_prompt, require_fla, write_qwen_checkpoint
from unimax import logprobs

pytestmark = pytest.mark.gpu


def hybrid(tmp_path):
    write_qwen_checkpoint(tmp_path, seed=4, num_layers=4, vocab=512, hidden=128,
                          layer_types=["linear_attention", "full_attention"] * 2)
    return unimax.load_model(tmp_path, device="cuda", dtype="bfloat16", max_context=512)


@pytest.mark.parametrize("kind", ["pure", "hybrid"])
def test_logprobs_match_a_full_forward_on_gpu(kind, tmp_path):
    require_fla()
    model = gpu_model() if kind == "pure" else hybrid(tmp_path)
    ids = gpu_prompt(150, seed=3)

    def prompt_logprobs(m):
        with torch.no_grad():
            full = m(input_ids=ids).logits[0].float().log_softmax(-1)
        return full[:-1].gather(-1, ids[0, 1:, None])[:, 0].cpu()

    want = prompt_logprobs(model)
    # The same weights in float32: the BF16 paths (one token at a time, chunks, one forward)
    # each round apart from it; a misaligned row or a lost state would be off by whole units.
    exact = prompt_logprobs(copy.deepcopy(model).float())
    bound = (want - exact).abs()
    for chunk in (1, 64, 150):
        cache = model.make_recurrent_cache()
        entries, last = logprobs.prefill(model, cache, ids, 3, chunk=chunk)
        got = torch.tensor([e.logprob for e in entries[1:]])
        err = (got - exact).abs()
        print(kind, chunk, f"off float32: mean {err.mean():.4f} max {err.max():.4f}; one "
              f"BF16 forward: mean {bound.mean():.4f} max {bound.max():.4f}")
        assert err.mean() <= 2 * bound.mean() + 1e-3, (kind, chunk)
        assert err.max() <= max(3 * bound.max(), 0.05), (kind, chunk)
        assert all(e.top[0][1] >= e.logprob - 1e-6 for e in entries[1:])
        entries, stopped = logprobs.generate(model, cache, last, 16, 2)
        assert stopped == "length" and len(entries) == 16
        if chunk == 150:  # one prefill forward, as the reference takes
            assert [e.token for e in entries] == \
                unimax.exact_greedy_tokens(model, ids, 16)[0].tolist()
