#!/usr/bin/env bash
# One device call (about 8 minutes on an H200) for what the GPU still has to check, alone on the
# card, printing progressively: the GPU tests, the compiled step on the 0.8B shapes, the
# attention-kernel choice. Needs fla's wheels in .whl (see the device README):
#   run: bash bench/gpu_checks.sh   with carry [".whl"]
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
T0=$SECONDS
UNIMAX_ALLOW_FLA=1 timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider 2>&1 \
  | tee "$OUT/pytest.log" | tail -15
echo "gpu tests done at $((SECONDS - T0)) s"
timeout 60 python3 bench/attention.py --json "$OUT/attention.json" 2>&1 | tail -14
echo "attention done at $((SECONDS - T0)) s"
timeout $((560 - SECONDS + T0)) python3 bench/decode.py --shapes gdn24-0.8b qwen3.5-0.8b \
  --parts compile --json "$OUT/compile.json" 2>&1 | tee "$OUT/compile.log" | grep -v '^{' | tail -12
echo "all done at $((SECONDS - T0)) s"
