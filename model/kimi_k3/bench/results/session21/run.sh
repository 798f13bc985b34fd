#!/usr/bin/env bash
# (As run in session 21 from an untracked exp21/ folder: pdl.patch = ../../../specialized/linear/results/session20/patches
# 0001 + 0002, norm.patch = branch moe-norm-bf16 (landed), moe_variant.py = d29de2c's moe.py + moe_variant.diff.)
# Session 21's measurement: the step at batch 1 on main, main without the shared experts' side stream,
# pdl-triggers with PDL on in the GEMV, and that plus moe-norm-bf16; then the GPU tests of the changed code.
set -u
source kernels/device_install.sh > /dev/null 2>&1
export HUMMING_CACHE_DIR=/root/hcache HUMMING_TMP_DIR=/root/htmp
step() { echo "=== $1 $(date +%T)"; python -m gates.cli bench step --tp 8 --batch 1 --backend latency_specialized --iters 10 --json "$OUT/step_$1.json" > "$OUT/step_$1.log" 2>&1; tail -4 "$OUT/step_$1.log"; }
step main
cp model/kimi_k3/moe.py /tmp/moe.py.orig
python - <<'PY'
import re, pathlib
p = pathlib.Path("model/kimi_k3/moe.py"); s = p.read_text()
s = s.replace("side = side_stream(x.device)", "side = None", 1); p.write_text(s)
PY
step noside
cp /tmp/moe.py.orig model/kimi_k3/moe.py
(patch -p1 < exp21/pdl.patch || git apply exp21/pdl.patch) > /dev/null && python - <<'PY'
import pathlib
p = pathlib.Path("model/kimi_k3/specialized/linear/__init__.py"); s = p.read_text()
old = "    return tuned_config(m, n, k, num_sms, dtype) or LinearConfig.for_shape(m, n, k, num_sms=num_sms, out_dtype=dtype)"
assert old in s
s = s.replace(old, "    return dataclasses.replace(tuned_config(m, n, k, num_sms, dtype) or LinearConfig.for_shape(m, n, k, num_sms=num_sms, out_dtype=dtype), pdl=True)")
p.write_text(s)
PY
step pdl
(patch -p1 < exp21/norm.patch || git apply exp21/norm.patch) > /dev/null
step pdlnorm
echo "=== tests $(date +%T)"
timeout 90 python -m pytest -q tests/specialized/test_linear.py -k pdl > "$OUT/tests.log" 2>&1; tail -3 "$OUT/tests.log"
timeout 60 python -m pytest -q tests/ops/test_library_standards.py -k out_dtype >> "$OUT/tests.log" 2>&1; tail -3 "$OUT/tests.log"
echo "=== end $(date +%T)"
