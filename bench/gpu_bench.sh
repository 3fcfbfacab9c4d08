#!/usr/bin/env bash
# The benches behind the README's results, in calls that fit the device's 10-minute limit (run
# tests/gpu.sh first). With fla's wheels carried in .whl (see tests/gpu.sh):
#   run: bash bench/gpu_bench.sh decode [SHAPES]   BF16-only and FP8 speed tok/s against the
#                                           bandwidth floor, and the reference libraries'
#                                           generate (bench/decode.py; default gdn-4b
#                                           qwen3.5-4b qwen3.5-0.8b)
#   run: bash bench/gpu_bench.sh verified [K] [SHAPE] [ARGS]   verified beside BF16-only at
#                                           forced acceptance 1.0 and 0.95, fixed and adaptive
#                                           k, per-part times (bench/verified.py; default 8,
#                                           qwen3.5-4b; e.g. "verified 8 qwen3.5-4b --draft int4")
#   run: bash bench/gpu_bench.sh sampled    verified sampling at T 0.7 and 1.0 (qwen3.5-4b)
#   run: bash bench/gpu_bench.sh ttft [SHAPE]   TTFT beside transformers at 128 .. 64k tokens
#                                           (bench/ttft.py; default qwen3.5-0.8b)
#   run: bash bench/gpu_bench.sh structured [SHAPE]   replies held to a JSON schema through the
#                                           app's service (bench/structured.py; the demo model,
#                                           or random weights of SHAPE)
#   run: bash bench/gpu_bench.sh demo       the trained demo model: acceptance and tok/s of
#                                           every mode, greedy and sampled (bench/acceptance.py)
#   run: bash bench/gpu_bench.sh profile [VARIANTS]   the kernels of the BF16 step, the draft
#                                           step and the verify block, where their time goes
#                                           (bench/profile_step.py, gdn-4b)
#   run: bash bench/gpu_bench.sh startup [SHAPE] [ARGS]   the app's start-up, cold then
#                                           restarted, 8 CPU threads (bench/startup.py;
#                                           default qwen3.5-4b with the 4B L4 preset)
# JSON results land in $OUT; each script prints its table last.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
quiet() { grep -v -E "Warning|originates|warn_once|^ *File |backend = |chunk, fused|^$"; }
case "${1:-}" in
  decode)
    timeout 560 python3 bench/decode.py --shapes ${2:-gdn-4b qwen3.5-4b qwen3.5-0.8b} \
      --parts modes compile baselines bridge --json "$OUT/decode.json" > "$OUT/decode.log" 2>&1
    grep -v '^{' "$OUT/decode.log" | quiet | cut -c1-200 | tail -40 ;;
  verified)
    timeout 560 python3 bench/verified.py --shapes "${3:-qwen3.5-4b}" --acceptance 1.0 0.95 \
      --block "${2:-8}" "${@:4}" --json "$OUT/verified.json" > "$OUT/verified.log" 2>&1
    grep -v Assertion "$OUT/verified.log" | grep -v '^{' | quiet | cut -c1-200 | tail -60 ;;
  sampled)
    timeout 560 python3 bench/verified.py --shapes qwen3.5-4b --acceptance \
      --temperature 0.7 1.0 --json "$OUT/sampled.json" > "$OUT/sampled.log" 2>&1
    grep -v Assertion "$OUT/sampled.log" | quiet | cut -c1-300 | tail -20 ;;
  ttft)
    timeout 560 python3 bench/ttft.py --shapes "${2:-qwen3.5-0.8b}" --repeats 3 \
      --json "$OUT/ttft.json" > "$OUT/ttft.log" 2>&1
    grep -v Assertion "$OUT/ttft.log" | grep -v '^{' | quiet | cut -c1-400 | tail -40 ;;
  structured)
    timeout 560 python3 bench/structured.py ${2:+--shape "$2"} --json "$OUT/structured.json" \
      > "$OUT/structured.log" 2>&1
    grep -v Assertion "$OUT/structured.log" | grep -v '^{' | quiet | cut -c1-200 | tail -20 ;;
  demo)
    python3 -m train.corpus /tmp/corpus.jsonl > "$OUT/corpus.json" || exit 1
    timeout 420 python3 bench/acceptance.py models/unimax-demo /tmp/corpus.jsonl --prompts 20 \
      --new 64 --samples 0 --check 10 --temperatures 0.7 1.0 --device cuda \
      --json "$OUT/demo.json" > "$OUT/demo.log" 2>&1
    grep -v Assertion "$OUT/demo.log" | quiet | cut -c1-200 | tail -20 ;;
  profile)
    set -- "$@" $([ $# -gt 1 ] || echo engine-bf16 engine-draft engine-verify)
    timeout 560 python3 bench/profile_step.py --shapes gdn-4b --variants ${@:2} \
      --json "$OUT/profile.json" > "$OUT/profile.log" 2>&1
    grep -v Assertion "$OUT/profile.log" | quiet | cut -c1-160 | tail -70 ;;
  startup)
    timeout 580 python3 bench/startup.py --shape "${2:-qwen3.5-4b}" "${@:3}" \
      --json "$OUT/startup.json" > "$OUT/startup.log" 2>&1
    grep -v Assertion "$OUT/startup.log" | grep -v '^{' | quiet | cut -c1-200 | tail -20 ;;
  *) echo "usage: bash bench/gpu_bench.sh decode|verified|sampled|ttft|structured|demo|profile|startup"
     exit 2 ;;
esac
