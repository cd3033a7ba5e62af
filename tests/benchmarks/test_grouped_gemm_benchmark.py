"""benchmarks/grouped_gemm.py runs end to end (``--allow-cpu``) and reports what it says."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import grouped_gemm


def test_splits_sum_to_the_rows_with_empty_groups():
    for kind in ("even", "uneven", "one-hot"):
        sizes = grouped_gemm.split(100, 8, kind)
        assert sum(sizes) == 100 and len(sizes) == 8 and min(sizes) >= 0
    assert 0 in grouped_gemm.split(100, 8, "uneven")
    assert sorted(grouped_gemm.split(100, 8, "one-hot"))[-2] == 0


@pytest.mark.slow  # fifteen compilations
def test_allow_cpu_smoke(tmp_path):
    out = tmp_path / "grouped_gemm.json"
    argv = ["--allow-cpu", "--iters", "1", "--inner", "1", "--warmup", "0", "--json", str(out)]
    grouped_gemm.main(argv)
    report = json.loads(out.read_text())
    assert [r["groups"] for r in report["results"]] == ["even", "uneven", "one-hot"]
    for row in report["results"]:
        assert row["fp8_vs_bf16_rel_error"] < 0.1  # E4M3 operands against bf16 ones
        assert all(row[m]["median_s"] > 0 for m in grouped_gemm.METHODS)
        assert row["tc_error"] == 0  # on CPU the option leaves the rows form on the CPU kernel
    assert report["fp8jax_path"] == "CPU kernel" and report["tensor_core_path"] is False
    for key in ("device", "jax", "git_commit"):
        assert key in report["environment"]


@pytest.mark.skipif(grouped_gemm.on_gpu(), reason="a CUDA device is present")
def test_without_gpu_it_skips(tmp_path):
    out = tmp_path / "grouped_gemm.json"
    grouped_gemm.main(["--json", str(out)])
    assert json.loads(out.read_text())["skipped"]
