"""The on-device sampler against its plain twin, on random logits and settings."""

import pytest
import torch

from unimax.sampling import SamplingParams, sample_from_logits, sample_reference


@pytest.mark.parametrize("temperature,top_k,top_p", [
    (1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.5, 20, 0.5), (2.0, 1, 1.0), (1.0, 0, 0.01)])
def test_sampler_matches_reference(temperature, top_k, top_p):
    gen = torch.Generator().manual_seed(int(temperature * 100) + top_k)
    params = SamplingParams(temperature, top_k, top_p)
    for _ in range(40):
        logits = 3 * torch.randn(1, 50, generator=gen)
        u = float(torch.rand(1, generator=gen))
        got = sample_from_logits(logits, torch.tensor([temperature]), torch.tensor([top_k]),
                                 torch.tensor([top_p]), torch.tensor([u]))
        assert int(got) == sample_reference(logits, params, u)


def test_top_k_one_is_greedy():
    logits = torch.randn(1, 30)
    got = sample_from_logits(logits, torch.tensor([1.0]), torch.tensor([1]), torch.tensor([1.0]),
                             torch.tensor([0.999]))
    assert int(got) == int(logits.argmax())
