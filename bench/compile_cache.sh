#!/usr/bin/env bash
# Carry Triton's and inductor's compile caches from one device call to the next.
#
# Why: every device call starts on a bare machine, and most of a cold call is compiling: a
# gdn-4b block-16 run spent ~380 s of its 470 before its first
# verified row (fla's autotuned prompt kernels, our kernels' timed candidates, inductor's
# graphs), while the same kind of run on a machine still warm from the call before took 195 s
# in all. Both caches are keyed by content (kernel source, options, versions, the GPU), so an
# entry that no longer matches the code is simply not used.
#
#   bash bench/compile_cache.sh save   # at the end of a call: $OUT/compile-cache.tar.xz.NN
#                                      (.gz where the machine has no xz)
#   bash bench/compile_cache.sh load   # at the start of a call, .gpucache carried
#   bash bench/compile_cache.sh clear  # empty this machine's caches (before a load)
#
# A cache per kind of call (GPUCACHE names the folder, as .gitignore's .gpucache*/): the GPU
# suite's kernels are the tests' tiny shapes, of no use to a 4B bench, whose own (fla's and
# our kernels at the 4B shapes, inductor's 4B graphs) a cold call spends minutes on (the
# reference 139 s, each engine's warm-up 134-141 s, on an H100 with the
# suite's cache loaded). Both together pass the carry's 64 MiB. So a 4B bench call clears, loads
# its own and saves after the bench, even one cut by its timeout, into .gpucache-4b:
#   bash bench/compile_cache.sh clear; GPUCACHE=.gpucache-4b bash bench/compile_cache.sh load
#   timeout 440 python3 bench/verified.py ...; bash bench/compile_cache.sh save
# with carry [".whl", ".gpucache-4b"].
#
# Between the two, on this machine: mkdir -p .gpucache && cp /work/.device/N/compile-cache.*
# .gpucache/ (ignored in .gitignore: name it in carry, [".whl", ".gpucache"]).
# Kept of each Triton kernel: its binary, its metadata and its group file, not the IR text
# (ttir, ttgir, llir, ptx): Triton's cache lookup takes the group's files that exist and
# launches the binary. Nor inductor's CPU precompiled header (150 MB, rebuilt in seconds;
# on the CPU a save and load gave inductor an fxgraph cache hit). The parts are 15 MiB (the
# device returns files up to 16 MiB, eight in all) and what travels is at most 64 MiB, ~25 of
# it the repo: save says the size.
set -euo pipefail
DIR=${GPUCACHE:-.gpucache}
if command -v xz >/dev/null; then ZIP=(xz -T0 -6) EXT=xz; else ZIP=(gzip -6) EXT=gz; fi
dirs() {  # the caches' absolute paths, where they exist
  python3 - <<'EOF'
import os
from torch._inductor.runtime.cache_dir_utils import cache_dir
try:
    import triton
    triton_dir = triton.knobs.cache.dir
except Exception:  # (an older Triton)
    triton_dir = os.path.join(os.path.expanduser("~"), ".triton", "cache")
for path in (cache_dir(), triton_dir):
    if os.path.isdir(path):
        print(path)
EOF
}
case "${1:-}" in
  save)
    OUT=${OUT:?save writes under \$OUT}
    CAP=${GPUCACHE_CAP:-37748736}  # bytes (36 MiB): what travels beside the repo and .whl
    mapfile -t paths < <(dirs)
    [ ${#paths[@]} -gt 0 ] || { echo "compile_cache: no cache to save"; exit 0; }
    pack() {  # the given cache folders into $OUT's parts; prints their bytes
      rm -f "$OUT"/compile-cache.tar.*
      tar cf - --exclude='*.ttir' --exclude='*.ttgir' --exclude='*.llir' --exclude='*.ptx' \
        --exclude='*.source' --exclude='*.lock' --exclude='lock' \
        --exclude='precompiled_headers' -P "$@" |
        "${ZIP[@]}" | split -b 15M -d -a 2 - "$OUT/compile-cache.tar.$EXT."
      du -cb "$OUT"/compile-cache.tar.* | tail -1 | cut -f1
    }
    bytes=$(pack "${paths[@]}")
    if [ "$bytes" -gt "$CAP" ] && [ ${#paths[@]} -gt 1 ]; then
      # over the cap: Triton's own cache alone (fla's autotuned kernels and ours, the longest
      # compiles), without inductor's graphs
      echo "compile_cache: all caches $bytes bytes, over $CAP: Triton's alone"
      paths=("${paths[@]:1}")
      bytes=$(pack "${paths[@]}")
    fi
    if [ "$bytes" -gt "$CAP" ]; then
      rm -f "$OUT"/compile-cache.tar.*
      echo "compile_cache: $bytes bytes, over $CAP: nothing saved"; exit 0
    fi
    echo "compile_cache: saved ${paths[*]} as $(ls "$OUT"/compile-cache.tar.* | wc -l)" \
      "part(s), $bytes bytes"
    ;;
  load)
    for ext in xz gz; do
      if ls "$DIR"/compile-cache.tar.$ext.* >/dev/null 2>&1; then
        unzip=(xz -d); [ $ext = gz ] && unzip=(gzip -d)
        cat "$DIR"/compile-cache.tar.$ext.* | "${unzip[@]}" | tar xf - -P
        echo "compile_cache: loaded $(du -cb "$DIR"/compile-cache.tar.$ext.* | tail -1 |
          cut -f1) bytes into $(dirs | tr '\n' ' ')"
        exit 0
      fi
    done
    echo "compile_cache: nothing in $DIR to load (a cold start)"
    ;;
  clear)
    mapfile -t paths < <(dirs)
    [ ${#paths[@]} -eq 0 ] || rm -rf "${paths[@]}"
    echo "compile_cache: cleared ${paths[*]:-nothing}"
    ;;
  *)
    echo "usage: bash bench/compile_cache.sh save|load|clear" >&2; exit 2 ;;
esac
