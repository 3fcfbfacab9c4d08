"""GPU (UNIMAX_ALLOW_FLA=1 pytest -m gpu): captured graphs equal eager decoding, verified equals
exact, the real FP8 matmul equals its emulation."""

import pytest
import torch

import unimax
from helpers import GPU_CONFIG, gpu_model, rel_err
from helpers import gpu_prompt as prompt
from unimax import SamplingParams, build_engine
from unimax.fp8 import FP8Linear

pytestmark = pytest.mark.gpu

CONFIG = GPU_CONFIG


@pytest.fixture(scope="module")
def model():
    return gpu_model()


@pytest.mark.parametrize("decode", ["bf16", "fp8"])
def test_graph_decoding_equals_eager(model, decode):
    x = prompt(100)
    graphs = build_engine(model, decode=decode, block_size=8, use_graphs=True)
    eager = build_engine(model, decode=decode, block_size=8, use_graphs=False)
    assert graphs.decode_graph.use_graphs and not eager.decode_graph.use_graphs
    a, b = graphs.generate_fast(x, 45), eager.generate_fast(x, 45)
    assert torch.equal(a, b)
    if decode == "bf16":
        assert torch.equal(a, unimax.exact_greedy_tokens(model, x, 45))
    params = SamplingParams(temperature=0.8, top_k=40, top_p=0.95, seed=7)
    assert graphs.generate(x, 30, sampling=params).tokens == \
        eager.generate(x, 30, sampling=params).tokens


@pytest.mark.parametrize("draft", ["tail", "full"])
def test_verified_on_gpu(model, draft):
    """Captured verifier and replay graphs give the eager engine's tokens exactly. Against the
    one-token-step reference, BF16 block forwards may round a near-tie the other way: any
    divergence must be such a near-tie (a wrong token would show a large logit gap)."""
    from unimax.reference import first_divergence, is_near_tie

    for length, block in ((30, 8), (200, 3)):
        x = prompt(length, seed=length)
        graphs = build_engine(model, decode="fp8", draft=draft, block_size=8)
        graphs.capture_graphs()  # every graph up front, as the app does at start-up
        eager = build_engine(model, decode="fp8", draft=draft, block_size=8, use_graphs=False)
        got, report = graphs.generate_verified(x, 64, draft_block=block)
        assert torch.equal(got, eager.generate_verified(x, 64, draft_block=block)[0])
        assert report.generated_tokens == 1 + report.accepted_draft_tokens + \
            report.verifier_blocks
        reference = unimax.exact_greedy_tokens(model, x, 64)[0].tolist()
        divergence = first_divergence(model, x, got[0].tolist(), reference)
        assert is_near_tie(divergence), divergence


