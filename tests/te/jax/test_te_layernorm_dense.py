"""fp8jax.te.jax.layernorm_dense against fp8jax.layernorm_dense: the same output, gradients
and state update (the state's gradient is its next value)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _shared import rand
from _te_state import as_meta, quantizer_sets, te_states

import fp8jax
from fp8jax.te.common import recipe as te_recipe
from fp8jax.te.jax.layernorm_dense import layernorm_dense
from fp8jax.te.jax.quantize import noop_quantizer_set

RECIPES = [
    te_recipe.DelayedScaling(amax_history_len=4),
    te_recipe.Float8CurrentScaling(),
    te_recipe.MXFP8BlockScaling(),
]
M, K, N = 128, 128, 128


@pytest.mark.parametrize("norm_type", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
def test_matches_fp8jax(recipe, norm_type):
    x, w, gamma = rand((M, K), 0), rand((K, N), 1, 0.1), 1.0 + rand((K,), 2, 0.1)
    beta = rand((K,), 3, 0.1) if norm_type == "layernorm" else None
    states = te_states(recipe, 1)
    meta = as_meta(states)
    g = rand((M, N), 4)

    def te_loss(x, w, gamma, states):
        (qs,) = quantizer_sets(recipe, states, 1)
        y = layernorm_dense(x, w, gamma, beta, norm_type=norm_type, quantizer_set=qs)
        return jnp.sum(y * g), y

    def ref_loss(x, w, gamma, probe):
        y = fp8jax.layernorm_dense(x, gamma, beta, w, None, meta, recipe, probe=probe,
                                   layernorm_type=norm_type, dtype=x.dtype)  # fmt: skip
        return jnp.sum(y * g), y

    grad = jax.value_and_grad(te_loss, argnums=(0, 1, 2, 3), has_aux=True)
    (_, y), (dx, dw, dg, nxt) = jax.jit(grad)(x, w, gamma, states)
    grad_ref = jax.value_and_grad(ref_loss, argnums=(0, 1, 2, 3), has_aux=True)
    (_, y_ref), (*ref, seen) = jax.jit(grad_ref)(x, w, gamma, jnp.zeros((3,)))
    for got, want in zip((y, dx, dw, dg), (y_ref, *ref), strict=True):
        np.testing.assert_array_equal(got, want)
    if meta is not None:
        new = fp8jax.update_fp8_meta(meta, seen, recipe)
        np.testing.assert_array_equal(as_meta(nxt).amax_history, new.amax_history)
        np.testing.assert_array_equal(as_meta(nxt).scale, new.scale)


def test_noop_is_high_precision():
    x, w, gamma = rand((4, 8), 0), rand((8, 3), 1), jnp.ones(8)
    y = layernorm_dense(x, w, gamma, None, norm_type="rmsnorm", quantizer_set=noop_quantizer_set)
    rms = x / jnp.sqrt(jnp.mean(x**2, axis=-1, keepdims=True) + 1e-6)
    np.testing.assert_allclose(y, rms @ w, rtol=1e-5, atol=1e-5)


def test_errors():
    x, w, gamma = rand((4, 8), 0), rand((8, 3), 1), jnp.ones(8)
    with pytest.raises(ValueError, match="layernorm_type must be one of"):
        layernorm_dense(x, w, gamma, None, norm_type="batchnorm")
    with pytest.raises(
        TypeError, match="layernorm_dense: quantizer_set: quantizer set 0 must be a QuantizerSet"
    ):
        layernorm_dense(x, w, gamma, None, norm_type="rmsnorm", quantizer_set=None)
