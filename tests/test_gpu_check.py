"""tools/gpu_check.sh's perf profile plans its stages (dry run: nothing built or run) and
tools/changed_tests.py picks the GPU tests of the kernels changed since the last GPU run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tools"))

import changed_tests as ct

ROOT = ct.ROOT


def _plan(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    full = {**os.environ, "GPU_CHECK_PROFILE": "perf", "GPU_CHECK_DRY_RUN": "1",
            "PYTHON": sys.executable, **env}  # fmt: skip
    return subprocess.run(["bash", str(ROOT / "tools" / "gpu_check.sh"), str(tmp_path)],
                          env=full, capture_output=True, text=True, timeout=60)  # fmt: skip


def test_perf_profile_measures_first_then_tests_what_changed(tmp_path):
    proc = _plan(tmp_path, GPU_CHECK_TESTS="tests/ops/test_norm.py", GPU_CHECK_BUDGET="600")
    assert proc.returncode == 0, proc.stderr
    plan = (tmp_path / "plan.txt").read_text()
    assert plan == proc.stdout
    steps = [ln.split(":")[0] for ln in plan.splitlines()[1:]]
    assert [s.split(".")[1].split()[0] for s in steps] == [
        "build",
        "e2e",
        "gemm",
        "grouped",
        "tests",
    ]
    assert "(600 s after the start)" in plan
    assert "benchmarks/e2e.py --json bench/e2e.json --deadline <deadline - 275 s>" in plan
    for shape in ("2048x2048x2048", "4096x4096x4096", "8192x8192x8192", "16384x4096x4096",
                  "16384x16384x4096", "16384x4096x16384", "4096x16384x16384"):  # fmt: skip
        assert shape in plan
    assert "benchmarks/grouped_gemm.py" in plan and "benchmarks/moe.py" in plan
    assert "kernel implementation only): tests/ops/test_norm.py (until deadline - 20 s)" in plan
    assert "FP8JAX_TESTING=ON" in plan
    assert not (tmp_path / "build.log").exists()  # a dry run builds nothing


def test_perf_profile_without_changed_kernels_runs_no_tests(tmp_path):
    proc = _plan(tmp_path, GPU_CHECK_TESTS="")
    plan = (tmp_path / "plan.txt").read_text()
    assert proc.returncode == 0
    assert "5. tests: none" in plan and "FP8JAX_TESTING=OFF" in plan
    assert "--deadline <deadline - 185 s>" in plan  # no test reserve


def test_perf_profile_takes_its_tests_from_the_manifest(tmp_path):
    proc = _plan(tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "last GPU run:" in (tmp_path / "changed_tests.txt").read_text()


def test_unknown_profile_and_dry_run_of_the_full_profile_are_refused(tmp_path):
    proc = _plan(tmp_path, GPU_CHECK_PROFILE="fast")
    assert proc.returncode == 2 and "GPU_CHECK_PROFILE must be full or perf" in proc.stderr
    proc = _plan(tmp_path, GPU_CHECK_PROFILE="full")
    assert proc.returncode == 2 and "GPU_CHECK_DRY_RUN=1 prints the perf profile" in proc.stderr


@pytest.fixture
def manifest(tmp_path):
    """A manifest of this tree's kernel sources, as a GPU run would record it."""
    path = tmp_path / "manifest.txt"
    assert ct.main(["--write", "--note", "test run", "--manifest", str(path)]) == 0
    return path


def _edit(path: Path, drop: str | None = None, change: str | None = None) -> None:
    lines = path.read_text().splitlines()
    out = []
    for ln in lines:
        if drop and ln.endswith(f"  {drop}"):
            continue
        if change and ln.endswith(f"  {change}"):
            ln = "0" * 64 + f"  {change}"
        out.append(ln)
    path.write_text("\n".join(out) + "\n")


def _selected(manifest: Path, capsys) -> list[str]:
    capsys.readouterr()
    assert ct.main(["--manifest", str(manifest)]) == 0
    return capsys.readouterr().out.split()


def test_nothing_changed_selects_nothing(manifest, capsys):
    assert _selected(manifest, capsys) == []
    assert ct.read_manifest(manifest)[0] == "test run"


def test_a_changed_kernel_selects_its_family_and_the_host_run(manifest, capsys):
    _edit(manifest, change="cpp/cuda/cuda_norm_backward.cu")
    assert _selected(manifest, capsys) == ["tests/ops/test_norm.py", ct.HOST_RUN]


def test_a_new_python_op_file_selects_its_family_only(manifest, capsys):
    _edit(manifest, drop="fp8jax/ops/gemms/gemm.py")  # as if the last run had no gemm.py
    assert _selected(manifest, capsys) == list(ct.FAMILIES["gemm"][1])


def test_a_shared_header_selects_the_plumbing_tests(manifest, capsys):
    _edit(manifest, change="cpp/common/op_table.h")
    shared = list(ct.FAMILIES["shared"][1])
    assert _selected(manifest, capsys) == [*shared, ct.HOST_RUN]


def test_the_recorded_last_run_parses_and_every_family_test_exists():
    note, hashes = ct.read_manifest()
    assert "commit" in note and hashes
    for _, tests in ct.FAMILIES.values():
        assert all((ROOT / t).is_file() for t in tests)
    assert (ROOT / ct.HOST_RUN.split("::")[0]).is_file()


def test_write_needs_a_note(capsys):
    with pytest.raises(SystemExit):
        ct.main(["--write"])
    assert "--write needs --note" in capsys.readouterr().err