def test_scaled_mm_matches_emulation():
    gen = torch.Generator(device="cuda").manual_seed(0)
    linear = torch.nn.Linear(1024, 4096, bias=False, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        linear.weight.normal_(generator=gen)
    x = torch.randn(3, 1024, device="cuda", dtype=torch.bfloat16, generator=gen)
    real, emulated = FP8Linear(linear, mode="fp8_act"), FP8Linear(linear, mode="emulated_act")
    assert FP8Linear(linear).mode == "fp8_gemv"  # the default on FP8 GPUs
    assert rel_err(real(x).float(), emulated(x).float()) < 1e-2
    assert rel_err(real(x).float(), linear(x).float()) < 6e-2
    tensorwise = FP8Linear(linear, mode="fp8_tensorwise")
    assert rel_err(tensorwise(x).float(), emulated(x).float()) < 1e-2


def test_compiled_step_matches_eager_engine(model):
    """The inductor-compiled step (build_engine(compile_step=True)) decodes like the plain
    engine; as in verification, BF16 rounding may differ only at a near-tie."""
    from unimax.reference import first_divergence, is_near_tie

    x = prompt(64, seed=11)
    compiled = build_engine(model, decode="bf16", block_size=8, compile_step=True)
    got = compiled.generate_fast(x, 48)[0].tolist()
    reference = unimax.exact_greedy_tokens(model, x, 48)[0].tolist()
    divergence = first_divergence(model, x, got, reference)
    assert is_near_tie(divergence), divergence
    assert compiled.decode_model is not model and model.layers[0].mixer.backend == "auto"
    from unimax.fast_step import GemvLinear

    assert isinstance(compiled.decode_model.lm_head, GemvLinear)
    assert compiled.decode_model.lm_head.weight is model.lm_head.weight


def test_triton_gemv_on_gpu(model):
    """The Triton kernels equal their twin with BF16 weights and (fp8_gemv mode) FP8 ones at
    M=1..16, fall back above, run inside a captured graph, and an fp8_gemv engine's graphs equal
    its eager steps."""
    from unimax.fast_step import GemvLinear
    from unimax.ops.gemv import gemv_ref

    gen = torch.Generator(device="cuda").manual_seed(0)
    for n, k in ((248320, 1024), (7168, 1024), (1024, 3584), (1000, 200)):
        linear = torch.nn.Linear(k, n, bias=False, device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            linear.weight.normal_(generator=gen)
        fp8 = FP8Linear(linear, mode="fp8_gemv")
        for m in (1, 3, 6, 16, 20, 33):  # GEMV kernel, tensor-core kernel (16 or 32 rows),
            # cuBLAS above 32
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16, generator=gen)
            padded = torch.nn.functional.pad(x, (0, fp8.pad_cols))
            ref = gemv_ref(padded, fp8.weight, fp8.weight_scale)[:, :n]
            assert rel_err(fp8(x).float(), ref.float()) < 1e-2, (n, k, m)
            bf16 = GemvLinear(linear)(x)
            assert rel_err(bf16.float(), gemv_ref(x, linear.weight).float()) < 1e-2, (n, k, m)
            assert rel_err(bf16.float(), linear(x).float()) < 1e-2, (n, k, m)
    x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16, generator=gen)
    static_out = fp8(x)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = fp8(x)
    x.copy_(torch.randn(1, k, device="cuda", dtype=torch.bfloat16, generator=gen))
    graph.replay()
    assert torch.equal(static_out, fp8(x))
    prompt_ids = prompt(60)
    graphs = build_engine(model, decode="fp8", fp8_mode="fp8_gemv", block_size=8)
    eager = build_engine(model, decode="fp8", fp8_mode="fp8_gemv", block_size=8,
                         use_graphs=False)
    assert torch.equal(graphs.generate_fast(prompt_ids, 40), eager.generate_fast(prompt_ids, 40))


def test_short_prefill_graphs_on_gpu(model):
    """Short prompts through the captured bucket graphs (fla's chunk kernel over the padded
    bucket, the masked rewind) against the eager prefill: logits and state agree to BF16
    rounding, fresh and on kept state, in the doubling buckets and the 1024-wide ones up to
    4096; longer prompts take the eager path."""
    graphs = build_engine(model, decode="bf16", block_size=8)
    assert graphs.short_prefill is not None
    graphs.capture_graphs(verified=False)
    eager = build_engine(model, decode="bf16", block_size=8, use_graphs=False)
    assert eager.short_prefill is None
    for keep, length in ((False, 5), (False, 16), (False, 17), (True, 100), (True, 300),
                         (False, 600), (True, 2049), (False, 4096), (False, 5000)):
        assert (graphs.short_prefill.bucket(length) is None) == (length > 4096)
        x = prompt(length, seed=length)
        _, a, _ = graphs.prefill_exact(x, keep_state=keep)
        _, b, _ = eager.prefill_exact(x, keep_state=keep)
        assert rel_err(a.logits[:, -1].float(), b.logits[:, -1].float()) < 2e-2, length
        for la, lb in zip(graphs.exact_cache.layers, eager.exact_cache.layers, strict=True):
            assert rel_err(la.recurrent_states[0].float(), lb.recurrent_states[0].float()) < 2e-2
        assert graphs.exact_cache.seen_tokens == eager.exact_cache.seen_tokens
        assert int(graphs.exact_cache.position) == int(eager.exact_cache.position)


