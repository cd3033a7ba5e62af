"""tools/ptxas_report.sh reads an arch from the build's own ptxas report (FP8JAX_PTXAS_LOGS, what
tools/ptxas_log.sh keeps when the build runs with FP8JAX_PTXAS_LOG_DIR) instead of compiling it
again, and still fails on a spill found there."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc on PATH")

_REPORT = (
    "ptxas info    : Compiling entry function '_Z4Kernv' for 'sm_90'\n"
    "ptxas info    : Function properties for _Z4Kernv\n"
    "    0 bytes stack frame, {spill} bytes spill stores, {spill} bytes spill loads\n"
    "ptxas info    : Used 32 registers, used 1 barriers, 512 bytes smem\n"
)


def _report(tmp_path: Path, spill: int) -> subprocess.CompletedProcess:
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "cuda_norm.cu.log").write_text(_REPORT.format(spill=spill))
    env = dict(
        os.environ,
        FP8JAX_PY=sys.executable,
        FP8JAX_PTXAS_LOGS=str(logs),
        FP8JAX_PTXAS_ARCHS="90",
        FP8JAX_PTXAS_SOURCES="cpp/cuda/cuda_norm.cu",
    )
    return subprocess.run(
        ["bash", "tools/ptxas_report.sh"], cwd=ROOT, env=env, capture_output=True, text=True
    )


def test_an_arch_in_the_build_report_is_read_not_compiled(tmp_path):
    run = _report(tmp_path, spill=0)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "read from the build's reports" in run.stdout
    assert "cuda_norm.cu sm_90" in run.stdout
    # The one kernel of the fake report, not the dozens a compile of cuda_norm.cu would give.
    rows = [line for line in run.stdout.splitlines() if line.split()[-1:] == ["Kern"]]
    assert len(rows) == 1 and rows[0].split()[:2] == ["32", "512"], run.stdout


def test_a_spill_in_the_build_report_fails(tmp_path):
    run = _report(tmp_path, spill=8)
    assert run.returncode != 0
    assert "SPILL" in run.stdout
