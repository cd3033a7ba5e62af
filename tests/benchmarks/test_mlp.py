"""benchmarks/mlp.py runs end to end (``--allow-cpu``, tiny sizes) and reports what it says."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import mlp


@pytest.mark.slow
def test_allow_cpu_smoke(tmp_path):
    out = tmp_path / "mlp.json"
    argv = ["--allow-cpu", "--tokens", "64", "--hidden", "32", "--ffn", "64", "--iters", "2",
            "--inner", "1", "--warmup", "1", "--json", str(out)]  # fmt: skip
    assert mlp.main(argv) == 0
    report = json.loads(out.read_text())
    assert not report["skipped"]
    assert {r["name"] for r in report["results"]} == {"bf16", "fp8jax", "xla_fp8"}
    assert report["checks"]["fp8jax_loss_within_10pct_of_bf16"]
    for key in ("device", "jax", "git_commit"):
        assert key in report["env"]


@pytest.mark.skipif(
    mlp.on_gpu(), reason="a CUDA device is present: main() would run the full-size benchmark"
)
def test_without_gpu_it_skips(tmp_path):
    out = tmp_path / "mlp.json"
    assert mlp.main(["--json", str(out)]) == 0
    assert json.loads(out.read_text())["skipped"]
