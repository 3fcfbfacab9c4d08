"""The GEMVs of bench/int4_gemv.py's large linear, each launched twice at the tile that bench
chose, for Nsight Compute to count (RESULTS.md, fortieth session: instructions a weight, DRAM
and SM busy). No timing of its own: ncu's replays do that.

usage (GPU): python bench/int4_gemv.py --shapes --linears 65536x8192 --groups 128 --wide \\
                 --json /tmp/int4.json
             ncu --clock-control none --kernel-name regex:"int4|gemv|tinygemm" \\
                 --section SpeedOfLight --section InstructionStats \\
                 python bench/int4_ncu.py /tmp/int4.json [GROUP, 128 unless given]
"""

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from int4_gemv import (  # noqa: E402  (it puts the repository on the path too)
    F16_SCALE,
    int4_gemv,
    pack_nibbles,
    quantize_int4,
    quantize_rows,
    tinygemm,
    tinygemm_pack,
)

from unimax.ops import gemv as gemv_mod  # noqa: E402


def main() -> None:
    rows = json.loads(Path(sys.argv[1]).read_text())
    row = next(r for r in rows if r["shape"] == "linears")
    group = int(sys.argv[2]) if len(sys.argv) > 2 else 128
    key = f"int4/{group} "
    torch.manual_seed(0)
    w = torch.randn(row["N"], row["K"], device="cuda", dtype=torch.bfloat16) * 0.02
    x = torch.randn(1, row["K"], device="cuda", dtype=torch.bfloat16)
    q, scale = quantize_int4(w, group)
    packed = pack_nibbles(q)
    tg = tinygemm_pack(q, scale, row.get(key + "tinygemm_inner_k_tiles", 8),
                       row.get(key + "tinygemm_even_high", True))
    wq, ws = quantize_rows(w)
    for _ in range(2):
        for form in ("triton", "magic", "half2", "half2x"):
            tile = row.get(f"{key}{form}_tile")
            if tile:
                int4_gemv(x, packed, scale.half() if form in F16_SCALE else scale, tuple(tile),
                          form)
        tinygemm(x, *tg, group)
        gemv_mod.gemv(x, wq, ws)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
