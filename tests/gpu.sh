#!/usr/bin/env bash
# The GPU test suite in one command (10 minutes at most, cold compiles included):
#   bash tests/gpu.sh                       every tests/gpu/test_gpu*.py file, each in a pytest
#                                           process of its own, all at once
#   bash tests/gpu.sh tests/gpu/test_gpu.py -k x  arguments: one pytest process with them
#   GPU_TEST_FILES="tests/a.py tests/b.py"  those files side by side; GPU_TEST_LIMIT: each
#                                           process's seconds (560)
# fla's wheels (fla-core, flash-linear-attention) and, for tests/gpu/test_gpu_structured.py,
# xgrammar's cp312 wheels with its pydantic (pip download --no-deps --only-binary=:all:
# --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --platform
# manylinux_2_17_x86_64 -d .whl xgrammar==0.2.9 apache-tvm-ffi pydantic pydantic_core
# annotated-types typing-inspection) are installed from .whl; modules needing gradio or openai
# are skipped at collection where they are missing.
# Why the files run at once: their time is mostly Triton's and inductor's compiling, on the
# host's cores, and these are correctness tests, which share the GPU safely (speed is measured
# by bench/, never here). Each line of a file's log carries the second it was written at, so a
# file cut by its limit still says where its time went.
# The compile cache: loaded from .gpucache when carried (bench/compile_cache.sh), saved under
# $OUT after the tests with GPU_TEST_SAVE=1. An outer `timeout` must leave room past
# GPU_TEST_LIMIT (590 in a 600 s call), or a cold suite is killed before any log is written.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
# before any process compiles: an entry that no longer matches the code is simply not used
bash bench/compile_cache.sh load
# each process's log here, all of them in one file under $OUT at the end: the device returns
# at most 8 files, and there are more test files than that
LOGS=/tmp/gpu-test-logs; rm -rf "$LOGS"; mkdir -p "$LOGS"
T0=$SECONDS
suite() {  # $1: log name; the rest: pytest arguments
  # each line with the second it was written at (tr unbuffered: into a pipe it would hold
  # every line to the end)
  local log="$LOGS/pytest-$1.log"; shift
  UNIMAX_ALLOW_FLA=1 timeout ${GPU_TEST_LIMIT:-560} python3 -m pytest -v -s -m gpu \
    -p no:cacheprovider --continue-on-collection-errors --durations=8 "$@" 2>&1 |
    stdbuf -o0 tr -d '\000' |
    while IFS= read -r line || [ -n "$line" ]; do
      printf '%4d s %s\n' $((SECONDS - T0)) "$line"
    done > "$log"
}
if [ $# -eq 0 ]; then
  for file in ${GPU_TEST_FILES:-tests/gpu/test_gpu*.py}; do
    suite "$(basename "$file" .py)" "$file" &
  done
  wait
else
  suite run "$@"
fi
for log in "$LOGS"/pytest-*.log; do
  echo "== $(basename "$log")" | tee -a "$OUT/pytest-all.log"
  cat "$log" >> "$OUT/pytest-all.log"
  grep -E "PASSED|FAILED|ERROR|passed|failed|skipped|s call|acceptance" "$log" | cut -c1-150 | tail -30
done
echo "gpu tests done at $((SECONDS - T0)) s"
if [ -n "${GPU_TEST_SAVE:-}" ]; then
  OUT=$OUT bash bench/compile_cache.sh save
  echo "compile cache saved at $((SECONDS - T0)) s"
fi
