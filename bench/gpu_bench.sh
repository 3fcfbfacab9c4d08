#!/usr/bin/env bash
# The measured steps of a GPU session, in calls that fit the device's 10-minute limit (run
# bench/gpu_tests.sh first). With fla's wheels carried in .whl (see bench/gpu_tests.sh):
#   run: bash bench/gpu_bench.sh kernels    gemv per shape (rows16), attention (rows), TTFT
#   run: bash bench/gpu_bench.sh tiles      gdn-4b: the FP8 GEMV's tiles (num_stages too) on
#                                           the K-long linears, beside the autotuned choice;
#                                           "tiles in_proj gate_up": the wide ones
#   run: bash bench/gpu_bench.sh ncu        gdn-4b: the draft's fused FP8 GEMVs (and BF16, FP8
#                                           without the prologue, at the whole-K tiles, the
#                                           in-projection with the conv folded in) under Nsight
#                                           Compute: DRAM rate, occupancy, stall reasons
#                                           (bench/ncu_gemv.py)
#   run: bash bench/gpu_bench.sh l2         gdn-4b: 8 layers' FP8 GEMVs in a graph, with the next
#                                           linear's weights prefetched into L2 and not
#                                           (bench/l2_prefetch.py)
#   run: bash bench/gpu_bench.sh fusedk     gdn-4b then qwen3.5-0.8b: the draft's fused FP8
#                                           GEMVs per linear through rows, rows16 and split-K
#                                           (split, split16), and the timed choice
#   run: bash bench/gpu_bench.sh verified   gdn-4b: fixed and adaptive k, forced acceptance,
#                                           per-part times, the kernels of each graph;
#                                           "verified 15": blocks of 15 drafts (16 rows: the
#                                           verify GEMVs pad to 16 rows anyway);
#                                           "verified 8 qwen3.5-0.8b": another shape;
#                                           "verified 8 gdn-4b --no-fuse-bf16": BF16-only
#                                           and the verifier without the folded GEMVs;
#                                           "verified 8 gdn-4b --no-block-op": the
#                                           verifier's recording mixers' tape as torch
#                                           forms (not ops.block_mixer's one kernel);
#                                           "verified 8 gdn-4b --ab-block-op": both, the
#                                           verify block timed each way in one process;
#                                           "verified 8 gdn-4b --fixed-only": fixed k rows
#                                           only (to fit one call with --kernels);
#                                           "verified 8 gdn-4b --pdl": every fused GEMV with
#                                           programmatic dependent launch ("--pdl fp8": the
#                                           FP8 weights' only, the draft's; "--pdl off": none;
#                                           by default "auto", each decoder's timed choice);
#                                           "verified 8 gdn-4b --fixed-only --pdl off
#                                           --ab-pdl-fp8": and a second verified engine with
#                                           "--pdl fp8", its forced rows and draft step beside
#                                           the first's;
#                                           "verified 8 gdn-8b": the ~8B shape
#   run: bash bench/gpu_bench.sh sampled    gdn-4b: BF16-only and verified sampling at T 0.7, 1.0
#   run: bash bench/gpu_bench.sh steps      gdn-4b: the BF16 step and the full-FP8 draft step with
#                                           the GDN step as one op and as torch forms ("-unfused")
#   run: bash bench/gpu_bench.sh fused      gdn-4b and qwen3.5-0.8b: the BF16 step and the
#                                           draft step, fused (the default: unimax.fused_draft)
#                                           and unfused ("-nofuse");
#                                           "fused gdn-4b": one shape
#   run: bash bench/gpu_bench.sh conv       gdn-4b: the BF16 step and the draft step with the
#                                           convolution folded into the in-projection (the
#                                           default: unimax.ops.in_proj_conv) and not
#                                           ("-noconv")
#   run: bash bench/gpu_bench.sh tma        gdn-4b: the TMA forms' GPU test, then the draft step
#                                           and the BF16 step with the TMA forms offered to
#                                           the fused GEMVs' timed choice (the default) and
#                                           not ("-notma"); "tma 300": that time limit
#   run: bash bench/gpu_bench.sh tmak       gdn-4b: each draft linear's FP8 fused GEMV at the
#                                           chosen plain kernel and at every TMA form and tile,
#                                           and on out_proj/down split-K at 2 and 8 slices and
#                                           TMA at 3 and 5 stages (bench/tma_gemv.py); "tmak
#                                           200": that time limit
#   run: bash bench/gpu_bench.sh rmsloop    gdn-4b: the draft and BF16 steps with the RMS
#                                           prologues' squares summed in the K loop and
#                                           without (ops.fused_gemv.RMS_IN_LOOP)
#   run: bash bench/gpu_bench.sh parts      gdn-4b: each draft GEMV with and without its prologue
#                                           and residual, against a read of its bytes
#                                           (bench/gemv_parts.py); then the BF16 step's
#   run: bash bench/gpu_bench.sh reads      the floor under a short GEMV: kernels that only
#                                           read 3-96 MB (one tile a program, a K-loop chain
#                                           plain and TMA, persistent grids, torch's sum), the
#                                           fit t0 + bytes / bw each (bench/small_reads.py)
#   run: bash bench/gpu_bench.sh combo      gdn-4b: the verify block, the BF16 step and the
#                                           draft step with and without inductor's combo
#                                           kernels (the verify block's small kernels)
#   run: bash bench/gpu_bench.sh pdl        gdn-4b and qwen3.5-0.8b: the BF16 step and the draft
#                                           step with the fused GEMVs launched with
#                                           programmatic dependent launch ("-pdl"; "-pdlend":
#                                           the signal at the end of the K loop) and not
#   run: bash bench/gpu_bench.sh recurrent  fla's recurrent kernel at 1 and 9 tokens: launch
#                                           settings (BV, warps, stages) at 4B and 0.8B heads
#   run: bash bench/gpu_bench.sh short      the few-token recurrence op's candidates (fla's kernel,
#                                           ours at each launch setting) at the verifier's
#                                           block and rewind shapes, 4B heads ("short 16x16":
#                                           0.8B heads)
#   run: bash bench/gpu_bench.sh ttft       qwen3.5-0.8b: TTFT beside transformers, and with the
#                                           torch forms of the norms, 8k chunks, graphs to 512
#                                           only (the old settings) side by side;
#                                           "ttft qwen3.5-4b": the 4B hybrid shape
#   run: bash bench/gpu_bench.sh ttft-all   TTFT beside transformers at 128 .. 64k tokens, the
#                                           defaults only ("ttft-all qwen3.5-4b": that shape)
#   run: bash bench/gpu_bench.sh service    TTFT through the app's engine service, every mode,
#                                           and each mode's warm-up time (the app's start-up)
#                                           and its parts (compile, choices, captures),
#                                           then a second start (disk caches warm):
#                                           the demo model; "service qwen3.5-0.8b": random
#                                           weights of that shape
#   run: bash bench/gpu_bench.sh profile    gdn-4b: kernels of the app's BF16 step, draft step and
#                                           verify block (where the fixed part goes), and
#                                           the idle time between their kernels by the
#                                           kernel after it; variants as arguments instead
#   run: bash bench/gpu_bench.sh prefill    qwen3.5-0.8b: the kernels of a 4k and a 16k
#                                           prefill_exact, torch and fla norms (issue 15: where
#                                           the 16k's time goes)
#   run: bash bench/gpu_bench.sh demo       the trained demo model (in the repo): acceptance and
#                                           tok/s of every mode with the GPU's FP8 kernels,
#                                           greedy and sampled at T 0.7 and 1.0 (its TTFT
#                                           through the app's service: "service")
# JSON results land in $OUT; each script prints its table last.
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
quiet() { grep -v -E "Warning|originates|warn_once|^ *File |backend = |chunk, fused|^$"; }
case "${1:-}" in
  kernels)
    timeout 240 python3 bench/gemv.py --rows 1 9 --json "$OUT/gemv.json" 2>&1 | quiet | tail -28
    timeout 100 python3 bench/attention.py --max-context 4096 32768 --json "$OUT/attn.json" \
      2>&1 | quiet | tail -14
    timeout 240 python3 bench/ttft.py --shapes qwen3.5-0.8b --variants torch-norms --json "$OUT/ttft.json" 2>&1 \
      | quiet | tail -9 ;;
  tiles)
    timeout 560 python3 bench/gemv.py --tiles "${@:2}" --json "$OUT/tiles.json" \
      > "$OUT/tiles.log" 2>&1
    grep -v -E '^[[{]' "$OUT/tiles.log" | quiet | tail -12 ;;
  verified)
    timeout 560 python3 bench/verified.py --shapes "${3:-gdn-4b}" --acceptance 1.0 0.95 \
      --kernels --block "${2:-8}" "${@:4}" --json "$OUT/verified.json" > "$OUT/verified.log" 2>&1
    grep -v Assertion "$OUT/verified.log" | grep -v '^{' | quiet | cut -c1-200 | tail -90 ;;
  sampled)
    timeout 560 python3 bench/verified.py --shapes gdn-4b --acceptance --temperature 0.7 1.0 \
      --json "$OUT/sampled.json" > "$OUT/sampled.log" 2>&1
    grep -v Assertion "$OUT/sampled.log" | quiet | cut -c1-300 | tail -20 ;;
  steps)
    timeout 500 python3 bench/profile_step.py --shapes gdn-4b --variants fla+gemv \
      fla+gemv-unfused draft draft-unfused --json "$OUT/steps.json" > "$OUT/steps.log" 2>&1
    grep -v Assertion "$OUT/steps.log" | grep -v '^{' | quiet | cut -c1-130 | tail -84 ;;
  fused)
    timeout 560 python3 bench/profile_step.py --shapes ${2:-gdn-4b qwen3.5-0.8b} --variants \
      fla+gemv fla+gemv-nofuse draft draft-nofuse --json "$OUT/fused.json" > "$OUT/fused.log" 2>&1
    grep -v Assertion "$OUT/fused.log" | grep -v '^{' | quiet | cut -c1-130 | tail -120 ;;
  fusedk)
    for shape in gdn-4b qwen3.5-0.8b; do
      timeout 250 python3 bench/gemv.py --fused --shape $shape --json "$OUT/fusedk-$shape.json" \
        > "$OUT/fusedk-$shape.log" 2>&1
      grep -v '^{' "$OUT/fusedk-$shape.log" | quiet | tail -6
    done ;;
  ncu)
    ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu | head -1)
    timeout 500 "$ncu" --clock-control none --cache-control all -k regex:gemv --csv --page raw \
      --print-units base --metrics "$(python3 bench/ncu_gemv.py --metrics)" \
      python3 bench/ncu_gemv.py > "$OUT/ncu.csv" 2> "$OUT/ncu.err"
    tail -5 "$OUT/ncu.err"; grep "==ERROR==" "$OUT/ncu.csv" | head -5
    python3 bench/ncu_gemv.py --table "$OUT/ncu.csv" ;;
  l2)
    timeout 300 python3 bench/l2_prefetch.py --json "$OUT/l2.json" > "$OUT/l2.log" 2>&1
    grep -v '^{' "$OUT/l2.log" | quiet | tail -14 ;;
  pdl)
    timeout 560 python3 bench/profile_step.py --shapes ${2:-gdn-4b qwen3.5-0.8b} --variants \
      fla+gemv fla+gemv-pdl fla+gemv-pdlend draft draft-pdl draft-pdlend --json "$OUT/pdl.json" \
      > "$OUT/pdl.log" 2>&1
    grep -v Assertion "$OUT/pdl.log" | grep -v '^{' | quiet | cut -c1-130 | tail -100 ;;
  conv)
    timeout 560 python3 bench/profile_step.py --shapes gdn-4b --variants fla+gemv \
      fla+gemv-noconv draft draft-noconv --json "$OUT/conv.json" > "$OUT/conv.log" 2>&1
    grep -v Assertion "$OUT/conv.log" | grep -v '^{' | quiet | cut -c1-130 | tail -80 ;;
  tma)
    # the TMA forms' GPU test first (a failure skips the timing), then the steps with and
    # without them offered to the timed choice
    UNIMAX_ALLOW_FLA=1 timeout 170 python3 -m pytest -q -s -m gpu -p no:cacheprovider \
      tests/test_gpu_tma.py > "$OUT/tma-test.log" 2>&1
    tail -15 "$OUT/tma-test.log" | cut -c1-160
    grep -q " passed" "$OUT/tma-test.log" && ! grep -q "failed" "$OUT/tma-test.log" || exit 1
    timeout ${2:-380} python3 bench/profile_step.py --shapes gdn-4b --variants draft draft-notma \
      fla+gemv fla+gemv-notma --json "$OUT/tma.json" > "$OUT/tma.log" 2>&1
    grep -v Assertion "$OUT/tma.log" | grep -v '^{' | quiet | cut -c1-200 | tail -80 ;;
  rmsloop)
    # the RMS prologues without their pre-pass (ops.fused_gemv.RMS_IN_LOOP): the draft and
    # BF16 steps with and without, every fused choice timed again with
    timeout ${2:-420} python3 bench/profile_step.py --shapes gdn-4b --variants draft \
      draft-rmsloop fla+gemv fla+gemv-rmsloop --json "$OUT/rmsloop.json" > "$OUT/rmsloop.log" 2>&1
    grep -v Assertion "$OUT/rmsloop.log" | grep -v '^{' | quiet | cut -c1-200 | tail -60 ;;
  parts)
    # where a draft GEMV's time goes past a plain read of its weight (bench/gemv_parts.py)
    for kind in "" --bf16; do
      timeout 200 python3 bench/gemv_parts.py $kind --json "$OUT/parts$kind.json" \
        > "$OUT/parts$kind.log" 2>&1
      grep -v '^{' "$OUT/parts$kind.log" | quiet | tail -21
    done ;;
  reads)
    # the floor under a short GEMV: kernels that only read W's bytes (bench/small_reads.py)
    timeout ${2:-200} python3 bench/small_reads.py --json "$OUT/reads.json" > "$OUT/reads.log" 2>&1
    grep -v '^{' "$OUT/reads.log" | quiet | tail -20 ;;
  tmak)
    timeout ${2:-240} python3 bench/tma_gemv.py --json "$OUT/tmak.json" > "$OUT/tmak.log" 2>&1
    quiet < "$OUT/tmak.log" | grep "^{" | cut -c1-170 ;;
  combo)
    timeout 560 python3 bench/profile_step.py --shapes gdn-4b --variants engine-verify \
      engine-verify-combo fla+gemv fla+gemv-combo draft draft-combo --json "$OUT/combo.json" \
      > "$OUT/combo.log" 2>&1
    grep -v Assertion "$OUT/combo.log" | grep -v '^{' | quiet | cut -c1-130 | tail -120 ;;
  recurrent)
    timeout 300 python3 bench/recurrent.py --json "$OUT/recurrent.json" > "$OUT/recurrent.log" 2>&1
    grep -v '^{' "$OUT/recurrent.log" | quiet | tail -30 ;;
  short)
    timeout 240 python3 bench/recurrent.py --short --heads ${2:-16x32} --json "$OUT/short.json" \
      > "$OUT/short.log" 2>&1
    grep -v '^{' "$OUT/short.log" | quiet | cut -c1-400 | tail -8 ;;
  ttft)
    timeout 500 python3 bench/ttft.py --shapes "${2:-qwen3.5-0.8b}" --lengths 16384 4096 1000 512 \
      --repeats 3 --variants torch-norms chunk8k graphs512 \
      --json "$OUT/ttft.json" > "$OUT/ttft.log" 2>&1
    grep -v Assertion "$OUT/ttft.log" | grep -v '^{' | quiet | cut -c1-400 | tail -12 ;;
  ttft-all)
    timeout 560 python3 bench/ttft.py --shapes "${2:-qwen3.5-0.8b}" --repeats 3 \
      --json "$OUT/ttft-all.json" > "$OUT/ttft-all.log" 2>&1
    grep -v Assertion "$OUT/ttft-all.log" | grep -v '^{' | quiet | cut -c1-400 | tail -40 ;;
  profile)
    set -- "$@" $([ $# -gt 1 ] || echo engine-bf16 engine-draft engine-verify)
    timeout 560 python3 bench/profile_step.py --shapes gdn-4b \
      --variants ${@:2} --json "$OUT/profile.json" \
      > "$OUT/profile.log" 2>&1
    grep -v Assertion "$OUT/profile.log" | quiet | cut -c1-160 | tail -70 ;;
  prefill)
    timeout 400 python3 bench/profile_prefill.py --torch-norms --json "$OUT/prefill.json" \
      > "$OUT/prefill.log" 2>&1
    grep -v Assertion "$OUT/prefill.log" | grep -v "^{" | quiet | cut -c1-140 | tail -100 ;;
  demo)
    python3 -m train.corpus /tmp/corpus.jsonl > "$OUT/corpus.json" || exit 1
    timeout 420 python3 bench/acceptance.py models/unimax-demo /tmp/corpus.jsonl --prompts 20 \
      --new 64 --samples 0 --check 10 --temperatures 0.7 1.0 --device cuda \
      --json "$OUT/demo.json" \
      > "$OUT/demo.log" 2>&1
    grep -v Assertion "$OUT/demo.log" | quiet | cut -c1-200 | tail -20 ;;
  service)
    # one model per call: the first run (2026-12-01) warmed the demo model up for over 200 s
    # without a figure; each mode's warm-up time prints as it ends
    # (2026-12-01: demo 208 s in all, bf16's warm-up 138 s). Then, in the time left, the same
    # again in a new process: a second start of the app, with Triton's and inductor's on-disk
    # caches filled by the first (what a user's later starts cost)
    name=${2:-demo}
    timeout 560 python3 bench/service_ttft.py ${2:+--shape "$2"} --json "$OUT/service_$name.json" \
      > "$OUT/service_$name.log" 2>&1
    grep -v Assertion "$OUT/service_$name.log" | quiet | cut -c1-200 | tail -14
    left=$((570 - SECONDS))
    if [ "$left" -gt 60 ]; then
      echo "== second start ($left s left)"
      timeout "$left" python3 bench/service_ttft.py ${2:+--shape "$2"} --repeats 1 \
        --json "$OUT/service_${name}_again.json" > "$OUT/service_${name}_again.log" 2>&1
      grep -v Assertion "$OUT/service_${name}_again.log" | quiet | cut -c1-200 | tail -14
    fi ;;
  *) echo "usage: bash bench/gpu_bench.sh kernels|tiles|ncu|l2|conv|verified|steps|fused|fusedk|combo|pdl|recurrent|ttft|ttft-all|sampled|service|profile|prefill|demo"; exit 2 ;;
esac
