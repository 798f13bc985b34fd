#!/usr/bin/env bash
# The mini-K3 on one H200 in one device call (carry .wheelhouse/c, the wheels it needs), under 9 minutes
# wall-clock (NOTES.md). The first run on a fresh machine compiles FLA's Triton kernels: ~6 minutes (run 1):
#   1. train ~MINUTES minutes (default 4), quantize the experts to MXFP4, write the checkpoint to $OUT/mini_k3
#      (config.json, model.safetensors, tokenizer.json, training.json with the held-out scores);
#   2. the accuracy eval: reference and standard over 2 eval seeds (their differences calibrate the margins,
#      written into $OUT/mini_k3/calibration.json), then latency_specialized, the KDA steps right by construction
#      of tests/adversarial/correct_decode.py (what a bf16 NLL floor would be set from, as the CPU one was) and
#      the known-bad kernels of tests/adversarial/broken_decode.py judged against the reference; report in
#      $OUT/accuracy.json.
# Usage, repo root on the H200:  OUT=/some/dir bash model/kimi_k3/train/gpu_run.sh [MINUTES]
#                              (TRAIN_ARGS="--window-steps 150": more options of the training command)
#                         or:  OUT=/some/dir bash model/kimi_k3/train/gpu_run.sh eval   (step 2 alone, on the
#                              committed checkpoint, copied to $OUT/mini_k3 so that its calibration is written there)
# Commit $OUT/mini_k3 as model/kimi_k3/train/mini_k3 (the evals' default subject) and the report's numbers.
set -euo pipefail
# shellcheck disable=SC2086  # TRAIN_ARGS is split into options on purpose
OUT=${OUT:?set OUT to the output directory}
MINUTES=${1:-4}
source kernels/device_install.sh
mkdir -p "$OUT"
start=$(date +%s)
if [ "$MINUTES" = eval ]; then
  cp -r model/kimi_k3/train/mini_k3 "$OUT/mini_k3"
else
  timeout $(( ${MINUTES%.*} * 60 + 120 )) python -m model.kimi_k3.train --out "$OUT/mini_k3" --seed 0 \
      --minutes "$MINUTES" --device cuda ${TRAIN_ARGS:-} 2> >(tail -c 4000 >&2) | tee "$OUT/train.json"
fi
left=$(( 525 - ($(date +%s) - start) ))
mapfile -t KERNELS < <(python -c "from tests.adversarial.broken_decode import BROKEN
from tests.adversarial.correct_decode import CORRECT
for name, (op, impl) in {**CORRECT, **BROKEN}.items(): print(f'--kernel={name}={op}={impl}')")
timeout "$left" python -m gates.evals.accuracy --ckpt "$OUT/mini_k3" --device cuda --seeds 2 --calibrate \
    "${KERNELS[@]}" --seconds $(( left - 45 )) --json "$OUT/accuracy.json"
echo "total $(( $(date +%s) - start )) s"
