"""The functional layers under explicit sharding (``AxisType.Explicit``, ``jax.make_mesh``'s
default), on 8 emulated devices: a ``custom_vjp`` cotangent must have its primal's type, sharding
included, while a GEMM picks its output's split from its operands'. The layer core
(``fp8jax/functional/_core.py``, ``layer_vjp``) reshards every gradient to its primal's
sharding, for every layer built from it; before, only ``dense`` did, and ``layernorm_dense`` and
``layernorm_mlp`` with a split contracted dim or an FSDP-sharded kernel failed with a custom_vjp
type error. The gradients equal the one-device ones (the FP8 casts are the same, with global
amaxes; a split K sums in another order).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _shared import make_mesh, rand
from conftest import needs_devices
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import fp8jax

N_DEVICES = 8
pytestmark = needs_devices(N_DEVICES)

HIDDEN, ROWS, OUT = 32, 16, 24

# name: (x spec, the kernel's spec)
LAYOUTS = {
    "row_parallel": (P("data", "model"), P("model", None)),  # K split: a psum in the GEMM
    "fsdp": (P("data", None), P("data", None)),  # the kernel is gathered
}


def _meta(recipe, n_roles):
    return (
        fp8jax.init_fp8_meta(recipe, n_roles) if isinstance(recipe, fp8jax.DelayedScaling) else None
    )


def _layer(name, recipe):
    """``(loss(x, params, probe), params, n_roles)``."""
    w, b = rand((HIDDEN, OUT), 1, 0.3), rand((OUT,), 2)
    gamma, beta = jnp.ones(HIDDEN), jnp.zeros(HIDDEN)
    if name == "dense":
        meta = _meta(recipe, 3)

        def dense(x, p, probe):
            return fp8jax.dense(x, *p, meta, recipe, probe=probe)

        return dense, (w, b), 3
    if name == "layernorm_dense":
        meta = _meta(recipe, 3)

        def ln_dense(x, p, probe):
            return fp8jax.layernorm_dense(x, *p, meta, recipe, probe=probe)

        return ln_dense, (gamma, beta, w, b), 3
    w1, w2, meta = rand((HIDDEN, 1, 40), 3, 0.3), rand((40, OUT), 4, 0.3), _meta(recipe, 6)

    def mlp(x, p, probe):
        g, bt, k1, k2, b2 = p
        return fp8jax.layernorm_mlp(x, g, bt, k1, k2, None, b2, meta, recipe, probe=probe)

    return mlp, (gamma, beta, w1, w2, b), 6


def _specs(name, layout):
    """The specs of ``x`` and the params: a norm's input keeps its hidden dim whole."""
    x_spec, w_spec = LAYOUTS[layout]
    if name == "dense":
        return x_spec, (w_spec, P(w_spec[1]))
    x_spec = P(x_spec[0], None)
    if name == "layernorm_dense":
        return x_spec, (P(), P(), w_spec, P(w_spec[1]))
    return x_spec, (P(), P(), P(w_spec[0], None, None), P(), P())


RECIPES = {
    "delayed": fp8jax.DelayedScaling(amax_history_len=4),
    "current": fp8jax.Float8CurrentScaling(),
}


@pytest.mark.parametrize("recipe", list(RECIPES))
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", ["dense", "layernorm_dense", "layernorm_mlp"])
def test_explicit_sharding_gradients_have_their_primals_shardings(name, layout, recipe):
    fn, params, n_roles = _layer(name, RECIPES[recipe])
    x = rand((ROWS, HIDDEN), 0)

    def grads(x, params):
        def loss(x, params, probe):
            return jnp.sum(fn(x, params, probe) ** 2)

        g = jax.grad(loss, argnums=(0, 1, 2))(x, params, jnp.zeros(n_roles, jnp.float32))
        for d, p in zip(jax.tree.leaves(g[:2]), jax.tree.leaves((x, params)), strict=True):
            assert jax.typeof(d).sharding == jax.typeof(p).sharding
        return g

    want = jax.jit(grads)(x, params)
    mesh = make_mesh(explicit=True)
    x_spec, p_specs = _specs(name, layout)
    with jax.set_mesh(mesh):
        put = lambda v, s: jax.device_put(v, NamedSharding(mesh, s))
        args = (put(x, x_spec), tuple(map(put, params, p_specs)))
        got = jax.jit(grads)(*args)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        # the same FP8 casts (global amaxes); the GEMMs sum in another order when K is split
        scale = float(jnp.max(jnp.abs(w)))
        np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=0, atol=1e-5 * scale)
