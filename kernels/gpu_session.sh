#!/usr/bin/env bash
# One GPU session's work in a few device calls, so a 30-minute budget buys the most evidence.
# The machine stays warm only ~30 s between calls, so make them back to back (one call carries at most 64 MiB
# with the tree: the wheelhouse travels in three parts):
#   call 1 (carry .wheelhouse/a):  source kernels/device_install.sh
#   call 2 (carry .wheelhouse/b):  source kernels/device_install.sh
#   call 3 (carry .wheelhouse/c):  source kernels/device_install.sh; bash kernels/gpu_session.sh tests
#   call 4 (no carry):             source kernels/device_install.sh; bash kernels/gpu_session.sh gate COMMIT
#   call 5 (no carry), if needed:  bash kernels/gpu_session.sh collect
# Call 3's tree lacks the mini-K3 checkpoint (moved out so the tree and wheels fit 64 MiB), and a job copies the
# call's tree: a gate started there cannot load it for its accuracy eval (session 34's KDA gate ERRORed so), and
# `gate`, `evals` and `accuracy` refuse to start without it.
# A gate that is to validate an arch runs on a contract that already lists it under hardware.validated (the
# contract is one of the files its bundle covers: moving the arch afterwards makes the bundle stale).
# Budget (fresh machine): the KDA gate took ~500 s (run 16: compile 32, numerics 202, benchmarks 104, evals 131),
# mla_decode's ~655 s (gate 5: compile 21, numerics 271, benchmarks 147, evals 215), both before the evals ran beside
# the numerics (a gate now takes compile + the longer of the two + benchmarks); after a gate, `cache` brings
# Triton's autotuned cache back for the next fresh machine.
# `wall` (carrying .wheelhouse/small; no CuTe kernel needed) runs the gate's own checks on the GPU before any regate
# that follows a change to gates/core: the sandbox, adversarial, numerics, benchgate, l2 and compare test groups,
# and the L2 probe ($OUT/l2.json): what confines and watches candidate code, on the machine that gates. They take
# three calls (session 28, a fresh H100): TEST_GROUPS=sandbox (~400 s), then adversarial (~540 s), then
# benchgate,numerics,compare,l2 (~250 s).
# `tests` runs each GPU test group under its own time limit (a hang costs that group, not the call) with
# verbose logs; TEST_GROUPS=route,experts (names in run_tests) runs only those. COMMIT is the hash of the
# working tree's commit, taken on the machine that sends the call: the runner's copy of the tree can sit on
# another commit, so `git rev-parse HEAD` there would label the bundle wrongly. `gate COMMIT` and `evals` start a background job that outlives the call (the gate's
# benchmarks need the GPU to themselves, so start nothing else until it is done) and wait while the call has
# time; `collect` waits for the jobs still running and copies what they wrote to $OUT: the bundles as
# $OUT/evidence.tar (evidence/<op>/<arch>/; `tar -xf` it here), the model-level evals at their full GPU
# budgets (k3 shapes, 4 layers: every structured-output schema, long context up to 128K tokens; ~8 minutes)
# as $OUT/evals.json and $OUT/evals_report/eval_report.{html,md}, every log as $OUT/*.log (EVAL_ARGS adds options:
# "--kv-cache-dtype fp8" runs them over the FP8 MLA cache, "--only long_context" that eval alone).
# `accuracy` starts the accuracy eval on the committed mini-K3 as a background job (the GPU calibration and the
# known-bad kernels; ~25 minutes, so `collect` over several calls; $OUT/accuracy.json, $OUT/calibration.json);
# ACCURACY_ARGS="--budget gate --seeds 1" judges them on the evals gate's own items instead (~1/3 of the time).
# `train MINUTES` starts the mini-K3's training as a background job (the GPU tests may share the GPU with it, the
# gate and the probes may not: alongside other GPU work it ran at a tenth of its speed); `collect` brings back
# $OUT/mini_k3. `probes` runs the kernels' timing probes (moe_experts path pairs, mla_decode points, the router's
# stages); `profile` runs Nsight Compute over mla_decode's launches ($OUT/mla_decode.ncu-rep and its details as
# text; PROFILE_POINTS, PROFILE_PATHS choose); `profile-experts` the same over moe_experts' launches at TP8
# (PROFILE_TOKENS, default "1 8 16"). `cache` brings back Triton's cache in parts (see device_install.sh).
#   decode bundle (after a change to code it covers):  bash kernels/gpu_session.sh decode COMMIT, repeated
#                  back to back until $OUT/decode.tar comes back (`tar -xf` it here; commit evidence/decode/, and
#                  decode/*.json with decode/logs/ as model/kimi_k3/bench/results/runN/)
# A call brings back at most 8 files from $OUT (16 MiB each): what writes many travels as a tar.
#
# On a machine of two GPUs (kind nvidia-h200-x2; model/kimi_k3/NOTES_TP.md has the plan and what to expect):
#   calls 1, 2 (carry .wheelhouse/a, then .wheelhouse/b):  source kernels/device_install.sh
#   call 3 (carry .wheelhouse/c):  source kernels/device_install.sh; bash kernels/gpu_session.sh tp2
#   call 4 (no carry):             source kernels/device_install.sh; bash kernels/gpu_session.sh tp2bench
# `tp2` records how the GPUs are linked, runs the NCCL TP2 generation test (TP2 under CUDA graphs against TP1
# and against eager) and the all-reduce floor (NCCL and symmetric-memory one-shot, 1-16 tokens); `tp2bench`
# times the KDA layer at TP2 with its all-reduces, beside the one-rank figure with them excluded. NVLink
# multicast stays off (NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1, NVSHMEM_DISABLE_NVLS=1, exported
# here and set again in every TP rank): on these shared machines a program using it can take the host's GPUs
# out of service.
#
# A branch's code on the device: `git diff main...BRANCH > device.patch` here and carry `device.patch` (ignored, so
# never committed by accident); this script applies it to the call's copy of the tree before anything runs (the
# device tool copies the tree afresh at every call, so carry it in every call that runs the branch's code; jobs
# started then run their own copy of the patched tree). A patch that does not apply stops the call.
set -u
OUT=${OUT:-/tmp/out}
if [ -f device.patch ]; then
  patch -p1 -s --forward < device.patch || { echo "device.patch does not apply to this tree" >&2; exit 2; }
  rm device.patch
