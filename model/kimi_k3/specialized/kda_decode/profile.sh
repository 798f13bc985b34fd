#!/usr/bin/env bash
# Nsight Compute diagnostics of the fused KDA decode kernel on the GPU machine (after kernels/device_install.sh):
#   bash model/kimi_k3/specialized/kda_decode/profile.sh [BATCH:V_SPLIT ...]     (default: 1:4 1:1)
# For each point, 12 heads, kernel launches only (no graph):
#   - the duration with every cache flushed (ncu --cache-control all) and with the caches as a first launch on the
#     same inputs left them (none): what cold code, data and TLB cost the kernel;
#   - a stall profile per SASS instruction (warp-state sampling) as CSV, to see which dependency each warp
#     waits on: $OUT/ncu_b<B>_s<S>.{txt,sass.csv,ncu-rep,log}. STALLS=0 skips it (durations only).
set -u
STALLS=${STALLS:-1}
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
LAUNCH="python3 tests/specialized/kda_launch.py --heads 12"
NCU="ncu --clock-control none -k regex:KDADecode"
ncu --version | tail -1

for point in "${@:-1:4 1:1}"; do
  for p in $point; do
    b=${p%%:*} s=${p##*:}
    tag="b${b}_s${s}"
    for cache in all none; do
      # launch 0 is the reference-checked one; launch 1 (profiled) runs a fresh case right after it
      $NCU --cache-control $cache -s 1 -c 1 --metrics gpu__time_duration.sum,sm__cycles_active.avg,smsp__inst_executed.sum \
        $LAUNCH --batch "$b" --v-split "$s" --repeat 1 2>&1 | grep -E "gpu__|sm__|smsp__" | sed "s/^/$tag cache=$cache /"
    done
    [ "$STALLS" = 0 ] && continue
    # these sections as run on the H200 (2025.3.1); adding --sampling-interval 0 and more sections there wrote no report
    $NCU --cache-control all -s 1 -c 1 --import-source no \
      --section WarpStateStats --section SourceCounters --section SchedulerStats \
      -f -o "$OUT/ncu_$tag" $LAUNCH --batch "$b" --v-split "$s" --repeat 1 > "$OUT/ncu_$tag.log" 2>&1
    ncu -i "$OUT/ncu_$tag.ncu-rep" --page details > "$OUT/ncu_$tag.txt" 2>&1
    ncu -i "$OUT/ncu_$tag.ncu-rep" --page source --csv --print-source sass > "$OUT/ncu_$tag.sass.csv" 2>&1
    echo "$tag: $(grep -E '^ +Duration' "$OUT/ncu_$tag.txt" | head -1 | tr -s ' '), sass rows $(wc -l < "$OUT/ncu_$tag.sass.csv")"
  done
done
