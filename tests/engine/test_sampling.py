"""The on-device sampler against its plain twin, on random logits and settings, and the tokens
its filters keep against transformers' own logits warpers."""

import pytest
import torch

from unimax.sampling import SamplingParams, sample_from_logits, sample_reference, warped_probs


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [
    (1.0, 0, 1.0, 0.0), (0.7, 5, 1.0, 0.0), (1.3, 0, 0.8, 0.0), (0.5, 20, 0.5, 0.0),
    (2.0, 1, 1.0, 0.0), (1.0, 0, 0.01, 0.0), (1.0, 0, 1.0, 0.1), (1.5, 10, 0.9, 0.05),
    (0.8, 0, 1.0, 1.0)])
def test_sampler_matches_reference(temperature, top_k, top_p, min_p):
    gen = torch.Generator().manual_seed(int(temperature * 100) + top_k)
    params = SamplingParams(temperature, top_k, top_p, min_p=min_p)
    for _ in range(40):
        logits = 3 * torch.randn(1, 50, generator=gen)
        u = float(torch.rand(1, generator=gen))
        got = sample_from_logits(logits, torch.tensor([temperature]), torch.tensor([top_k]),
                                 torch.tensor([top_p]), torch.tensor([u]),
                                 torch.tensor([min_p]))
        assert int(got) == sample_reference(logits, params, u)


@pytest.mark.parametrize("temperature,top_k,top_p,min_p", [
    (1.0, 0, 1.0, 0.1), (0.7, 8, 1.0, 0.05), (1.3, 0, 0.9, 0.02), (1.0, 20, 0.7, 0.2)])
def test_kept_tokens_are_transformers_warpers(temperature, top_k, top_p, min_p):
    """The tokens with mass after our filters are those transformers' warpers leave finite,
    applied in its order: temperature, top-k, top-p, min-p."""
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        MinPLogitsWarper,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    warpers = LogitsProcessorList([TemperatureLogitsWarper(temperature)] + (
        [TopKLogitsWarper(top_k)] if top_k else []) + (
        [TopPLogitsWarper(top_p)] if top_p < 1 else []) + [MinPLogitsWarper(min_p)])
    gen = torch.Generator().manual_seed(top_k)
    logits = 3 * torch.randn(16, 200, generator=gen, dtype=torch.float64)
    theirs = torch.isfinite(warpers(None, logits.clone()))
    ours = warped_probs(logits, torch.tensor([temperature]), torch.tensor([top_k]),
                        torch.tensor([top_p]), torch.tensor([min_p])) > 0
    assert torch.equal(ours, theirs)
    assert (theirs.sum(-1) < 200).all()  # the filters cut


def test_top_k_one_is_greedy():
    logits = torch.randn(1, 30)
    got = sample_from_logits(logits, torch.tensor([1.0]), torch.tensor([1]), torch.tensor([1.0]),
                             torch.tensor([0.999]))
    assert int(got) == int(logits.argmax())
