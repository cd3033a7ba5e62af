"""fp8jax.te.jax.dense.dense against fp8jax.dense: the same output, gradients and (under
delayed scaling) state update, the state's next value coming out as its gradient (TE's
convention) instead of through a probe."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _shared import rand

import fp8jax
from fp8jax.te.common import recipe as te_recipe
from fp8jax.te.jax.cpp_extensions import CollectiveOp, CollectiveOpSet
from fp8jax.te.jax.dense import dense
from fp8jax.te.jax.quantize import QuantizerFactory, noop_quantizer_set

RECIPES = [
    te_recipe.DelayedScaling(amax_history_len=4),
    te_recipe.Float8CurrentScaling(),
    te_recipe.MXFP8BlockScaling(),
    te_recipe.Float8BlockScaling(),
]
ROLES = ("x", "kernel", "dgrad")
M, K, N = 128, 128, 128


def te_state(length: int) -> dict[str, dict[str, jax.Array]]:
    """A TE-style state with some history already in it."""
    return {
        r: {"scale": jnp.full((1,), 2.0**i), "amax_history": jnp.arange(length) + 1.0 + i}
        for i, r in enumerate(ROLES)
    }


def quantizer_set(recipe, state):
    metas = (
        None if state is None else {r: (state[r]["scale"], state[r]["amax_history"]) for r in ROLES}
    )
    return QuantizerFactory.create_set(fp8_recipe=recipe, quantize_meta_set=metas)


def te_step(recipe, x, w, b, state):
    """TE's convention: the gradient of the state is the next state."""

    def loss(x, w, b, state):
        qs = quantizer_set(recipe, state)
        y = dense(x, w, b, contracting_dims=((1,), (0,)), quantizer_set=qs)
        return jnp.sum(y * rand(y.shape, seed=3)), y

    (_, y), grads = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(x, w, b, state)
    return y, grads


def fp8jax_step(recipe, x, w, b, meta):
    probe = jnp.zeros((3,), jnp.float32)

    def loss(x, w, b, probe):
        y = fp8jax.dense(x, w, b, meta, recipe, probe=probe, dtype=x.dtype)
        return jnp.sum(y * rand(y.shape, seed=3)), y

    (_, y), (dx, dw, db, seen) = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(
        x, w, b, probe
    )
    new = fp8jax.update_fp8_meta(meta, seen, recipe) if meta is not None else None
    return y, (dx, dw, db), new


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
def test_dense_matches_fp8jax_dense(recipe):
    x, w, b = rand((M, K), 0), rand((K, N), 1, 0.1), rand((N,), 2)
    state = te_state(recipe.amax_history_len) if recipe.keeps_state else None
    meta = None
    if state is not None:
        meta = fp8jax.Fp8Meta(
            amax_history=jnp.stack([state[r]["amax_history"] for r in ROLES]),
            scale=jnp.concatenate([state[r]["scale"] for r in ROLES]),
        )
    y, (dx, dw, db, next_state) = jax.jit(te_step, static_argnums=0)(recipe, x, w, b, state)
    y_ref, (dx_ref, dw_ref, db_ref), new = jax.jit(fp8jax_step, static_argnums=0)(
        recipe, x, w, b, meta
    )
    for got, want in ((y, y_ref), (dx, dx_ref), (dw, dw_ref), (db, db_ref)):
        np.testing.assert_array_equal(got, want)
    if new is not None:
        hist = jnp.stack([next_state[r]["amax_history"] for r in ROLES])
        scale = jnp.concatenate([next_state[r]["scale"] for r in ROLES])
        np.testing.assert_array_equal(hist, new.amax_history)
        np.testing.assert_array_equal(scale, new.scale)
        assert not np.array_equal(hist, meta.amax_history)  # the state moved


def test_noop_set_is_a_plain_dense_in_the_input_dtype():
    x, w = rand((4, 8), 0).astype(jnp.bfloat16), rand((8, 3), 1)
    y = dense(x, w, quantizer_set=noop_quantizer_set)
    assert y.dtype == jnp.bfloat16
    want = jnp.dot(x, w.astype(jnp.bfloat16), preferred_element_type=jnp.float32)
    np.testing.assert_allclose(y.astype(jnp.float32), want, rtol=1e-2)


@pytest.mark.parametrize(
    "x_shape, k_shape, dims, spec",
    [
        ((2, 3, 8), (8, 5), ((2,), (0,)), "bsk,kn->bsn"),
        ((2, 3, 8), (8, 5), ((-1,), (0,)), "bsk,kn->bsn"),
        ((2, 3, 8), (5, 8), ((2,), (1,)), "bsk,nk->bsn"),
        ((2, 4, 3), (4, 3, 6), ((1, 2), (0, 1)), "bij,ijn->bn"),
    ],
)
def test_contracting_dims(x_shape, k_shape, dims, spec):
    x, w = rand(x_shape, 0), rand(k_shape, 1)
    y = dense(x, w, contracting_dims=dims)
    np.testing.assert_allclose(y, jnp.einsum(spec, x, w), rtol=1e-5, atol=1e-5)


def test_fp8_with_a_transposed_kernel_matches_the_leading_one():
    recipe = te_recipe.Float8CurrentScaling()
    x, w = rand((M, K), 0), rand((K, N), 1)
    qs = quantizer_set(recipe, None)
    y = dense(x, w.T, contracting_dims=((1,), (1,)), quantizer_set=qs)
    np.testing.assert_array_equal(y, dense(x, w, quantizer_set=qs))


def test_errors():
    x, w = rand((4, 8), 0), rand((8, 3), 1)
    with pytest.raises(ValueError, match="contracting_dims: 5 is out of range"):
        dense(x, w, contracting_dims=((5,), (0,)))
    with pytest.raises(ValueError, match="pairs 2 x dims with 1 kernel dims"):
        dense(x, w, contracting_dims=((0, 1), (0,)))
    with pytest.raises(ValueError, match="contracting_dims must be"):
        dense(x, w, contracting_dims=(1, 0, 2))
    with pytest.raises(TypeError, match="x must be a floating-point array"):
        dense(jnp.ones((4, 8), jnp.int32), w)
    with pytest.raises(TypeError, match="quantizer set 0 must be a QuantizerSet"):
        dense(x, w, quantizer_set="fp8")
    overlap = CollectiveOpSet.create(CollectiveOp.ALL_GATHER)
    with pytest.raises(NotImplementedError, match=r"collective GEMM .* all_gather"):
        dense(x, w, collective_op_set=overlap)
