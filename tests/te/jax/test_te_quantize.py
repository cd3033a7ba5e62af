"""fp8jax.te.jax.quantize: quantizer sets from recipes, the no-op set, scaling modes, errors."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest

from fp8jax.recipe import E4M3, E5M2
from fp8jax.te.common import recipe as te_recipe
from fp8jax.te.jax.quantize import (
    QuantizerFactory,
    QuantizerSet,
    ScalingMode,
    gemm_inputs,
    noop_quantizer_set,
)

MODES = [
    (te_recipe.DelayedScaling(), ScalingMode.DELAYED_TENSOR_SCALING),
    (te_recipe.Float8CurrentScaling(), ScalingMode.CURRENT_TENSOR_SCALING),
    (te_recipe.MXFP8BlockScaling(), ScalingMode.MXFP8_1D_SCALING),
    (te_recipe.Float8BlockScaling(), ScalingMode.FLOAT8_BLOCK_SCALING),
]


def _metas(length=1024):
    return {r: (jnp.ones((1,)), jnp.zeros((length,))) for r in ("x", "kernel", "dgrad")}


@pytest.mark.parametrize("recipe, mode", MODES, ids=lambda v: type(v).__name__)
def test_the_set_says_its_mode_and_dtypes(recipe, mode):
    metas = _metas() if recipe.keeps_state else None
    qs = QuantizerFactory.create_set(fp8_recipe=recipe, quantize_meta_set=metas)
    assert isinstance(qs, QuantizerSet) and not qs.is_noop and qs.recipe is recipe
    assert {q.scaling_mode for q in (qs.x, qs.kernel, qs.dgrad)} == {mode}
    assert qs.x.q_dtype == qs.kernel.q_dtype == E4M3
    assert qs.dgrad.q_dtype == recipe.bwd_dtype
    assert mode.is_tensor_scaling is recipe.per_tensor
    assert len(jax.tree.leaves(qs)) == (6 if recipe.keeps_state else 0)


def test_hybrid_grad_is_e5m2_and_several_sets():
    sets = QuantizerFactory.create_set(2, fp8_recipe=te_recipe.Float8CurrentScaling())
    assert len(sets) == 2 and sets[0].dgrad.q_dtype == E5M2


def test_noop():
    assert noop_quantizer_set.is_noop and noop_quantizer_set.recipe is None
    assert QuantizerFactory.create_set(scaling_mode=ScalingMode.NO_SCALING).is_noop
    assert gemm_inputs((noop_quantizer_set,), "f").enabled is False


def test_errors():
    with pytest.raises(NotImplementedError, match=r"NVFP4BlockScaling .* not implemented"):
        QuantizerFactory.create_set(fp8_recipe=te_recipe.NVFP4BlockScaling())
    with pytest.raises(NotImplementedError, match="n_groups"):
        QuantizerFactory.create_set(fp8_recipe=te_recipe.MXFP8BlockScaling(), n_groups=4)
    with pytest.raises(NotImplementedError, match="pass fp8_recipe instead"):
        QuantizerFactory.create_set(scaling_mode=ScalingMode.MXFP8_1D_SCALING)
    with pytest.raises(ValueError, match="n_quantizer_sets must be a positive int"):
        QuantizerFactory.create_set(0)
    with pytest.raises(ValueError, match="delayed scaling needs quantize_meta_set"):
        QuantizerFactory.create_set(fp8_recipe=te_recipe.DelayedScaling())
    with pytest.raises(TypeError, match="fp8_recipe"):
        QuantizerFactory.create_set(fp8_recipe="delayed")
    mixed = (
        QuantizerFactory.create_set(fp8_recipe=te_recipe.MXFP8BlockScaling()),
        noop_quantizer_set,
    )
    with pytest.raises(ValueError, match="f: the quantizer sets must all use one recipe"):
        gemm_inputs(mixed, "f")
    short = QuantizerFactory.create_set(
        fp8_recipe=te_recipe.DelayedScaling(amax_history_len=4), quantize_meta_set=_metas(8)
    )
    with pytest.raises(ValueError, match=r"amax_history has length 8.*amax_history_len=4"):
        gemm_inputs((short,), "f")
