"""benchmarks/structure.py: the structural targets hold (GEMM and cast launches per layer, FP8
transposes and casts done by XLA, one state update per step, residual bytes vs BF16, the cost
model's predicted ratios), and the StableHLO counter counts every call site of an outlined
function. These hold every target ``structure.py --check`` does on one device, so CI runs them
here rather than the script again."""

from __future__ import annotations

import sys
import types
from pathlib import Path

import jax
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


@pytest.mark.parametrize("recipe", list(structure.BLOCK_RECIPES))
@pytest.mark.parametrize("name", list(structure.LAYERS))
def test_block_recipes_meet_their_targets(name, recipe):
    """Each GEMM operand block-cast once, in both layouts, by the kernel; nothing in FP8 left to
    XLA; no state."""
    c = structure.single_device(name, structure.BLOCK_RECIPES[recipe])
    r = {"block_recipes": {recipe: {"layers": {name: c}, "residual_ratio": 0.0}}}
    assert structure.block_failures(r) == [], c
    assert c["casts"] == c["casts_expected"]
    # (a GPU here without the recipe's scale mode, an H200 under MXFP8: XLA's GEMMs, no fp8jax_gemm)
    gemm = {"fp8jax_gemm"} if c["cublaslt_here"] else set()
    assert set(c["custom_calls"]) >= {"fp8jax_block_cast_transpose"} | gemm
    if name != "dense":  # the norm, the MLP's activation, its gradient, dbias: fused in casts
        norms = {"layernorm_mlp": 1, "transformer_layer": 2}[name]
        assert c["custom_calls"]["fp8jax_norm_block_cast_transpose"] == norms
        assert "fp8jax_layernorm_forward" not in c["custom_calls"]
        assert c["custom_calls"]["fp8jax_activation_block_cast_transpose"] == 1
        assert c["custom_calls"]["fp8jax_dactivation_block_cast_transpose_dbias"] == 1
        assert c["custom_calls"]["fp8jax_block_cast_transpose_dbias"] >= 1
    if c["cublaslt_here"]:
        assert 0 < c["gemms"] <= c["gemms_expected"]  # cuBLASLt's block-scaled GEMM (block_gemm)


def test_a_gpu_without_the_scale_mode_is_held_to_xla_gemms(monkeypatch):
    """MXFP8 lowered where the GPU is a Hopper (as on the H200 that first ran it): no
    fp8jax_gemm, and the targets say so rather than fail."""
    fake = types.SimpleNamespace(compute_capability="9.0")
    real = jax.devices
    monkeypatch.setattr(jax, "devices", lambda *a: [fake] if a == ("gpu",) else real(*a))
    c = structure.single_device("dense", structure.BLOCK_RECIPES["mxfp8"])
    assert not c["cublaslt_here"] and c["gemms"] == 0
    r = {"block_recipes": {"mxfp8": {"layers": {"dense": c}, "residual_ratio": 0.0}}}
    assert structure.block_failures(r) == []
    c["gemms"] = 1  # a GEMM custom call the GPU cannot run
    assert structure.block_failures(r) == ["mxfp8 dense: 1 GEMMs on a GPU without the mode"]


@pytest.mark.parametrize("recipe", list(structure.BLOCK_RECIPES))
def test_block_recipes_residual_bytes(recipe):
    """LayerNormMLP keeps FP8 codes and their block scales (1/128 or 1/32 of the codes, as
    float32 or E8M0) for the backward: about a quarter of BF16's bytes."""
    import mlp_memory

    r = mlp_memory.run(1024, 4096, 4096, ("gelu",), structure.BLOCK_RECIPES[recipe])
    assert r["ratio_fp8_over_bf16_per_token"] < 0.3


def test_a_block_recipe_regression_fails():
    layer = {"gemms": 0, "gemms_expected": 6, "casts": 7, "casts_expected": 6,
             "fp8_xla_transposes": 1, "fp8_xla_casts": 0, "state_updates": 0,
             "custom_calls": {"fp8jax_activation": 1, "fp8jax_layernorm_forward": 1}}  # fmt: skip
    bad = {"block": {"layers": {"dense": layer}, "residual_ratio": 0.7}}
    assert len(structure.block_failures({"block_recipes": bad})) == 6


