#!/usr/bin/env bash
# The mini-K3's training on one H200 in one device call (carry .wheelhouse/c, the wheels it needs): train ~MINUTES
# minutes (default 4), quantize the experts to MXFP4 and write the checkpoint to $OUT/mini_k3 (config.json,
# model.safetensors, tokenizer.json, training.json with the held-out scores). The first run on a fresh machine
# compiles FLA's Triton kernels: ~6 minutes (NOTES.md, run 1).
# Usage, repo root on the H200:  OUT=/some/dir bash model/kimi_k3/train/gpu_run.sh [MINUTES]
#                              (TRAIN_ARGS="--window-steps 150": more options of the training command)
# Commit $OUT/mini_k3 as model/kimi_k3/train/mini_k3 (the evals' default subject) and the held-out scores. Then the
# accuracy eval with its GPU calibration and the known-bad kernels: `bash kernels/gpu_session.sh accuracy` (a
# background job: ~150 s a measurement, nine of them, so several calls; session 29's one-call run finished none).
set -euo pipefail
# shellcheck disable=SC2086  # TRAIN_ARGS is split into options on purpose
OUT=${OUT:?set OUT to the output directory}
MINUTES=${1:-4}
source kernels/device_install.sh
mkdir -p "$OUT"
start=$(date +%s)
timeout $(( ${MINUTES%.*} * 60 + 120 )) python -m model.kimi_k3.train --out "$OUT/mini_k3" --seed 0 \
    --minutes "$MINUTES" --device cuda ${TRAIN_ARGS:-} 2> >(tail -c 4000 >&2) | tee "$OUT/train.json"
echo "total $(( $(date +%s) - start )) s"
