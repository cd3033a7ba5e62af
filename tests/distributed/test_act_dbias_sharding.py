"""cast_transpose_dbias and the activation ops on a device mesh (8 emulated CPU devices).

Rows and columns split: every device works on its block; nothing is gathered; ``amax`` is made
global by one all-reduce over the axes that split the tensor and ``dbias`` by one over the axes
that split its rows (none when only columns are split). Outputs other than a row-summed ``dbias``
are bit-identical to the single-device call; a ``dbias`` summed over devices is within the
float32 bound of its sum (a different, still fixed, order).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _hlo import all_reduce_group_sizes, count
from _shared import make_mesh, normal
from conftest import needs_devices
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from fp8jax import ops

pytestmark = needs_devices(8)
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2

# (rows axes, cols axes) of a [m, n] tensor on a 2 x 4 mesh.
SPLITS = [
    ("data", None),
    (None, "model"),
    ("data", "model"),
    (("data", "model"), None),
    (None, None),
]


def _size(mesh, axes) -> int:
    if axes is None:
        return 1
    axes = (axes,) if isinstance(axes, str) else axes
    return math.prod(mesh.shape[a] for a in axes)


def _one(x):
    return jax.device_put(x, jax.devices()[0])


def _same(got, want) -> None:
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.tobytes() == want.tobytes()


def _close(got, want, terms) -> None:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    tol = 4 * terms * float(np.finfo(np.float32).eps) * (np.abs(want) + 1.0)
    assert (np.abs(got - want) <= tol).all()


def _hlo(f, *args) -> str:
    return jax.jit(f).lower(*args).compile().as_text()


def _no_gathers(hlo) -> None:
    for op in ("all-gather", "all-to-all", "collective-permute", "reduce-scatter"):
        assert count(hlo, op) == 0, f"unexpected {op}"


def _expected_all_reduces(mesh, rows, cols) -> list[int]:
    """amax over the devices that split the tensor; dbias over those that split its rows."""
    whole = _size(mesh, rows) * _size(mesh, cols)
    return sorted(s for s in (whole, _size(mesh, rows)) if s > 1)


def _data(shape, dtype, seed):
    # the largest magnitude, in the last device's block
    return normal(seed, shape, dtype, 4.0).at[(-1,) * len(shape)].set(-30.0)


@pytest.mark.parametrize("split", SPLITS, ids=str)
@pytest.mark.parametrize("implementation", ["kernel", "xla"])
def test_cast_transpose_dbias_sharded(split, implementation):
    mesh, (rows, cols) = make_mesh(), split
    g = _data((32, 64), jnp.bfloat16, 1)
    scale = jnp.float32(2.0)
    with ops.implementation(implementation):
        want = ops.cast_transpose_dbias(_one(g), scale, E5M2)
        gs = jax.device_put(g, NamedSharding(mesh, P(rows, cols)))
        f = lambda g, s: ops.cast_transpose_dbias(g, s, E5M2)
        got = jax.jit(f)(gs, scale)
        hlo = _hlo(f, gs, scale)
    for o, w in zip(got[:4], want[:4], strict=True):
        _same(o, w)
    assert got[1].sharding.is_equivalent_to(NamedSharding(mesh, P(cols, rows)), 2)
    assert got[4].sharding.is_equivalent_to(NamedSharding(mesh, P(cols)), 1)
    if _size(mesh, rows) == 1:
        _same(got[4], want[4])
    else:
        _close(got[4], want[4], 32)
    _no_gathers(hlo)
    if implementation == "kernel":
        assert sorted(all_reduce_group_sizes(hlo)) == _expected_all_reduces(mesh, rows, cols)


@pytest.mark.parametrize("split", SPLITS, ids=str)
@pytest.mark.parametrize("implementation", ["kernel", "xla"])
def test_activation_cast_transpose_sharded(split, implementation):
    mesh, (rows, cols) = make_mesh(), split
    acts = ("gelu", "linear")
    x = _data((32, 2, 64), jnp.bfloat16, 2)
    scale = jnp.float32(0.5)
    with ops.implementation(implementation):
        want = ops.activation_cast_transpose(_one(x), scale, E4M3, acts)
        want_y = ops.activation(_one(x), acts)
        xs = jax.device_put(x, NamedSharding(mesh, P(rows, None, cols)))
        f = lambda x, s: ops.activation_cast_transpose(x, s, E4M3, acts)
        got = jax.jit(f)(xs, scale)
        y = jax.jit(lambda x: ops.activation(x, acts))(xs)
        hlo = _hlo(f, xs, scale)
    for o, w in zip(got, want, strict=True):
        _same(o, w)
    _same(y, want_y)
    assert got[0].sharding.is_equivalent_to(NamedSharding(mesh, P(rows, cols)), 2)
    assert got[1].sharding.is_equivalent_to(NamedSharding(mesh, P(cols, rows)), 2)
    _no_gathers(hlo)
    if implementation == "kernel":
        whole = _size(mesh, rows) * _size(mesh, cols)
        assert all_reduce_group_sizes(hlo) == ([whole] if whole > 1 else []), hlo


@pytest.mark.parametrize("split", SPLITS, ids=str)
@pytest.mark.parametrize("implementation", ["kernel", "xla"])
def test_dactivation_cast_transpose_dbias_sharded(split, implementation):
    mesh, (rows, cols) = make_mesh(), split
    acts = ("silu", "linear")
    x = _data((32, 2, 64), jnp.float32, 3)
    g = _data((32, 64), jnp.float32, 4)
    scale = jnp.float32(1.5)
    with ops.implementation(implementation):
        want = ops.dactivation_cast_transpose_dbias(_one(g), _one(x), scale, E5M2, acts)
        want_dx = ops.dactivation(_one(g), _one(x), acts)
        gs = jax.device_put(g, NamedSharding(mesh, P(rows, cols)))
        xs = jax.device_put(x, NamedSharding(mesh, P(rows, None, cols)))
        f = lambda g, x, s: ops.dactivation_cast_transpose_dbias(g, x, s, E5M2, acts)
        got = jax.jit(f)(gs, xs, scale)
        dx = jax.jit(lambda g, x: ops.dactivation(g, x, acts))(gs, xs)
        hlo = _hlo(f, gs, xs, scale)
    for o, w in zip(got[:4], want[:4], strict=True):
        _same(o, w)
    _same(dx, want_dx)
    assert got[1].sharding.is_equivalent_to(NamedSharding(mesh, P(None, cols, rows)), 3)
    assert got[4].sharding.is_equivalent_to(NamedSharding(mesh, P(None, cols)), 2)
    if _size(mesh, rows) == 1 and implementation == "kernel":
        _same(got[4], want[4])
    else:
        _close(got[4], want[4], 32)
    _no_gathers(hlo)
    if implementation == "kernel":
        assert sorted(all_reduce_group_sizes(hlo)) == _expected_all_reduces(mesh, rows, cols)


def test_explicit_sharding_mode():
    """Under explicit axes (shardings are part of the types) every output of a shape other
    than an operand's (y, q_t of [k, n, m], dbias) gets its sharding from the right dims."""
    mesh = make_mesh(explicit=True)  # skips on a JAX without explicit sharding
    acts = ("gelu", "linear")
    x = _data((32, 2, 64), jnp.float32, 5)
    g = _data((32, 64), jnp.float32, 6)
    s = jnp.float32(1.0)
    want_ct = ops.cast_transpose_dbias(_one(g), s, E5M2)
    want_act = ops.activation_cast_transpose(_one(x), s, E4M3, acts)
    want_dact = ops.dactivation_cast_transpose_dbias(_one(g), _one(x), s, E5M2, acts)
    with jax.set_mesh(mesh):
        gs = jax.device_put(g, P("data", "model"))
        xs = jax.device_put(x, P("data", None, "model"))
        ct = jax.jit(lambda g: ops.cast_transpose_dbias(g, s, E5M2))(gs)
        act = jax.jit(lambda x: ops.activation_cast_transpose(x, s, E4M3, acts))(xs)
        dact = jax.jit(lambda g, x: ops.dactivation_cast_transpose_dbias(g, x, s, E5M2, acts))(
            gs, xs
        )
    for got, want in [(ct, want_ct), (act, want_act), (dact, want_dact)]:
        for a, b in zip(got[:4], want[:4], strict=True):
            _same(a, b)
    _close(ct[4], want_ct[4], 32)
    _close(dact[4], want_dact[4], 32)
    assert ct[1].sharding.spec == P("model", "data")
    assert ct[4].sharding.spec == P("model")
    assert act[0].sharding.spec == P("data", "model")
    assert act[1].sharding.spec == P("model", "data")
    assert tuple(dact[1].sharding.spec) == (None, "model", "data")
    assert tuple(dact[4].sharding.spec) == (None, "model")


