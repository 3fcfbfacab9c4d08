"""The decode step's recurrence as our kernel with a programmatic-launch form (unimax.ops.
decode_step.STEP_PDL, step_recurrence_kernel.py): bit for bit fla's fused recurrent kernel at
one token in Triton's interpreter, its PDL form compiled for sm_90 in the order it relies on,
and which launches take it (the switch, the PDL setting, the layer's weights)."""

import torch

from helpers import randomize_, run_with_triton
from unimax import GDNForCausalLM, build_engine
from unimax.tiny import TINY_CONFIG

CHILD = """
import torch
from unimax.ops.decode_step import decay, launch_recurrent, launch_step
from unimax.ops.gated_delta import recurrent_gated_delta_rule_ref
torch.manual_seed(0)
for batch, heads, value_heads, dk, dv, sigmoid in ((1, 2, 4, 16, 32, False),
                                                  (2, 2, 4, 16, 32, True),
                                                  (1, 1, 3, 32, 8, False),
                                                  (1, 2, 2, 16, 24, True)):
    q, k = torch.randn(2, batch, 1, heads, dk).to(torch.bfloat16)
    v = torch.randn(batch, 1, value_heads, dv).to(torch.bfloat16)
    a = torch.randn(batch, 1, value_heads)
    b = torch.randn(batch, 1, value_heads)
    beta = b if sigmoid else b.sigmoid().to(torch.bfloat16)
    A_log, dt_bias = torch.randn(value_heads), torch.randn(value_heads)
    state = torch.randn(batch, value_heads, dk, dv)
    ours, theirs = state.clone(), state.clone()
    o = launch_step(q, k, v, a, beta, ours, A_log, dt_bias, beta_sigmoid=sigmoid)
    o_fla = launch_recurrent(q, k, v, a, beta, theirs, A_log, dt_bias, beta_sigmoid=sigmoid)
    # fla's kernel at one token, bit for bit (output and the state written in place)
    assert torch.equal(o, o_fla) and torch.equal(ours, theirs), (batch, heads, value_heads)
    # and the twin's arithmetic to fp32 summation order
    o_ref, s_ref = recurrent_gated_delta_rule_ref(
        q, k, v, decay(a, A_log, dt_bias), b.sigmoid() if sigmoid else beta, state)
    assert float((ours - s_ref).abs().max()) < 1e-5
    assert float((o.float() - o_ref.float()).abs().max()) <= 2 ** -7 * float(o_ref.abs().max())
    print("ok", batch, heads, value_heads, dk, dv, sigmoid)
try:
    launch_step(q.expand(2, batch, 2, heads, dk)[0], k, v, a, beta, ours, A_log, dt_bias)
except ValueError as err:
    print("refused", err)
"""


def test_step_kernel_is_flas_kernel_bit_for_bit_in_the_interpreter():
    """Our one-token kernel (no PDL: the interpreter has no PTX) against fla's fused recurrent
    kernel as ops.decode_step launches it: equal outputs and states, bit for bit, with beta
    given or taken as logits (the draft's step), grouped value heads, two sequences and a
    value width that is not a power of two; both within fp32 summation of the torch twin.
    More than one token is refused by name."""
    out = run_with_triton(CHILD, needs="fla")
    lines = out.splitlines()
    assert sum(line.startswith("ok") for line in lines) == 4, out
    assert "refused launch_step: one token, got 2" in lines, out


PTX_CHILD = r"""
import re
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from unimax.ops.step_recurrence_kernel import step_recurrence_kernel as fn

sig = {name: "*bf16" for name in ("q", "k", "v", "o")}
sig.update({"a": "*fp32", "beta": "*bf16", "A_log": "*fp32", "dt_bias": "*fp32", "h": "*fp32",
            "scale": "fp32"})
for name in ("H", "HV", "K", "V", "BK", "BV", "BETA_SIGMOID", "PDL"):
    sig[name] = "constexpr"
for arch, pdl in ((90, False), (90, True), (89, False)):
    consts = {"H": 16, "HV": 32, "K": 128, "V": 128, "BK": 128, "BV": 8, "BETA_SIGMOID": True,
              "PDL": pdl}
    asm = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=consts),
                         target=GPUTarget("cuda", arch, 32), options={"num_warps": 1}).asm
    lines = asm["ptx"].splitlines()
    def where(pattern):
        return [i for i, line in enumerate(lines) if re.search(pattern, line)]
    trigger, wait = where("griddepcontrol.launch_dependents"), where("griddepcontrol.wait")
    loads = where(r"ld\.global")
    # before the wait: the signal and the two constants' loads only
    early = [i for i in loads if wait and i < wait[0]]
    print(arch, pdl, len(trigger), len(wait), len(early),
          bool(trigger and wait and trigger[0] < wait[0]), len(asm["cubin"]) > 0)
"""


def test_step_kernel_pdl_form_compiles_for_hopper():
    """The PDL form, compiled for sm_90 without a GPU: it signals its dependents, then loads
    only A_log and dt_bias before it waits for the kernel before it (q, k, v, the gates and
    the state after); without PDL (sm_90, and sm_89 for the L4), neither instruction."""
    out = run_with_triton(PTX_CHILD, needs="fla", interpret=False)
    rows = [line.split() for line in out.strip().splitlines()]
    assert rows == [["90", "False", "0", "0", "0", "False", "True"],
                    ["90", "True", "1", "1", "2", "True", "True"],
                    ["89", "False", "0", "0", "0", "False", "True"]], rows


def test_step_pdl_follows_the_switch_the_setting_and_the_weights(monkeypatch):
    """ops.decode_step.step_pdl: never while STEP_PDL is off or on a device without PDL (a CPU);
    with it on, where the GEMVs over the layer's weights launch programmatically: all under
    PDL True, the FP8 layers' (the draft's) only under "fp8", none under False."""
    import unimax.ops.decode_step as decode_step
    import unimax.ops.fused_gemv as fused_gemv

    cpu = torch.device("cpu")
    monkeypatch.setattr(fused_gemv, "PDL", True)
    assert not decode_step.step_pdl(cpu, True)  # (off by default)
    monkeypatch.setattr(decode_step, "STEP_PDL", True)
    assert not decode_step.step_pdl(cpu, True)  # (a CPU: no programmatic launch)
    monkeypatch.setattr(fused_gemv, "pdl_possible", lambda device: True)
    for setting, wanted in ((True, (True, True)), ("fp8", (True, False)),
                            (False, (False, False))):
        monkeypatch.setattr(fused_gemv, "PDL", setting)
        assert (decode_step.step_pdl(cpu, True), decode_step.step_pdl(cpu, False)) == wanted


def test_layers_tell_the_op_whether_their_weights_are_fp8(monkeypatch):
    """The steps' mixers pass their in-projection's weight type to the op (``fp8_weights``):
    the full-FP8 draft's layers say FP8, BF16-only's say not (CPU: the op's twin runs)."""
    import unimax.layers as layers

    seen = []
    real = layers.gdn_decode_step

    def spy(*args):
        seen.append(args[11])
        return real(*args)

    monkeypatch.setattr(layers, "gdn_decode_step", spy)
    model = GDNForCausalLM(TINY_CONFIG).eval()
    randomize_(model, seed=2)
    x = torch.randint(0, model.config.vocab_size, (1, 6))
    for decode, draft, fp8 in (("bf16", "tail", False), ("fp8", "full", True)):
        seen.clear()
        build_engine(model, decode=decode, draft=draft, block_size=2).generate_fast(x, 3)
        assert seen and set(seen) == {fp8}, (decode, seen[:4])
