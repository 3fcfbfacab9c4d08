"""Is verified mode exact with each PDL setting? A probe, on the GPU tests' tiny model.

Thirtieth session: tests/test_gpu_tma.py::test_pdl_auto_is_timed_per_decoder_on_gpu saw the
verified reply of an FP8 engine (full draft, PDL "auto") leave exact greedy at token 3. This
runs generate_verified on fresh engines under each PDL setting, with and without a fast reply
first on the same engine, and prints where each leaves the exact model's greedy tokens and by
how much (a near tie or a real error).   run: python3 bench/pdl_exactness.py  (a GPU)
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import unimax.ops.fused_gemv as fused_gemv  # noqa: E402
from helpers import gpu_model  # noqa: E402
from helpers import gpu_prompt as prompt  # noqa: E402
from unimax import build_engine, exact_greedy_tokens  # noqa: E402
from unimax.reference import first_divergence  # noqa: E402


def main() -> None:
    model = gpu_model()
    rows = []
    x = prompt(60, seed=4)  # (the GPU test's prompt)
    want = exact_greedy_tokens(model, x, 24)
    for decode, draft, candidate in (("fp8", "full", "fp8"), ("bf16", "tail", True)):
        for pdl in (False, candidate, "auto"):
            for fast_first in (False, True):
                fused_gemv.PDL = pdl
                engine = build_engine(model, decode=decode, draft=draft, block_size=8,
                                      compile_step=True)
                if fast_first:
                    engine.generate_fast(x, 24)
                got, report = engine.generate_verified(x, 24)
                div = first_divergence(model, x, got[0].tolist(), want[0].tolist())
                rows.append((decode, draft, str(pdl), fast_first, str(engine.decode_graph.pdl),
                             str(engine.verifier.pdl), round(report.acceptance_rate, 3),
                             "exact" if div is None else div))
                print(*rows[-1], flush=True)
    fused_gemv.PDL = "auto"
    print("\ndecode draft PDL fast_first kept verifier_kept acceptance result")
    for row in rows:
        print(*row)


if __name__ == "__main__":
    main()