fi
# Every call needs the wheels on PYTHONPATH and Triton's cache dir: a call that did not source the installer itself
# (an easy slip between back-to-back calls) gets them here instead of failing on `import cutlass` minutes in.
if [ -z "${TRITON_CACHE_DIR:-}" ] || ! python3 -c "import cutlass" 2>/dev/null; then
  # shellcheck source=kernels/device_install.sh
  source kernels/device_install.sh /tmp/site > /dev/null 2>&1  # its $1 would otherwise be this script's
fi
export HUMMING_CACHE_DIR=${HUMMING_CACHE_DIR:-/root/hcache} HUMMING_TMP_DIR=${HUMMING_TMP_DIR:-/root/htmp}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1  # multicast off, always
RUN=/root/k3forge-gpu
mkdir -p "$OUT" "$RUN"
export PYTHONUNBUFFERED=1
CALL_START=$(date +%s)
CALL_LIMIT=${CALL_LIMIT:-570}  # seconds of this device call to use before returning

left() { echo $((CALL_LIMIT - ($(date +%s) - CALL_START))); }

run_tests() {
  # group name, seconds, pytest targets; TEST_GROUPS=route,experts runs only those groups (a kernel's first GPU
  # tests compile every config they cover: each kernel has its own group, so one slow compile costs its group only).
  # A group runs the tests marked gpu, or with `--all` first every test of its targets (CPU tests that take the GPU
  # where there is one, as the gates' own tests do)
  local groups=(
    "kda 240 tests/specialized/test_kda_*.py"  # a fresh machine: FLA compiles and autotunes first (150 s was short)
    "linear 150 tests/specialized/test_linear.py"
    "route 240 tests/specialized/test_moe_route.py"
    "experts 240 tests/specialized/test_moe_experts.py"
    "attn_res 150 tests/specialized/test_attn_res*.py"  # attn_res and attn_res_norm (one kernel file)
    "situ_mlp 150 tests/specialized/test_situ_mlp.py"
    "mla 360 tests/specialized/test_mla_decode*.py"  # mla_decode both paths (~116 GPU tests), mla_decode_fp8
    "kernels 60 tests/kernels"
    "adversarial 540 tests/adversarial --ignore=tests/adversarial/test_accuracy_bites.py"  # ~13 GPU gates: 5 took 294 s (s28)
    "evalgate 360 tests/gates/checks/test_evals_gate.py"  # the accuracy eval in the gate on the KDA kernel
    "benchgate 240 tests/gates/checks/test_benchmarks.py"  # 94 s on a fresh H100, FLA compiling first (s28)
    "numerics 120 --all tests/gates/checks/test_numerics_gate.py -k reference_as_candidate"  # the honest candidate: `concurrent`, `kept` on a GPU
    "compare 60 tests/gates/core/test_compare.py"  # the judge's comparison of large tensors on the GPU
    "l2 60 tests/gates/core/test_l2.py"  # the L2 set-aside the benchmarks read and release
    # the candidate's process confined (no capability, the tree and /usr read-only) and its leftovers stopped, on
    # the GPU machine first: a CUDA, CUPTI or compile-cache need the confinement misses shows here (session 26;
    # the compile caches split by trust, session 27)
    "sandbox 480 --all tests/gates/core/test_isolation.py tests/gates/core/test_strays.py tests/gates/core/test_sandbox.py tests/gates/core/test_caches.py tests/adversarial/test_adversarial.py::test_the_standards_compiled_kernels_are_out_of_the_candidates_reach tests/adversarial/test_adversarial.py::test_a_candidate_cannot_write_into_the_tree tests/adversarial/test_adversarial.py::test_a_startup_hook_planted_in_the_installation_never_lands tests/adversarial/test_adversarial.py::test_a_process_the_candidate_leaves_behind_is_stopped_before_it_can_write tests/gates/checks/test_numerics_gate.py::test_the_reference_as_candidate_passes_every_check"
    "model 120 tests/model --ignore=tests/model/test_dispatch.py"  # the layers' GPU tests (MoE side streams in a graph)
    "accuracy 420 tests/adversarial/test_accuracy_bites.py"
    "dispatch 90 tests/model/test_dispatch.py"
    "evals 150 tests/evals/test_gpu.py"
  )
  for g in "${groups[@]}"; do
    set -- $g
    local name=$1 limit=$2 marker=(-m gpu)
    shift 2
    if [ "$1" = --all ]; then marker=(); shift; fi
    case ",${TEST_GROUPS:-$name}," in *",$name,"*) ;; *) continue ;; esac
    echo "== $name (${limit} s)"
    timeout -s INT "$limit" python3 -m pytest -v -p no:cacheprovider "${marker[@]}" --durations=5 "$@" \
      > "$OUT/pytest_$name.log" 2>&1
    echo "   exit $? -- $(tail -1 "$OUT/pytest_$name.log")"
  done
}

