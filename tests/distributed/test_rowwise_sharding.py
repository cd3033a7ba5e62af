"""Float8RowwiseScaling on 8 emulated devices (automatic axes; the reference path, issue 49):
``layernorm_mlp`` (forward and every gradient) under data, tensor (column- then row-parallel),
fully-sharded and sequence layouts equals the one-device result within float32 summation order.
The row-wise casts and GEMMs are ``jnp`` definitions that XLA partitions: a row amax over a
split dim is a max all-reduce (exact), a split contraction a sum. Under explicit axes
(``jax.make_mesh``), ``dense`` with FSDP; the layers and the MoE block on both kinds of mesh
are in the mesh matrix (tests/distributed/_matrix.py, ``ROWWISE_CASES``)."""

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

pytestmark = needs_devices(8)

ROWS, HIDDEN, MLP = 256, 128, 256
RECIPES = {
    "rowwise": fp8jax.Float8RowwiseScaling(),
    "hp-wgrad": fp8jax.Float8RowwiseScaling(wgrad_high_precision=True),
}
# name: (x, w1 (hidden, 1, mlp), w2 (mlp, hidden)) specs on a ("data", "model") = (2, 4) mesh
LAYOUTS = {
    "data": (P("data", None), P(), P()),
    "tensor": (P("data", None), P(None, None, "model"), P("model", None)),  # K of GEMM 2 split
    "fsdp": (P("data", None), P("data", None, None), P("data", None)),
    "sequence": (P(("data", "model"), None), P(), P()),  # rows (tokens) over every device
}


def _loss(recipe):
    def loss(x, gamma, w1, w2):
        y = fp8jax.layernorm_mlp(x, gamma, None, w1, w2, layernorm_type="rmsnorm", recipe=recipe)
        return jnp.sum(y * jnp.sin(y))

    return jax.value_and_grad(loss, (0, 1, 2, 3))


def _args():
    return (rand((ROWS, HIDDEN), 1), 1 + 0.1 * rand((HIDDEN,), 2), rand((HIDDEN, 1, MLP), 3) * 0.06,
            rand((MLP, HIDDEN), 4) * 0.04)  # fmt: skip


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", list(RECIPES))
def test_sharded_equals_one_device(name, layout):
    recipe = RECIPES[name]
    one = jax.jit(_loss(recipe))(*_args())
    mesh = make_mesh()
    xs, w1s, w2s = LAYOUTS[layout]
    shard = [NamedSharding(mesh, s) for s in (xs, P(), w1s, w2s)]
    fn = jax.jit(_loss(recipe), in_shardings=shard)
    got = fn(*[jax.device_put(a, s) for a, s in zip(_args(), shard, strict=True)])
    for a, c in zip(jax.tree.leaves(got), jax.tree.leaves(one), strict=True):
        scale = float(jnp.max(jnp.abs(c))) or 1.0
        np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=0, atol=1e-5 * scale)


@pytest.mark.parametrize("name", list(RECIPES))
def test_explicit_axes_fsdp_dense_equals_one_device(name):
    """``jax.make_mesh``'s explicit axes, the tokens and the kernel's K both over ``data``
    (FSDP): the dgrad's scales (rows of the output gradient and of the kernel, both split
    over ``data``) are resharded as the output's rows and columns, and the high-precision
    wgrad's dot contracts the split tokens with its ``out_sharding`` stated (without it JAX
    refuses the dot as ambiguous)."""
    recipe = RECIPES[name]
    x, w = rand((ROWS, HIDDEN), 5), rand((HIDDEN, MLP), 6) * 0.06

    def loss(x, w):
        y = fp8jax.dense(x, w, recipe=recipe)
        return jnp.sum(y * jnp.sin(y))

    grad = jax.jit(jax.value_and_grad(loss, (0, 1)))
    one = grad(x, w)
    mesh = make_mesh(explicit=True)
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P("data", None)))
        ws = jax.device_put(w, NamedSharding(mesh, P("data", "model")))
        got = grad(xs, ws)
    assert jax.typeof(got[1][1]).sharding.spec == P("data", "model")
    for a, c in zip(jax.tree.leaves(got), jax.tree.leaves(one), strict=True):
        scale = float(jnp.max(jnp.abs(c))) or 1.0
        np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=0, atol=1e-5 * scale)
