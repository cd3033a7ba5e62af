"""fp8jax.te.jax.layernorm_mlp against fp8jax.layernorm_mlp: the same output, gradients and
state update of both GEMMs (rows fc1 then fc2)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _shared import rand
from _te_state import as_meta, quantizer_sets, te_states

import fp8jax
from fp8jax.te.common import recipe as te_recipe
from fp8jax.te.jax.cpp_extensions import CollectiveOp, CollectiveOpSet, noop_collective_op_set
from fp8jax.te.jax.layernorm_mlp import layernorm_mlp
from fp8jax.te.jax.quantize import QuantizerFactory, noop_quantizer_set

RECIPES = [
    te_recipe.DelayedScaling(amax_history_len=4),
    te_recipe.Float8CurrentScaling(),
    te_recipe.MXFP8BlockScaling(),
]
M, H, F = 128, 128, 256
ACTS = ("silu", "linear")


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
def test_matches_fp8jax(recipe):
    x, gamma, beta = rand((M, H), 0), 1.0 + rand((H,), 1, 0.1), rand((H,), 2, 0.1)
    k1, k2 = rand((H, 2, F), 3, 0.1), rand((F, H), 4, 0.1)
    b1, b2 = rand((2, F), 5, 0.1), rand((H,), 6, 0.1)
    states = te_states(recipe, 2)
    meta = as_meta(states)
    g = rand((M, H), 7)

    def te_loss(x, k1, k2, states):
        qs = quantizer_sets(recipe, states, 2)
        y = layernorm_mlp(x, gamma, beta, [k1, k2], [b1, b2], "layernorm",
                          activation_type=ACTS, quantizer_sets=qs)  # fmt: skip
        return jnp.sum(y * g), y

    def ref_loss(x, k1, k2, probe):
        y = fp8jax.layernorm_mlp(x, gamma, beta, k1, k2, b1, b2, meta, recipe, probe=probe,
                                 activations=ACTS, dtype=x.dtype)  # fmt: skip
        return jnp.sum(y * g), y

    grad = jax.value_and_grad(te_loss, argnums=(0, 1, 2, 3), has_aux=True)
    (_, y), (dx, dk1, dk2, nxt) = jax.jit(grad)(x, k1, k2, states)
    grad_ref = jax.value_and_grad(ref_loss, argnums=(0, 1, 2, 3), has_aux=True)
    (_, y_ref), (*ref, seen) = jax.jit(grad_ref)(x, k1, k2, jnp.zeros((6,)))
    for got, want in zip((y, dx, dk1, dk2), (y_ref, *ref), strict=True):
        np.testing.assert_array_equal(got, want)
    if meta is not None:
        new = fp8jax.update_fp8_meta(meta, seen, recipe)
        np.testing.assert_array_equal(as_meta(nxt).amax_history, new.amax_history)
        np.testing.assert_array_equal(as_meta(nxt).scale, new.scale)


def test_errors():
    x, gamma = rand((4, 8), 0), jnp.ones(8)
    k1, k2 = rand((8, 1, 16), 1), rand((16, 8), 2)
    with pytest.raises(ValueError, match="kernels must be a pair"):
        layernorm_mlp(x, gamma, None, [k1], [None, None], "rmsnorm")
    with pytest.raises(NotImplementedError, match="activation_params"):
        layernorm_mlp(x, gamma, None, [k1, k2], [None, None], "rmsnorm",
                      activation_params={"alpha": 1.0})  # fmt: skip
    with pytest.raises(TypeError, match="activation_type must name activations"):
        layernorm_mlp(x, gamma, None, [k1, k2], [None, None], "rmsnorm",
                      activation_type=(jax.nn.gelu,))  # fmt: skip
    overlap = (CollectiveOpSet.create(CollectiveOp.ALL_GATHER), noop_collective_op_set)
    with pytest.raises(NotImplementedError, match=r"collective_op_sets\[0\]"):
        layernorm_mlp(x, gamma, None, [k1, k2], [None, None], "rmsnorm",
                      collective_op_sets=overlap)  # fmt: skip
    mixed = (QuantizerFactory.create_set(fp8_recipe=te_recipe.MXFP8BlockScaling()),
             noop_quantizer_set)  # fmt: skip
    with pytest.raises(ValueError, match="must all use one recipe"):
        layernorm_mlp(x, gamma, None, [k1, k2], [None, None], "rmsnorm", quantizer_sets=mixed)
