"""benchmarks/structure.py: the structural targets hold (GEMM and cast launches per layer, FP8
transposes and casts done by XLA, one state update per step, residual bytes vs BF16), and the
StableHLO counter counts every call site of an outlined function."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

import structure


def test_counts_follow_calls():
    text = """
  func.func public @main(%a: tensor<4x4xui8>) {
    %0 = call @op(%a) : (tensor<4x4xui8>) -> tensor<4x4xui8>
    %1 = call @op(%0) : (tensor<4x4xui8>) -> tensor<4x4xui8>
    %2 = stablehlo.transpose %1, dims = [1, 0] : (tensor<4x4xui8>) -> tensor<4x4xui8>
  }
  func.func private @op(%a: tensor<4x4xui8>) {
    %0 = stablehlo.custom_call @fp8jax_cast_transpose(%a) : (tensor<4x4xui8>) -> tensor<4x4xui8>
    %1 = stablehlo.convert %0 : (tensor<4x4xf32>) -> tensor<4x4xf8E4M3FN>
  }
"""
    c = structure.lowered_counts(text)
    assert c["fp8jax_cast_transpose"] == 2
    assert c["fp8_xla_transposes"] == 1 and c["fp8_xla_casts"] == 2


@pytest.mark.parametrize("name", list(structure.LAYERS))
def test_layer_meets_its_targets(name):
    c = structure.single_device(name)
    r = {"layers": {name: c}, "amax_all_reduces": None, "residual_ratio": {}}
    assert structure.failures(r) == [], c
    assert c["state_updates"] == 1 and c["fp8_xla_casts"] == 0


def test_suite_lists_and_summarises_the_benchmarks():
    import run

    names = [s.stem for s in run.scripts()]
    assert names[:3] == ["structure", "mlp_memory", "transformer_memory"]
    assert {"gemm", "dense", "mlp", "transformer", "norm"} <= set(names)
    report = {"a": {"ratio_x": 0.5, "n": 3}, "residual_ratio": {"mlp": 0.25}, "r": [{"speedup": 2}]}
    assert run.ratios(report) == {
        "a.ratio_x": 0.5, "residual_ratio.mlp": 0.25, "r[0].speedup": 2.0,
    }  # fmt: skip