run_limited() {
  # name, seconds, command...: the command under its own time limit, its output in $OUT/NAME.log
  local name=$1 limit=$2
  shift 2
  echo "== $name (${limit} s)"
  timeout -s INT "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "   exit $? -- $(tail -1 "$OUT/$name.log")"
}

run_tp2() {
  { nvidia-smi topo -m; python3 -c 'import torch; print("GPUs:", torch.cuda.device_count())'; } \
    > "$OUT/tp2_topology.log" 2>&1
  cat "$OUT/tp2_topology.log"
  run_limited pytest_tp2 300 python3 -m pytest -v -s -p no:cacheprovider -m gpu --durations=5 \
    tests/model/test_tp_nccl.py
  run_limited allreduce_tp2 150 python3 -m model.kimi_k3.bench.allreduce --tp 2 --json "$OUT/allreduce_tp2.json"
  cat "$OUT/allreduce_tp2.log"
}

run_tp2_bench() {
  run_limited bench_layer_tp2 "${TP2_BENCH_S:-540}" python3 -m gates.cli bench layer --kind kda --tp 2 \
    --batch "${TP2_BATCH:-1,16}" --layers 4 --backend auto --collectives --json "$OUT/layer_tp2_kda.json"
  grep -v -i warn "$OUT/bench_layer_tp2.log" | tail -20
}

