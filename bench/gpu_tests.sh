#!/usr/bin/env bash
# The GPU test suite in one device call (run it first in a session), with fla's wheels carried
# in .whl (see the device README; the device has no gradio/openai, so modules needing them are
# skipped at collection):   run: bash bench/gpu_tests.sh   with carry [".whl"]
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
T0=$SECONDS
# Arguments go to pytest (e.g. one file per call when the whole suite nears the 10-minute limit:
#   bash bench/gpu_tests.sh tests/test_gpu.py   /   bash bench/gpu_tests.sh tests/test_gpu_engine.py)
UNIMAX_ALLOW_FLA=1 timeout 540 python3 -m pytest -v -s -m gpu -p no:cacheprovider \
  --continue-on-collection-errors --durations=12 "$@" 2>&1 | tr -d '\000' > "$OUT/pytest.log"
grep -E "PASSED|FAILED|ERROR|passed|failed|s call|acceptance" "$OUT/pytest.log" | cut -c1-150 \
  | tail -40
echo "gpu tests done at $((SECONDS - T0)) s"
