#!/usr/bin/env bash
# (As run in session 21 from an untracked exp21/ folder: pdl.patch = ../../../specialized/linear/results/session20/patches
# 0001 + 0002, norm.patch = branch moe-norm-bf16 (landed), moe_variant.py = d29de2c's moe.py + moe_variant.diff.)
# Session 21: the MLA layer's gate projection and kv branch on side streams (K3_MLA_OVERLAP), step at batch 1.
set -u
source kernels/device_install.sh > /dev/null 2>&1
export HUMMING_CACHE_DIR=/root/hcache HUMMING_TMP_DIR=/root/htmp
timeout 60 python -m pytest -q tests/model/test_layers.py -k side_streams 2>&1 | tail -1
for mode in base late early; do
  echo "=== $mode $(date +%T)"
  K3_MLA_OVERLAP=$mode python -m gates.cli bench step --tp 8 --batch 1 --backend latency_specialized --iters 10 \
    --json "$OUT/mla_$mode.json" > "$OUT/mla_$mode.log" 2>&1
  python -c "import json; r=json.load(open('$OUT/mla_$mode.json'))['rows'][0]; print(r['ms'], r['ms_q1'], r['ms_q3'], r['kernels'])"
done