def test_small_m_linear_picks_per_shape_and_graphs():
    """The custom op: a kernel chosen once per shape outside capture (GEMV, tensor-core or cuBLAS
    for BF16 weights; GEMV or the FP16 tensor-core kernel for FP8), each Triton form at a tile
    of its own, timed in captured graphs over weight copies (ops.timing) without error; inside
    a captured graph it replays what it chose; every kernel agrees with the plain twin."""
    from unimax.fp8 import quantize_rows
    from unimax.ops import gemv as ops

    gen = torch.Generator(device="cuda").manual_seed(1)
    bf16 = torch.randn(3000, 1024, device="cuda", dtype=torch.bfloat16, generator=gen)
    fp8 = quantize_rows(bf16)
    for weights in ((bf16,), fp8):
        for m in (1, 8, 16):
            x = torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16, generator=gen)
            ref = ops.gemv_ref(x, *weights).float()
            y = ops.small_m_linear(x, *weights)
            choice = ops.CHOICES[(m, 3000, 1024, weights[0].dtype)]
            form, tile = choice.partition("@")[::2]
            assert form in ops.candidates(m, len(weights) == 2)
            assert form == "cublas" or ops.parse_kernel(choice, ops.TILES, "t")[1] is not None
            assert rel_err(y.float(), ref) < 1e-2
            kernels = ("rows", "dot") if m <= ops.PROGRAM_ROWS else ("dot",)
            if m <= ops.PROGRAM_ROWS:
                kernels += ("rows16",) if len(weights) == 2 else ()
            for kernel in kernels:
                assert rel_err(ops.gemv(x, *weights, kernel=kernel).float(), ref) < 1e-2
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = ops.small_m_linear(x, *weights)
            x.copy_(torch.randn(m, 1024, device="cuda", dtype=torch.bfloat16, generator=gen))
            graph.replay()
            assert rel_err(out.float(), ops.gemv_ref(x, *weights).float()) < 1e-2
    assert ops.TIMING_ERRORS == []  # every choice timed in its captured graph, none call by call


def test_captures_survive_a_collection_among_dropped_graphs():
    """A cyclic garbage collection that starts mid-capture and finds dropped CUDA graphs in a
    cycle (an engine of an earlier request or test) destroys them there, which fails the
    capture; that failed a kernel choice's timing in the 2026-12-01 suite. Both captures of
    ours, the choice timer's (ops.timing.graph_us) and the engine's (GraphRunner), hold the
    collector off: the garbage becomes unreachable inside the capture, then enough container
    objects are made for an automatic collection to start (outside a capture they start one: the
    control): none starts while capturing (the deterministic check; whether one would reach the
    old graphs depends on their generation), and both captures succeed."""
    import gc

    from unimax.graph import GraphRunner
    from unimax.ops.timing import graph_us

    x = torch.zeros(64, device="cuda")
    keep = []

    def trigger_a_collection():
        junk = [[] for _ in range(20 * gc.get_threshold()[0])]  # 20 times gen 0's threshold
        del junk

    def drop_graphs_mid_capture(_=0):
        if torch.cuda.is_current_stream_capturing() and keep:
            keep.clear()  # the graphs below are garbage now, in a cycle: the collector's
            trigger_a_collection()
        x.add_(1)

    def garbage_graphs():
        for _ in range(4):
            graph, held = torch.cuda.CUDAGraph(), {}
            with torch.cuda.graph(graph):
                x.mul_(2)
            held["graph"], held["self"] = graph, held
            keep.append(held)

    def note_collection(phase, info):
        if phase == "start":
            collections.append(torch.cuda.is_current_stream_capturing())

    collections = []
    torch.cuda.synchronize()
    gc.callbacks.append(note_collection)
    try:
        trigger_a_collection()  # the control: outside a capture, the trigger starts one
        assert collections and True not in collections
        collections.clear()
        garbage_graphs()
        assert graph_us(drop_graphs_mid_capture, copies=1) > 0
        garbage_graphs()
        graph, _ = GraphRunner(x.device, use_graphs=True).capture(drop_graphs_mid_capture, [],
                                                                  [])
    finally:
        gc.callbacks.remove(note_collection)
    assert True not in collections  # (none inside either capture, where the trigger ran)
    before = x.clone()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(x, before + 1)
    gc.collect()  # (the dropped graphs, outside any capture)
