"""A block-scaled split that is not whole blocks is fp8jax's error, wherever it is split (issue
35): M, N or K of a dense layer, its forward, gradient only and value with gradient, on 1-D and
2-D meshes, under automatic and explicit sharding.

Where the sharding is part of the types (``AxisType.Explicit``) the ValueError comes at trace
time. Under automatic axes the sharding of an intermediate is known only to XLA's partitioner,
which calls back into fp8jax while compiling; the same message then reaches the user inside
XLA's compile error, a :class:`jax.errors.JaxRuntimeError` (docs/numerics.md, "Block scaling
on a mesh"). JAX's own ``IndivisibleError`` about sub-axes must never be what the user sees.
Whole-block splits under explicit sharding equal one device."""

from __future__ import annotations

import re

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

BLOCK = fp8jax.Float8BlockScaling()
MXFP8 = fp8jax.MXFP8BlockScaling()


def _mesh(kind: str, explicit: bool = False):
    """The mesh (``"1d"``: 8 devices on "data"; ``"2d"``: 2 x 4) and its axis names."""
    mesh = make_mesh("8" if kind == "1d" else "2x4", explicit=explicit)
    return mesh, tuple(mesh.axis_names)


# dim: (x shape, w shape, which operand is split and how, the op's dim in the message, block)
SPLITS = {
    # M: 256 rows over 8 devices (32 each); the transposed copy's 1 x 128 blocks run down M
    "M": ((256, 128), (128, 128), "x", 0, r"dim -2 of x \(size 256\) is split 8 ways", 128),
    # K: 512 over 8 devices (64 each), half a 128 block
    "K": ((64, 512), (512, 128), "both", None, r"dim -1 of x \(size 512\) is split 8 ways", 128),
    # N: the weight's 256 columns over 8 devices (32 each), a quarter of a 128 x 128 block
    "N": ((128, 128), (128, 256), "w", 1, r"dim -1 of x \(size 256\) is split 8 ways", 128),
}


def _specs(dim: str, names: tuple[str, ...]):
    axes = names if len(names) > 1 else names[0]
    if dim == "M":
        return P(axes, None), P()
    if dim == "K":
        return P(None, axes), P(axes, None)
    return P(), P(None, axes)


def _fn(mode: str, recipe):
    def fwd(x, w):
        return fp8jax.dense(x, w, recipe=recipe, enabled=True)

    def loss(x, w):
        return jnp.sum(jnp.sin(fwd(x, w)))

    return {"forward": fwd, "grad": jax.grad(loss, (0, 1)),
            "value_and_grad": jax.value_and_grad(loss, (0, 1))}[mode]  # fmt: skip


def _args(dim, mesh, names):
    xs, ws = SPLITS[dim][:2]
    x_spec, w_spec = _specs(dim, names)
    x = jax.device_put(rand(xs, 1), NamedSharding(mesh, x_spec))
    w = jax.device_put(rand(ws, 2) * 0.05, NamedSharding(mesh, w_spec))
    return x, w


def _message(dim, names, block=128):
    axes = tuple(names)
    return (rf"block_cast_transpose: {SPLITS[dim][4]} \(mesh axes {re.escape(str(axes))}\).*"
            rf"not a multiple of the block \({block}\).*straddle")  # fmt: skip


@pytest.mark.parametrize("mode", ["forward", "grad", "value_and_grad"])
@pytest.mark.parametrize("dim", list(SPLITS))
def test_automatic_axes_give_fp8jax_message_from_the_partitioner(dim, mode):
    mesh, names = _mesh("1d")
    x, w = _args(dim, mesh, names)
    with pytest.raises(jax.errors.JaxRuntimeError, match=_message(dim, names)) as info:
        jax.jit(_fn(mode, BLOCK))(x, w)
    assert "IndivisibleError" not in str(info.value)


@pytest.mark.parametrize("dim", list(SPLITS))
def test_a_two_dim_mesh_names_both_axes(dim):
    mesh, names = _mesh("2d")
    x, w = _args(dim, mesh, names)
    with pytest.raises(jax.errors.JaxRuntimeError, match=_message(dim, names)):
        jax.jit(_fn("value_and_grad", BLOCK))(x, w)


def test_mxfp8_k_split_into_part_blocks():
    """K = 128 over 8 devices: 16 a device, half an MXFP8 block of 32."""
    mesh, _ = _mesh("1d")
    x = jax.device_put(rand((64, 128), 1), NamedSharding(mesh, P(None, "data")))
    w = jax.device_put(rand((128, 128), 2) * 0.05, NamedSharding(mesh, P("data", None)))
    match = r"dim -1 of x \(size 128\) is split 8 ways .*not a multiple of the block \(32\)"
    with pytest.raises(jax.errors.JaxRuntimeError, match=match):
        jax.jit(_fn("forward", MXFP8))(x, w)


def test_a_sharding_constraint_inside_the_function():
    """The split comes from ``with_sharding_constraint`` on a replicated argument."""
    mesh, names = _mesh("1d")

    def fn(x, w):
        x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P(None, "data")))
        return fp8jax.dense(x, w, recipe=BLOCK, enabled=True)

    with pytest.raises(jax.errors.JaxRuntimeError, match=_message("K", names)):
        jax.jit(fn)(rand((64, 512), 1), rand((512, 128), 2))


@pytest.mark.parametrize("mode", ["forward", "grad", "value_and_grad"])
@pytest.mark.parametrize("dim", list(SPLITS))
@pytest.mark.parametrize("kind", ["1d", "2d"])
def test_explicit_axes_give_the_value_error_at_trace_time(kind, dim, mode):
    mesh, names = _mesh(kind, explicit=True)
    with jax.set_mesh(mesh):
        x, w = _args(dim, mesh, names)
        with pytest.raises(ValueError, match=_message(dim, names)):
            jax.jit(_fn(mode, BLOCK)).trace(x, w)  # no compile: refused while tracing


@pytest.mark.parametrize("recipe", [BLOCK, MXFP8], ids=["block", "mxfp8"])
def test_whole_block_splits_under_explicit_axes_equal_one_device(recipe):
    """Rows over "data" (512 a device), N and K over "model" (128 a device): whole blocks."""
    mesh, _ = _mesh("2d", explicit=True)
    x, w = rand((1024, 512), 1), rand((512, 512), 2) * 0.05
    want = jax.jit(_fn("value_and_grad", recipe))(x, w)
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P("data", "model")))
        ws = jax.device_put(w, NamedSharding(mesh, P("model", None)))
        got = jax.jit(_fn("value_and_grad", recipe))(xs, ws)
    for g, c in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        scale = float(jnp.max(jnp.abs(c))) or 1.0
        np.testing.assert_allclose(np.asarray(g), np.asarray(c), rtol=0, atol=1e-5 * scale)
