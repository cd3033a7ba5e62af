"""fp8jax.te.common.recipe: TE's recipe classes, fields and defaults; the ones fp8jax lacks
exist and refuse on use; MaxText's recipe table builds."""

from __future__ import annotations

import dataclasses
import functools

import pytest

import fp8jax
from fp8jax.te.common import recipe

TE_DEFAULTS = {
    "DelayedScaling": {
        "margin": 0, "fp8_format": recipe.Format.HYBRID, "amax_history_len": 1024,
        "amax_compute_algo": "max", "scaling_factor_compute_algo": None, "reduce_amax": True,
        "fp8_dpa": False, "fp8_mha": False, "backward_override": None,
    },
    "Float8CurrentScaling": {
        "use_power_2_scales": False, "fp8_format": recipe.Format.HYBRID,
        "fp8_quant_fwd_inp": recipe.QParams(), "fp8_gemm_fprop": recipe.MMParams(
            use_split_accumulator=False), "fp8_gemm_dgrad": recipe.MMParams(),
        "fp8_gemm_wgrad": recipe.MMParams(), "fp8_dpa": False, "fp8_mha": False,
        "backward_override": None,
    },
    "MXFP8BlockScaling": {
        "margin": 0, "fp8_format": recipe.Format.E4M3, "fp8_dpa": False, "fp8_mha": False,
        "backward_override": None, "enable_2d_quantization": False,
    },
    "Float8BlockScaling": {
        "use_f32_scales": False, "fp8_format": recipe.Format.E4M3, "x_block_scaling_dim": 1,
        "w_block_scaling_dim": 2, "grad_block_scaling_dim": 1, "fp8_dpa": False,
        "fp8_mha": False, "backward_override": None,
    },
    "NVFP4BlockScaling": {
        "disable_rht": False, "disable_stochastic_rounding": False,
        "disable_2d_quantization": False, "fp4_format": "E2M1",
        "fp8_format": recipe.Format.E4M3, "fp8_dpa": False, "fp8_mha": False,
    },
}  # fmt: skip


@pytest.mark.parametrize("name", sorted(TE_DEFAULTS))
def test_te_fields_and_defaults(name):
    built = getattr(recipe, name)()
    for field, default in TE_DEFAULTS[name].items():
        assert getattr(built, field) == default, field


def test_implemented_recipes_are_fp8jax_recipes():
    assert recipe.DelayedScaling is fp8jax.DelayedScaling
    assert recipe.MXFP8BlockScaling is fp8jax.MXFP8BlockScaling
    assert issubclass(recipe.Float8CurrentScaling, fp8jax.Float8CurrentScaling)
    current = recipe.Float8CurrentScaling(fp8_format=recipe.Format.E4M3)
    assert recipe.fp8jax_recipe(current, "r") is current and current.keeps_state is False
    assert hash(current) == hash(recipe.Float8CurrentScaling(fp8_format=recipe.Format.E4M3))


def test_maxtext_recipe_table_builds():
    """MaxText's table (layers/quantizations.py): every entry is built when named."""
    table = {
        "te_fp8_delayedscaling": recipe.DelayedScaling,
        "te_fp8_currentscaling": recipe.Float8CurrentScaling,
        "te_mxfp8": recipe.MXFP8BlockScaling,
        "te_nvfp4": recipe.NVFP4BlockScaling,
        "te_nvfp4_no_rht": functools.partial(recipe.NVFP4BlockScaling, disable_rht=True),
    }
    built = {k: v() for k, v in table.items()}
    assert built["te_nvfp4_no_rht"].disable_rht is True
    assert {hash(r) for r in built.values()}  # hashable: MaxText hashes its recipe


@pytest.mark.parametrize("cls", [recipe.NVFP4BlockScaling, recipe.CustomRecipe])
def test_unimplemented_recipes_refuse_on_use(cls):
    with pytest.raises(NotImplementedError, match=rf"fp8_recipe: {cls.__name__} .* not implem"):
        recipe.fp8jax_recipe(cls(), "fp8_recipe")
    with pytest.raises(TypeError, match="autocast"):
        with fp8jax.autocast(enabled=True, recipe=cls()):
            pass


@pytest.mark.parametrize(
    "field, value",
    [
        ("use_power_2_scales", True),
        ("fp8_quant_fwd_inp", recipe.QParams(amax_epsilon=1e-3)),
        ("fp8_quant_bwd_grad", recipe.QParams(power_2_scale=True)),
        ("fp8_gemm_fprop", recipe.MMParams(use_split_accumulator=True)),
        ("fp8_gemm_wgrad", recipe.MMParams(use_split_accumulator=False)),
        ("fp8_dpa", True),
        ("fp8_mha", 1),
    ],
)
def test_current_scaling_refuses_what_fp8jax_does_not_compute(field, value):
    with pytest.raises(ValueError, match=rf"Float8CurrentScaling\.{field}=.* is not supported"):
        recipe.Float8CurrentScaling(**{field: value})


def test_not_a_recipe():
    with pytest.raises(TypeError, match="fp8_recipe"):
        recipe.fp8jax_recipe("delayed", "fp8_recipe")
    assert dataclasses.is_dataclass(recipe.NVFP4BlockScaling)
