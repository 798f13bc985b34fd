#!/usr/bin/env bash
# Install the offline wheelhouse (make wheelhouse) on a GPU runner without a package index.
# Usage (repo root on the runner):  source kernels/device_install.sh [SITE_DIR]
# Reassembles the cutlass-dsl compiler wheel from its three parts (.wheelhouse/a, b and c, the other wheels in
# .wheelhouse/c, may arrive in separate calls: all are collected under /root/wh), installs every wheel with
# --no-deps into SITE_DIR (default /tmp/site) and exports PYTHONPATH (the cutlass wheel's .pth is not processed by
# --target, so its dsl_packages directory is added by hand).
SITE=${1:-/tmp/site}
WH=/root/wh
mkdir -p "$WH"
# .wheelhouse/small: every wheel but the compiler's, for a call that needs no CuTe kernel (gpu_session.sh wall)
for d in .wheelhouse/a .wheelhouse/b .wheelhouse/c .wheelhouse/small; do [ -d "$d" ] && cp -n "$d"/* "$WH"/ 2>/dev/null; done
# a large wheel travels in parts, one a call (each call carries at most 64 MiB with the tree), with WHEEL.parts
# (in .wheelhouse/c) saying how many: it is put together once every part has arrived
for count in "$WH"/*.parts; do
  [ -f "$count" ] || continue
  whl=${count%.parts}
  parts=$(seq -f "$whl.part%02g" 0 $(($(cat "$count") - 1)))
  # shellcheck disable=SC2086 # the parts' names are words
  ls $parts >/dev/null 2>&1 && cat $parts > "$whl" && rm -f $parts "$count"
done
export PYTHONPATH="$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages:$PWD${PYTHONPATH:+:$PYTHONPATH}"
# what the wheels here must make importable (the compiler only where its wheel has arrived)
modules="fla, pydantic, jsonschema"
ls "$WH"/nvidia_cutlass_dsl-*.whl >/dev/null 2>&1 && modules="cutlass, $modules"
# complete wheels only (a lone .part00 is not matched by *.whl); --upgrade replaces an earlier install. A later call
# on the same warm machine with the same wheels skips the install, unless one of them does not import once every
# part is in (session 31: an install left pydantic out while cutlass and fla imported, and the tests' conftest
# failed minutes later)
if [ "$(ls "$WH"/*.whl 2>/dev/null)" != "$(cat "$SITE/.k3forge-wheels" 2>/dev/null)" ] ||
  { ! ls "$WH"/*.part?? >/dev/null 2>&1 && ls "$WH"/*.whl >/dev/null 2>&1 &&
    ! python3 -c "import $modules" 2>/dev/null; }; then
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$SITE" "$WH"/*.whl &&
    ls "$WH"/*.whl > "$SITE/.k3forge-wheels"
fi
python3 -c "import cutlass, fla; print('cutlass', cutlass.__version__, 'fla', fla.__version__)" 2>&1 | tail -1
# Triton's cache, with autotuning results (FLA's chunked KDA autotunes for ~6 minutes on a fresh machine): in
# /root (kept between back-to-back calls); a carried .triton_cache/ (a previous call's `gpu_session.sh cache`
# parts, same Triton and GPU) seeds an empty one
export TRITON_CACHE_DIR=/root/triton-cache TRITON_CACHE_AUTOTUNING=1
if ls .triton_cache/triton_cache.tgz.part* >/dev/null 2>&1 && [ ! -d "$TRITON_CACHE_DIR" ]; then
  mkdir -p "$TRITON_CACHE_DIR" && cat .triton_cache/triton_cache.tgz.part* | tar -C "$TRITON_CACHE_DIR" -xz
fi
