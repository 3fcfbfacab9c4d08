#!/usr/bin/env bash
# One device call (about 9 minutes on an H200) for what the GPU still has to check, alone on the
# card, printing progressively: the GPU tests (~5 min), then the engine with the fast step
# (compiled step + GEMV) on the 0.8B shapes, verified mode included, and on the hybrid shape the
# verifier with and without its KV buckets. Needs fla's wheels in .whl
# (see the device README):   run: bash bench/gpu_checks.sh   with carry [".whl"]
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
T0=$SECONDS
UNIMAX_ALLOW_FLA=1 timeout 380 python3 -m pytest -v -m gpu -p no:cacheprovider --durations=5 \
  2>&1 | tr -d '\000' > "$OUT/pytest.log"
grep -E "PASSED|FAILED|ERROR|passed|failed|[0-9]s call" "$OUT/pytest.log" | cut -c1-120 | tail -25
echo "gpu tests done at $((SECONDS - T0)) s"
timeout $((585 - SECONDS + T0)) python3 bench/decode.py --shapes qwen3.5-0.8b gdn24-0.8b \
  --parts kvwindow compile --json "$OUT/compile.json" 2>&1 | tr -d '\000' > "$OUT/compile.log"
grep -v '^{' "$OUT/compile.log" | grep -v -i warn | tail -14
echo "all done at $((SECONDS - T0)) s"
