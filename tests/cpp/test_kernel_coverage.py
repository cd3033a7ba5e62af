"""tools/kernel_coverage.py finds the body of every kernel and device function of cpp/cuda/ (the
lines whose gcov counts it reports), and says so when there are no counts to read."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import kernel_coverage  # noqa: E402


def test_every_global_function_has_its_body(tmp_path):
    src = tmp_path / "k.cu"
    src.write_text(
        "template <int N>\n"
        "__global__ void __launch_bounds__(256, 2)\n"
        "    Kern(const float* x, float* y) {\n"
        "  if (x) {\n"
        "    y[0] = x[0];\n"
        "  }\n"
        "}\n"
        "__device__ __forceinline__ float Helper(float (&v)[4]) { return v[0]; }\n"
        "__device__ float Declared(float);\n"
    )
    assert kernel_coverage.kernel_bodies(src) == [("Kern", 4, 6), ("Helper", 8, 8)]
    found = {
        name
        for path in (ROOT / "cpp" / "cuda").glob("*.cu*")
        for name, _, _ in kernel_coverage.kernel_bodies(path)
    }
    kernels = {"QuantizeKernel", "DequantizeKernel", "UpdateFp8StateKernel", "ActivationKernel",
               "DActivationKernel", "CastTransposeKernel", "ColumnTotalsKernel",
               "NormForwardKernel", "NormTransposeKernel", "NormBackwardKernel"}  # fmt: skip
    assert kernels <= found


def test_no_counts_is_a_failure(tmp_path, capsys):
    assert kernel_coverage.main(["--build-dir", str(tmp_path)]) == 1
    assert "FP8JAX_COVERAGE=ON" in capsys.readouterr().err


def test_gcov_reads_the_counts_by_absolute_path(tmp_path, monkeypatch):
    """gcov runs in each count file's folder, so a relative build dir (CI passes ``build``) must
    not reach it as a relative path."""
    folder = tmp_path / "build" / "host_cuda"
    folder.mkdir(parents=True)
    (folder / "unit.gcda").write_bytes(b"")
    asked = []

    def fake_run(cmd, **kwargs):
        asked.append((cmd[-1], kwargs["cwd"]))
        return type("Done", (), {"stdout": ""})()

    monkeypatch.setattr(kernel_coverage.subprocess, "run", fake_run)
    monkeypatch.chdir(tmp_path)
    assert kernel_coverage.gcov_counts(Path("build")) == {}
    assert asked == [(str(folder / "unit.gcda"), folder)]
