#!/usr/bin/env bash
# One GPU session's work in three device calls, so a 30-minute budget buys the most evidence.
# The machine stays warm only ~30 s between calls, so make them back to back:
#   call 1 (carry .wheelhouse/a):  source kernels/device_install.sh
#   call 2 (carry .wheelhouse/b):  source kernels/device_install.sh; bash kernels/gpu_session.sh tests gate COMMIT
#   call 3 (no carry):             bash kernels/gpu_session.sh collect
# `tests` runs each GPU test group under its own time limit (a hang costs that group, not the call) with
# verbose logs; `gate COMMIT` starts `k3forge gate` for the GPU contracts in the background (it outlives the
# call; nothing else may use the GPU while it times) and waits while the call has time; `collect` waits for
# the gate and copies its bundles and logs to $OUT. Logs: $OUT/*.log; bundles: $OUT/evidence/<op>/<arch>/.
set -u
OUT=${OUT:-/tmp/out}
RUN=/root/k3forge-gpu
mkdir -p "$OUT" "$RUN"
export PYTHONUNBUFFERED=1
CALL_START=$(date +%s)
CALL_LIMIT=${CALL_LIMIT:-570}  # seconds of this device call to use before returning

left() { echo $((CALL_LIMIT - ($(date +%s) - CALL_START))); }

run_tests() {
  # group name, seconds, pytest targets
  local groups=(
    "kernel 150 tests/specialized tests/kernels"
    "adversarial 120 tests/adversarial tests/gates/test_benchmarks.py"
    "dispatch 90 tests/model/test_dispatch.py"
    "evals 150 tests/evals/test_gpu.py"
  )
  for g in "${groups[@]}"; do
    set -- $g
    local name=$1 limit=$2
    shift 2
    echo "== $name (${limit} s)"
    timeout -s INT "$limit" python3 -m pytest -v -p no:cacheprovider -m gpu --durations=5 "$@" \
      > "$OUT/pytest_$name.log" 2>&1
    echo "   exit $? -- $(tail -1 "$OUT/pytest_$name.log")"
  done
}

start_gate() {
  K3FORGE_COMMIT=$1 setsid nohup python3 -m gates.cli gate --ops "${OPS:-kda_decode}" --out "$RUN/evidence" \
    --trials 1 --runs 3 --steps 16 > "$RUN/gate.log" 2>&1 &
  echo $! > "$RUN/gate.pid"
  echo "== gate started (pid $(cat "$RUN/gate.pid"), commit $1)"
}

wait_gate() {
  while kill -0 "$(cat "$RUN/gate.pid")" 2>/dev/null && [ "$(left)" -gt 15 ]; do sleep 5; done
  grep -v -i warn "$RUN/gate.log" | tail -25
  cp "$RUN/gate.log" "$OUT/gate.log"
  if kill -0 "$(cat "$RUN/gate.pid")" 2>/dev/null; then
    echo "== gate still running: call again with 'collect' within 30 s"
  else
    cp -r "$RUN/evidence" "$OUT/" 2>/dev/null
    echo "== gate done; bundles under \$OUT/evidence"
  fi
}

while [ $# -gt 0 ]; do
  case $1 in
    tests) run_tests; shift ;;
    gate) start_gate "$2"; wait_gate; shift 2 ;;
    collect) wait_gate; shift ;;
    *) echo "usage: gpu_session.sh [tests] [gate COMMIT] [collect]" >&2; exit 2 ;;
  esac
done
