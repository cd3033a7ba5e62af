"""benchmarks/transformer.py runs end to end (``--allow-cpu``, tiny sizes)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import transformer


@pytest.mark.slow
def test_allow_cpu_smoke(tmp_path):
    out = tmp_path / "t.json"
    sizes = ["--batch", "1", "--seq", "16", "--hidden", "32", "--ffn", "64", "--heads", "2"]
    timing = ["--iters", "1", "--inner", "1", "--warmup", "0"]
    argv = ["--allow-cpu", *sizes, *timing, "--json", str(out)]
    assert transformer.main(argv) == 0
    report = json.loads(out.read_text())
    names = {r["name"] for r in report["results"]}
    assert names == {"fp8jax_fp8", "fp8jax_bf16", "flax_bf16"}
    assert all(r["loss"] == r["loss"] for r in report["results"])  # finite