# The decode bundle's benches (model/kimi_k3/bench/NOTES.md, run 2), one at a time while the call has time,
# skipping those already recorded in this machine's $RUN (it keeps /root ~30 s between calls: call again at once);
# with all six recorded, the bundle evidence/decode/sm_90 as $OUT/decode.tar (with the records).
DECODE_BENCHES=(
  "l_dense8 layer --kind dense --tp 8 --batch 1,64 --layers 4 --iters 20"
  "l_kda8 layer --kind kda --tp 8 --batch 1,4,16,64 --layers 8 --iters 20"
  "l_kda16 layer --kind kda --tp 16 --batch 1,64 --layers 8 --iters 20"
  "l_mla8 layer --kind mla --tp 8 --batch 1,64 --layers 8 --iters 20"
  "s8 step --tp 8 --batch 1,64 --iters 10"
  "s8k7 step --tp 8 --batch 1 --spec-tokens 7 --iters 10"
)

run_decode() {
  local commit=$1 name bench
  mkdir -p "$RUN/decode"
  for bench in "${DECODE_BENCHES[@]}"; do
    name=${bench%% *}
    [ -s "$RUN/decode/$name.json" ] && continue
    if [ "$(left)" -lt 200 ]; then echo "== decode: $name not started; call 'decode $commit' again now"; return 0; fi
    # shellcheck disable=SC2086 # the bench's options are words
    # K3FORGE_COMMIT: the records' commit (the runner's copy of .git can sit on an older one; run 3's did)
    K3FORGE_COMMIT=$commit run_limited "decode_$name" $(($(left) - 30)) python3 -m gates.cli bench ${bench#* } \
      --backend both --json "$RUN/decode/$name.json"
  done
  K3FORGE_COMMIT=$commit run_limited decode_bundle 120 python3 -m gates.cli evidence decode "$RUN"/decode/*.json \
    --out "$RUN/evidence/decode/sm_90"
  # a call brings back at most 8 files: the benches' logs travel inside the tar (decode/logs/), so a collect in
  # the same call still gets its evidence.tar and gate.log back (session 19's did not)
  mkdir -p "$RUN/decode/logs" && mv "$OUT"/decode_*.log "$RUN/decode/logs/"
  tar -C "$RUN" -cf "$OUT/decode.tar" evidence/decode decode
}

run_probes() {
  # the kernels' own timing probes (each NOTES.md says what they answer); the GPU must be otherwise idle
  run_limited probe_moe_experts 200 python3 -m model.kimi_k3.specialized.moe_experts.probe
  # mla_decode: both caches at the gate's lengths and at full lengths, over the split heuristic's knob (NOTES.md,
  # "Split plan"; a sweep compiles nothing new)
  run_limited bench_mla_decode 150 python3 -m model.kimi_k3.specialized.mla_decode.bench --heads 12 \
    --paths mma e4m3 --lengths random --ctas-per-sm 2 4 8
  run_limited bench_mla_decode_full 120 python3 -m model.kimi_k3.specialized.mla_decode.bench --heads 12 \
    --paths mma --lengths full --ctas-per-sm 2 4 8
  run_limited probe_moe_route 100 python3 -m model.kimi_k3.specialized.moe_route.probe
}

# Nsight Compute's sections for the profiles (a run needs a runtime whose counters ncu can read: KINDS.md, Firecracker)
NCU_SECTIONS="--section SpeedOfLight --section WarpStateStats --section MemoryWorkloadAnalysis \
  --section ComputeWorkloadAnalysis --section Occupancy --section LaunchStats --section SchedulerStats \
  --section SourceCounters --section InstructionStats"

ncu_summary() {
  # the headline rows of a profile's details page ($1: the report's name under $OUT)
  ncu -i "$OUT/$1.ncu-rep" --page details > "$OUT/ncu_$1_details.txt" 2>&1
  grep -E "^  [a-z_]+.*\(|Duration|DRAM Throughput|Memory Throughput|Compute \(SM\) Throughput|Achieved Occupancy|\
Registers Per|Warp Cycles Per Issued|Issued Ipc|L1/TEX Hit|Shared Memory|No Eligible|Bank|Executed Instructions " \
    "$OUT/ncu_$1_details.txt" | head -150
}

run_profile() {
  # mla_decode's two launches at three points (one call of each, `bench --check-only`): where the partial's time goes
  # shellcheck disable=SC2086 # the sections are words
  run_limited ncu_mla "${PROFILE_S:-240}" ncu --clock-control none -k 'regex:partial|merge' $NCU_SECTIONS -f \
    -o "$OUT/mla_decode" python3 -m model.kimi_k3.specialized.mla_decode.bench --check-only \
    --points ${PROFILE_POINTS:-1x1024 16x8192 64x4096} --heads 12 --paths ${PROFILE_PATHS:-mma}
  ncu_summary mla_decode
}

run_profile_experts() {
  # moe_experts' two launches (up_mma, down_mma) once each at TP8 for PROFILE_TOKENS (`probe --check-only`)
  # shellcheck disable=SC2086 # the sections and token counts are words
  run_limited ncu_experts "${PROFILE_S:-150}" ncu --clock-control none -k 'regex:up|down' $NCU_SECTIONS -f \
    -o "$OUT/moe_experts" python3 -m model.kimi_k3.specialized.moe_experts.probe --check-only --inter 384 \
    --tokens ${PROFILE_TOKENS:-1 8 16}
  ncu_summary moe_experts
}

alive() { [ -f "$RUN/$1.pid" ] && kill -0 "$(cat "$RUN/$1.pid")" 2>/dev/null; }

MINI_K3=model/kimi_k3/train/mini_k3/model.safetensors
need_checkpoint() {
  # the evals judge accuracy on the trained mini-K3; a call whose tree left it out (the .wheelhouse/c call) says so
  [ -s "$MINI_K3" ] && return 0
  echo "== not started: $MINI_K3 is missing from this call's tree (the .wheelhouse/c call leaves it out): start it in the next call" >&2
  return 1
}

start_job() {
  # job name, file for its stdout (its log when empty), command...; stderr goes to its log.
  # The job runs in its own copy of the tree, $RUN/tree-NAME: the device tool copies the working tree afresh at
  # every call (its files removed and written again), which a job that outlives its call would see mid-run (a gate's
  # sandbox rightly reported it as the candidate writing to the repository, and failed the evals running then)
  local name=$1 stdout=${2:-$RUN/$1.log} repo=$PWD tree=$RUN/tree-$1
  shift 2
  rm -rf "$tree" && mkdir -p "$tree" &&
    tar --exclude=./.wheelhouse --exclude=./.triton_cache -cf - . | tar -C "$tree" -xf - || return 1
  cd "$tree" || return 1
  if [ "$stdout" = "$RUN/$name.log" ]; then
    PYTHONPATH=${PYTHONPATH//$repo/$tree} setsid nohup "$@" > "$stdout" 2>&1 &
  else
    PYTHONPATH=${PYTHONPATH//$repo/$tree} setsid nohup "$@" > "$stdout" 2> "$RUN/$name.log" &
  fi
  echo $! > "$RUN/$name.pid"
  cd "$repo" || return 1
  echo "== $name started (pid $!) in $tree"
}

collect() {
  local jobs=(gate evals train accuracy)
  while [ "$(left)" -gt 15 ]; do
    local running=0
    for j in "${jobs[@]}"; do alive "$j" && running=1; done
    [ $running = 0 ] && break
    sleep 5
  done
  for j in "${jobs[@]}"; do
    [ -f "$RUN/$j.pid" ] || continue
    grep -v -i warn "$RUN/$j.log" | tail -15
    cp "$RUN/$j.log" "$OUT/$j.log"
    if alive "$j"; then
      echo "== $j still running: call again with 'collect' within 30 s"
    else
      echo "== $j done"
    fi
  done
  # the device tool brings back no folder three levels deep (evidence/<op>/<arch>): the bundles travel as a tar
  [ -d "$RUN/evidence" ] && ! alive gate && tar -C "$RUN" -cf "$OUT/evidence.tar" evidence
  [ -s "$RUN/evals.json" ] && ! alive evals && cp -r "$RUN/evals.json" "$RUN/evals_report" "$OUT/"
  [ -s "$RUN/mini_k3/model.safetensors" ] && ! alive train && cp -r "$RUN/mini_k3" "$RUN/train.json" "$OUT/"
  [ -s "$RUN/accuracy.json" ] && cp "$RUN/accuracy.json" "$OUT/"  # partial while the job runs
  [ -f "$RUN/mini_k3_eval/calibration.json" ] && ! alive accuracy && cp "$RUN/mini_k3_eval/calibration.json" "$OUT/"
  return 0
}

while [ $# -gt 0 ]; do
  case $1 in
    tests) run_tests; shift ;;
    wall)
      TEST_GROUPS=${TEST_GROUPS:-sandbox,adversarial,numerics,benchgate,l2,compare} run_tests
      run_limited l2_probe 60 python3 -m gates.core.l2 --json "$OUT/l2.json"
      shift ;;
    gate)
      need_checkpoint || { shift 2; continue; }
      K3FORGE_COMMIT=$2 start_job gate "" python3 -m gates.cli gate --ops "${OPS:-kda_decode}" \
        --out "$RUN/evidence" --trials 1 --runs 3 --steps 16
      collect; shift 2 ;;
    evals)
      if alive gate; then echo "== evals not started: the gate is still timing"; shift; continue; fi
      need_checkpoint || { shift; continue; }
      # shellcheck disable=SC2086  # EVAL_ARGS: more of the eval command's options, e.g. --kv-cache-dtype fp8
      start_job evals "$RUN/evals.json" python3 -m gates.cli eval --preset k3 --json --report "$RUN/evals_report" \
        ${EVAL_ARGS:-}
      collect; shift ;;
    accuracy)
      # the accuracy eval on the committed mini-K3 (gates/evals/accuracy.py) as a background job: reference and
      # standard over 2 eval seeds (their differences are the GPU calibration, written into its copy), then
      # latency_specialized, the KDA steps right by construction and the known-bad kernels, each judged against the
      # reference. ~150 s a measurement: `collect` in the calls after brings back $OUT/accuracy.json (rewritten
      # after each measurement) and $OUT/calibration.json (commit its cuda entry into the checkpoint's)
      need_checkpoint || { shift; continue; }
      rm -rf "$RUN/mini_k3_eval" && cp -r model/kimi_k3/train/mini_k3 "$RUN/mini_k3_eval"
      # ACCURACY_ARGS replaces the calibration run's options, e.g. "--budget gate --seeds 1": the known-bad kernels
      # judged on the evals gate's own items, its margin (2x the standard's distance on them), in a third the time
      mapfile -t KERNELS < <(python3 -c "from tests.adversarial.broken_decode import BROKEN
from tests.adversarial.correct_decode import CORRECT
for name, (op, impl) in {**CORRECT, **BROKEN}.items(): print(f'--kernel={name}={op}={impl}')")
      # shellcheck disable=SC2086  # ACCURACY_ARGS: options, words
      start_job accuracy "" python3 -m gates.evals.accuracy --ckpt "$RUN/mini_k3_eval" --device cuda \
        ${ACCURACY_ARGS:---seeds 2 --calibrate} "${KERNELS[@]}" --json "$RUN/accuracy.json"
      collect; shift ;;
    train)
      # the mini-K3 (model/kimi_k3/train/NOTES.md) in the background for $2 minutes: FLA's first compile counts
      rm -rf "$RUN/mini_k3"
      # shellcheck disable=SC2086  # TRAIN_ARGS: more of the training command's options, e.g. --window-steps 150
      start_job train "$RUN/train.json" python3 -m model.kimi_k3.train --out "$RUN/mini_k3" --seed 0 \
        --minutes "$2" --device cuda ${TRAIN_ARGS:-}
      shift 2 ;;
    probes) run_probes; shift ;;
    profile) run_profile; shift ;;
    profile-experts) run_profile_experts; shift ;;
    cache)
      # Triton's cache with FLA's autotuning in it, compressed, in parts a call brings back (16 MiB a file, 8
      # files): put them in .triton_cache/ here and carry that folder, so a fresh machine skips the ~6 minutes
      tar -C "$TRITON_CACHE_DIR" -czf "$RUN/triton_cache.tgz" . && split -b 15M -d "$RUN/triton_cache.tgz" \
        "$OUT/triton_cache.tgz.part" && ls -la "$OUT"
      shift ;;
    collect) collect; shift ;;
    decode) run_decode "$2"; shift 2 ;;
    tp2) run_tp2; shift ;;
    tp2bench) run_tp2_bench; shift ;;
    *) echo "usage: gpu_session.sh [wall] [tests] [gate COMMIT] [evals] [accuracy] [train MINUTES] [probes] [profile] [profile-experts] [cache] [collect] [decode COMMIT] [tp2] [tp2bench]" >&2; exit 2 ;;
  esac
done