def test_per_tensor_residual_bytes_meet_their_targets():
    """LayerNormMLP and the TransformerLayer at structure.py's sizes keep under 0.6 and 0.7 of
    BF16's residual bytes per token (tests/benchmarks/test_*_memory.py: the same at small sizes)."""
    r = {"layers": {}, "amax_all_reduces": None, "residual_ratio": structure.residual_ratios()}
    assert structure.failures(r) == [], r["residual_ratio"]
    assert set(r["residual_ratio"]) == {"layernorm_mlp", "transformer_layer"}


def test_predicted_ratios_hold_their_known_values():
    """The cost model's predicted FP8 speed-ups of the GPU-sized steps stay at their recorded
    values (``KNOWN_PREDICTED``, less the tolerance), as ``structure.py --check`` holds them:
    with XLA's attention, and with cuDNN's in every variant, fp8jax's also with fp8_dpa."""
    predicted = {name: structure.predict_steps(name) for name in structure.PREDICTED_WORKLOADS}
    predicted.update(structure.attention_predictions())
    assert structure.prediction_failures({"predicted": predicted}) == []
    assert {name for name, _ in structure.KNOWN_PREDICTED} <= set(predicted)
    cudnn = predicted["transformer_layer/cudnn"]["predicted_ms_by_kind"]
    assert "attention" not in cudnn["bf16"] and cudnn["bf16"]["cudnn_attention"] > 0
    assert cudnn["fp8_dpa"]["cudnn_attention"] < cudnn["fp8"]["cudnn_attention"]
    # (no XLA attention left: the 0.155 ms "attention" is the fused QKV kernel's FP8 transpose,
    # u8[3, 4096, 4096], which cost_model.is_scores takes for scores by its shape)
    assert cudnn["fp8_dpa"].get("attention", 0.0) < 0.2


def test_fp8_dpa_lowers_to_cudnn_fp8_attention_without_scores():
    """A TransformerLayer train step with fp8_dpa, lowered for CUDA on this machine (JAX's and
    fp8jax's device checks substituted: benchmarks/cudnn_lowering.py), calls cuDNN's FP8
    attention forward and backward and holds no [..., seq, seq] array; without fp8_dpa the same
    step calls cuDNN's BF16 attention."""
    low = structure.fp8_dpa_lowering()
    assert structure.fp8_dpa_failures({"fp8_dpa_lowering": low}) == [], low
    assert low["cudnn_calls"] == {"__cudnn$fmhaSoftmaxF8": 1, "__cudnn$fmhaSoftmaxBackwardF8": 1}
    bad = {"cudnn_calls": {}, "seq_x_seq_arrays": 2}
    assert len(structure.fp8_dpa_failures({"fp8_dpa_lowering": bad})) == 3
    bf16 = structure.fp8_dpa_lowering(fp8_dpa=False)
    assert bf16 == {"cudnn_calls": {"__cudnn$fmhaSoftmax": 1, "__cudnn$fmhaSoftmaxBackward": 1},
                    "seq_x_seq_arrays": 0}  # fmt: skip


def test_a_predicted_ratio_below_its_known_value_fails():
    """--check holds the cost model's predictions to KNOWN_PREDICTED (less the tolerance)."""
    known: dict = {}
    for (name, key), value in structure.KNOWN_PREDICTED.items():
        known.setdefault(name, {"predicted_ratios": {}})["predicted_ratios"][key] = value
    assert structure.prediction_failures({"predicted": known}) == []
    known["layernorm_mlp"]["predicted_ratios"]["fp8_vs_bf16"] = 1.0
    (bad,) = structure.prediction_failures({"predicted": known})
    assert bad.startswith("layernorm_mlp: predicted fp8_vs_bf16 1.000, known 1.474")


def test_suite_lists_and_summarises_the_benchmarks():
    import run

    names = [s.stem for s in run.scripts()]
    assert names[:4] == ["structure", "e2e", "mlp_memory", "transformer_memory"]
    assert {"gemm", "dense", "mlp", "transformer", "norm"} <= set(names)
    report = {"a": {"ratio_x": 0.5, "n": 3}, "residual_ratio": {"mlp": 0.25}, "r": [{"speedup": 2}]}
    assert run.ratios(report) == {
        "a.ratio_x": 0.5, "residual_ratio.mlp": 0.25, "r[0].speedup": 2.0,
    }  # fmt: skip
