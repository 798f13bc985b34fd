#!/usr/bin/env bash
# (As run in session 21 from an untracked exp21/ folder: pdl.patch = ../../../specialized/linear/results/session20/patches
# 0001 + 0002, norm.patch = branch moe-norm-bf16 (landed), moe_variant.py = d29de2c's moe.py + moe_variant.diff.)
# Session 21: where the MoE's independent branches fork (K3_MOE_OVERLAP in exp21/moe_variant.py), step at batch 1.
set -u
source kernels/device_install.sh > /dev/null 2>&1
export HUMMING_CACHE_DIR=/root/hcache HUMMING_TMP_DIR=/root/htmp
cp exp21/moe_variant.py model/kimi_k3/moe.py
for mode in ${MODES:-base route_side mid late route_side_late}; do
  echo "=== $mode $(date +%T)"
  K3_MOE_OVERLAP=$mode python -m gates.cli bench step --tp 8 --batch ${BATCH:-1} --backend latency_specialized --iters 10 \
    --json "$OUT/moe_$mode.json" > "$OUT/moe_$mode.log" 2>&1; tail -3 "$OUT/moe_$mode.log" | head -1
done
echo "=== end $(date +%T)"
