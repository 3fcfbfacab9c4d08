"""The kernel configuration (unimax.kernels): validated when made, in force per thread, kept by
each engine for its own calls, so that two engines built with two configurations run side by
side in one process (the benches' A/Bs) without either seeing the other's."""

import threading

import pytest
import torch

from unimax import GDNConfig, GDNForCausalLM, KernelConfig, build_engine, kernels

CONFIG = GDNConfig(vocab_size=97, hidden_size=64, num_hidden_layers=2, num_k_heads=2,
                   num_v_heads=4, head_k_dim=16, head_v_dim=16, intermediate_size=128)


@pytest.mark.parametrize("changes, message", [
    ({"pdl": "bf16"}, "pdl must be False, True, 'fp8' or 'auto', got 'bf16'"),
    ({"pdl_trigger": "middle"}, "pdl_trigger must be 'start', 'end' or 'auto', got 'middle'"),
    ({"decode_attention_tokens": -1}, "decode_attention_tokens must be an integer >= 0"),
    ({"rows_attention_max": 2.5}, "rows_attention_max must be an integer >= 0"),
    ({"shortest_span_block": 0}, "shortest_span_block must be >= 1"),
])
def test_a_bad_configuration_is_refused_by_name(changes, message):
    with pytest.raises(ValueError, match=message):
        KernelConfig(**changes)
    with pytest.raises(TypeError, match="kernels must be a unimax.kernels.KernelConfig"):
        build_engine(GDNForCausalLM.random(CONFIG), kernels={"tma": False})


def test_using_nests_restores_and_stays_on_its_thread():
    assert kernels.active() is kernels.DEFAULT
    other = kernels.DEFAULT.but(tma=False)
    seen = []
    with kernels.using(other):
        assert kernels.active() is other
        with kernels.using(None):  # (None: whatever is in force)
            assert kernels.active() is other
        with kernels.using(other.but(fuse_int4=False)) as inner:
            assert kernels.active() is inner and not inner.fuse_int4 and not inner.tma
        assert kernels.active() is other
        thread = threading.Thread(target=lambda: seen.append(kernels.active()))
        thread.start()
        thread.join()
    assert seen == [kernels.DEFAULT]  # another thread: the default
    assert kernels.active() is kernels.DEFAULT


def test_each_engine_keeps_its_configuration_for_its_own_calls():
    """Two engines, one with a non-default configuration, built and run in one process: each
    call of each engine runs under its own configuration (seen from inside its forwards), what
    it builds follows it (the verifier's span blocks and rewind), outside them the default
    holds, and both decode the exact greedy tokens."""
    model = GDNForCausalLM.random(CONFIG, seed=1)
    other = kernels.DEFAULT.but(shortest_span_block=4, one_pass_rewind=False, tma=False)
    plain = build_engine(model, block_size=16)
    changed = build_engine(model, block_size=16, kernels=other)
    assert plain.kernels is kernels.DEFAULT and changed.kernels is other
    seen = []
    forward = model.forward_unchecked

    def spy(*args, **kwargs):
        seen.append(kernels.active())
        return forward(*args, **kwargs)

    model.forward_unchecked = spy
    try:
        prompt = torch.randint(0, CONFIG.vocab_size, (1, 9),
                               generator=torch.Generator().manual_seed(0))
        a, _ = plain.generate_verified(prompt, 20)
        seen_plain, seen[:] = set(map(id, seen)), []
        b, _ = changed.generate_verified(prompt, 20)
        seen_changed = set(map(id, seen))
    finally:
        del model.forward_unchecked
    assert seen_plain == {id(kernels.DEFAULT)} and seen_changed == {id(other)}
    assert kernels.active() is kernels.DEFAULT
    assert plain.verifier.span_blocks == (8, 16) and plain.verifier.one_pass
    assert changed.verifier.span_blocks == (4, 8, 16) and not changed.verifier.one_pass
    assert torch.equal(a, b)
    from unimax import exact_greedy_tokens

    assert torch.equal(a, exact_greedy_tokens(model, prompt, 20))


def test_an_engine_built_inside_a_configuration_keeps_it():
    """build_engine without ``kernels`` takes the configuration in force (a bench's run-wide
    setting), and keeps it after the block is left."""
    model = GDNForCausalLM.random(CONFIG)
    run = kernels.DEFAULT.but(pdl=False)
    with kernels.using(run):
        engine = build_engine(model)
    assert engine.kernels is run and kernels.active() is kernels.DEFAULT
