"""GPU (UNIMAX_ALLOW_FLA=1 pytest -m gpu): log-probabilities from the exact model on CUDA
(unimax/logprobs.py: the prompt in chunks through fla's chunked kernels, then one-token steps),
against one full forward of the whole sequence and the exact greedy reference, in BF16, pure
GDN and a Qwen3.5 hybrid checkpoint written by transformers (its KV in the static buffers)."""

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
    with torch.no_grad():
        full = model(input_ids=ids).logits[0].float().log_softmax(-1)
    for chunk in (1, 64, 150):
        cache = model.make_recurrent_cache()
        entries, last = logprobs.prefill(model, cache, ids, 3, chunk=chunk)
        got = torch.tensor([e.logprob for e in entries[1:]])
        want = full[:-1].gather(-1, ids[0, 1:, None])[:, 0].cpu()
        # BF16 activations: chunked and whole forwards round apart by a few ulps of the logits
        assert (got - want).abs().max() < 0.1, (kind, chunk)
        assert all(e.top[0][1] >= e.logprob - 1e-6 for e in entries[1:])
        entries, stopped = logprobs.generate(model, cache, last, 16, 2)
        assert stopped == "length" and len(entries) == 16
        if chunk == 150:  # one prefill forward, as the reference takes
            assert [e.token for e in entries] == \
                unimax.exact_greedy_tokens(model, ids, 16)[0].tolist()
