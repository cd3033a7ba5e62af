"""Float8RowwiseScaling on 8 emulated devices (automatic axes; the reference path, issue 49):
``layernorm_mlp`` (forward and every gradient) under data, tensor (column- then row-parallel),
fully-sharded and sequence layouts equals the one-device result within float32 summation order.
The row-wise casts and GEMMs are ``jnp`` definitions that XLA partitions: a row amax over a
split dim is a max all-reduce (exact), a split contraction a sum. Explicit axes are not covered
yet for the layers. The row-wise cast's kernel (``fp8jax_rowwise_quantize``) on its own: rows
split freely with no collective, a split K gathered first, the one-device bits either way
(automatic and explicit axes)."""

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
from fp8jax.ops.block import rowwise as rw

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


# x [64, 96] specs on a ("data", "model") = (2, 4) mesh: whether K (the rows' length) is split
CAST_SPLITS = {
    "rows-data": (P("data", None), False),
    "rows-all": (P(("data", "model"), None), False),
    "k-model": (P(None, "model"), True),
    "rows-and-k": (P("data", "model"), True),
}
_COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")


def _cast_bits(out):
    return [np.asarray(a).view(np.uint8) for a in out]


@pytest.mark.parametrize("split", list(CAST_SPLITS))
def test_rowwise_quantize_kernel_split(split):
    """Each device casts its own rows (their scales stay with them: scale_inv is split like the
    rows, no collective); a split K is gathered before the kernel (an all-gather, no
    all-reduce). Either way every output has the one-device bits."""
    spec, k_split = CAST_SPLITS[split]
    x = rand((64, 96), 5).astype(jnp.bfloat16) * jnp.exp2(jnp.arange(64.0)[:, None] % 9)
    f = jax.jit(lambda a: rw.rowwise_quantize(a, jnp.float8_e4m3fn, implementation="kernel"))
    want = f(jax.device_put(x, jax.devices()[0]))
    xs = jax.device_put(x, NamedSharding(make_mesh(), spec))
    got = f(xs)
    for g, w in zip(_cast_bits(got), _cast_bits(want), strict=True):
        np.testing.assert_array_equal(g, w)
    hlo = f.lower(xs).compile().as_text()
    assert 'custom_call_target="fp8jax_rowwise_quantize"' in hlo
    found = {c for c in _COLLECTIVES if c in hlo}
    assert found == ({"all-gather"} if k_split else set()), found
    if not k_split:  # the rows' split, kept by q and scale_inv
        for out in got:
            assert out.sharding.spec[0] == spec[0]


@pytest.mark.parametrize("spec", [P("data", None), P("data", "model")], ids=["rows", "rows-k"])
def test_rowwise_quantize_kernel_explicit_axes(spec):
    """Under explicit axes the outputs' types carry x's split: q like x, scale_inv [M, 1] like
    x's rows (a split K is gathered inside the op, q keeps x's type)."""
    mesh = make_mesh(explicit=True)
    x = rand((64, 40), 6)
    want = rw.rowwise_quantize(x, jnp.float8_e5m2)
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, spec))
        q, s = jax.jit(lambda a: rw.rowwise_quantize(a, jnp.float8_e5m2))(xs)
        assert jax.typeof(s).sharding.spec == P("data", None)
        assert jax.typeof(q).sharding.spec == spec
    for g, w in zip(_cast_bits((q, s)), _cast_bits(want), strict=True):
        np.testing.assert_array_equal(g, w)
