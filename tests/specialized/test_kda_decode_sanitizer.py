"""compute-sanitizer on the fused KDA decode kernel (H200): no out-of-bounds or misaligned access, shared and
distributed shared memory included (memcheck), no illegal barrier use (synccheck). Each run checks only this
kernel's launches (the reference runs unchecked).

racecheck is not here: on the H200 (CUDA 13.0's sanitizer) it stops with "Internal Sanitizer Error: failed to
handle a hardware exception" on this kernel, with and without a cluster, while memcheck is clean. Before
stopping, on the cluster path it reported writes into a peer CTA's shared memory that "might not have entered
yet", which the cluster barrier at the kernel's start now rules out (NOTES.md, run 7)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kernels.cute import cutlass_available

REPO = Path(__file__).resolve().parents[2]
CUTLASS_OK, CUTLASS_WHY = cutlass_available()
SANITIZER = shutil.which("compute-sanitizer")

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (H200)"),
    pytest.mark.skipif(not CUTLASS_OK, reason=f"CuTe DSL not importable: {CUTLASS_WHY}"),
    pytest.mark.skipif(SANITIZER is None, reason="compute-sanitizer is not on PATH"),
]


@pytest.mark.parametrize("tool", ["memcheck", "synccheck"])
@pytest.mark.parametrize("v_split", [1, 4, 8])  # 4, 8: clusters, whose CTAs write into each other's shared memory
def test_kernel_is_clean_under_compute_sanitizer(tool, v_split):
    cmd = [SANITIZER, "--tool", tool, "--kernel-name", "kns=KDADecodeKernel", "--report-api-errors", "no",
           "--error-exitcode", "99", sys.executable, str(Path(__file__).with_name("kda_launch.py")),
           "--v-split", str(v_split)]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env, cwd=REPO)
    report = (run.stdout + run.stderr)[-4000:]
    assert run.returncode == 0, f"{tool}, v_split {v_split}: exit {run.returncode}\n{report}"
    assert "ERROR SUMMARY: 0 errors" in report, report