@pytest.mark.parametrize("split", SPLITS, ids=str)
@pytest.mark.parametrize("implementation", ["kernel", "xla"])
def test_grouped_cast_transpose_dbias_sharded(split, implementation):
    """``g[m, 3, n]`` (a fused QKV projection's output gradient) split on ``m`` and/or ``n``:
    the same bits as on one device, no gather (each device runs the 2-D kernel on its
    ``[m_local, 3 * n_local]`` view), dbias summed over the axes that split ``m``."""
    from fp8jax.ops.casts.cast_transpose import grouped_cast_transpose_dbias

    mesh, (rows, cols) = make_mesh(), split
    g = _data((32, 3, 64), jnp.bfloat16, 3)
    scale = jnp.float32(2.0)
    f = lambda g, s: grouped_cast_transpose_dbias(g, s, E5M2, implementation=implementation)
    want = f(_one(g), scale)
    gs = jax.device_put(g, NamedSharding(mesh, P(rows, None, cols)))
    got = jax.jit(f)(gs, scale)
    for o, w in zip(got[:4], want[:4], strict=True):
        _same(o, w)
    assert got[1].sharding.is_equivalent_to(NamedSharding(mesh, P(None, cols, rows)), 3)
    if _size(mesh, rows) == 1:
        _same(got[4], want[4])
    else:
        _close(got[4], want[4], 32)
    hlo = _hlo(f, gs, scale)
    _no_gathers(hlo)
    if implementation == "kernel":
        assert sorted(all_reduce_group_sizes(hlo)) == _expected_all_reduces(mesh, rows, cols)
