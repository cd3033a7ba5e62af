"""The ``"xla"`` implementation on a device mesh: XLA partitions the jnp references itself.

Run on 8 emulated CPU devices (``tools/test.sh`` does). Per op, with
``fp8jax.ops.implementation("xla")``: outputs bit-identical to the single-device kernel;
outputs keep (or, for a transpose, swap) the operand's sharding; nothing is gathered; an amax is
the *global* one, all-reduced over exactly the devices that split the tensor (XLA reduces a
tensor split over two mesh axes in one all-reduce per axis, where the kernel's rule needs one);
and no fp8jax custom call is compiled in.
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

from fp8jax import DelayedScaling, ops

N_DEVICES = 8
pytestmark = needs_devices(N_DEVICES)

E4M3 = jnp.float8_e4m3fn


def _one_device(x):
    return jax.device_put(x, jax.devices()[0])


def _data(shape, dtype=jnp.float32, seed=0):
    """Random values whose largest magnitude is the last element (the last device's block)."""
    return normal(seed, shape, dtype, 40.0).at[(-1,) * len(shape)].set(-1000.0)


def _same(got, want) -> None:
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.tobytes() == want.tobytes()


def _compiled(fn, *args) -> str:
    with ops.implementation("xla"):
        hlo = jax.jit(fn).lower(*args).compile().as_text()
    assert 'custom_call_target="fp8jax_' not in hlo
    return hlo


def _assert_collectives(hlo: str, all_reduce_devices: int) -> None:
    """No gather of any kind; all-reduces over ``all_reduce_devices`` devices in all."""
    for op in ("all-gather", "all-to-all", "collective-permute", "reduce-scatter"):
        assert count(hlo, op) == 0, f"unexpected {op} in\n{hlo}"
    assert math.prod(all_reduce_group_sizes(hlo)) == all_reduce_devices, hlo


def _xla(fn, *args):
    with ops.implementation("xla"):
        return jax.jit(fn)(*args)


@pytest.mark.parametrize(
    ("spec", "devices"),
    [(P("data", "model"), 8), (P(None, "model"), 4), (P(("data", "model")), 8), (P(), 1)],
    ids=str,
)
def test_quantize_and_dequantize(spec, devices):
    mesh = make_mesh()
    x = _data((16, 32), jnp.bfloat16)
    f = lambda x: ops.quantize(x, jnp.float32(0.37), E4M3)
    want = f(_one_device(x))  # the kernel, on one device
    xs = jax.device_put(x, NamedSharding(mesh, spec))
    q, scale_inv, amax = _xla(f, xs)
    for g, w in zip((q, scale_inv, amax), want, strict=True):
        _same(g, w)
    assert float(amax) == 1000.0  # the global max, not a block's
    assert q.sharding.is_equivalent_to(xs.sharding, 2)
    _assert_collectives(_compiled(f, xs), devices)

    d = lambda q, s: ops.dequantize(q, s, jnp.bfloat16)
    _same(_xla(d, q, scale_inv), d(_one_device(want[0]), _one_device(want[1])))
    _assert_collectives(_compiled(d, q, scale_inv), 1)


@pytest.mark.parametrize(
    ("spec", "t_spec", "devices"),
    [
        (P(None, "data", "model"), P(None, "model", "data"), 8),
        (P("data", None, "model"), P("data", "model", None), 8),
        (P(None, None, "model"), P(None, "model", None), 4),
    ],
    ids=str,
)
def test_cast_transpose(spec, t_spec, devices):
    mesh = make_mesh()
    x = _data((8, 16, 32), jnp.bfloat16)
    f = lambda x: ops.cast_transpose(x, jnp.float32(3.0), E4M3)
    want = f(_one_device(x))
    xs = jax.device_put(x, NamedSharding(mesh, spec))
    got = _xla(f, xs)
    for g, w in zip(got, want, strict=True):
        _same(g, w)
    assert got[1].sharding.is_equivalent_to(NamedSharding(mesh, t_spec), 3)  # local transpose
    _assert_collectives(_compiled(f, xs), devices)


def test_update_fp8_states_rows_stay_local():
    mesh = make_mesh()
    recipe = DelayedScaling(amax_history_len=4, margin=1)
    rng = np.random.default_rng(3)
    hist = jnp.asarray(rng.random((16, 4)).astype(np.float32) * 10)
    scales = jnp.asarray(rng.random(16).astype(np.float32) + 0.5)
    amaxes = jnp.asarray(rng.random(16).astype(np.float32) * 20)
    f = lambda h, s, a: ops.update_fp8_states(h, s, a, recipe, backward=True)
    want = f(_one_device(hist), _one_device(scales), _one_device(amaxes))
    rows = NamedSharding(mesh, P(("data", "model")))
    args = tuple(jax.device_put(v, rows) for v in (hist, scales, amaxes))
    got = _xla(f, *args)
    for g, w in zip(got, want, strict=True):
        _same(g, w)
    assert got[0].sharding.is_equivalent_to(rows, 2)
    _assert_collectives(_compiled(f, *args), 1)


@pytest.mark.parametrize(
    ("a_spec", "b_spec", "out_spec", "devices"),
    [
        (P("data"), P(), P("data"), 1),  # data parallel
        (P(), P("model"), P(None, "model"), 1),  # column parallel
        (P(None, "model"), P(None, "model"), P(), 4),  # row parallel: partial sums all-reduced
    ],
    ids=["dp", "tp_column", "tp_row"],
)
def test_gemm_is_xlas_own_dot(a_spec, b_spec, out_spec, devices):
    mesh = make_mesh()
    rng = np.random.default_rng(1)
    a, b = normal(rng, (32, 64), E4M3, 8.0), normal(rng, (48, 64), jnp.float8_e5m2, 8.0)
    f = lambda a, b: ops.gemm(a, b, jnp.float32(0.37), jnp.float32(0.011), out_dtype=jnp.float32)
    want = f(_one_device(a), _one_device(b))
    args = (
        jax.device_put(a, NamedSharding(mesh, a_spec)),
        jax.device_put(b, NamedSharding(mesh, b_spec)),
    )
    got = _xla(f, *args)
    # A split K sums the partial products in another order: equal within float32 rounding.
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)
    assert got.sharding.is_equivalent_to(NamedSharding(mesh, out_spec), 2)
    _assert_collectives(_compiled(f, *args), devices)


def test_vmap_of_a_sharded_quantize():
    mesh = make_mesh()
    xs = _data((4, 16, 32))
    scales = jnp.asarray([1.0, 0.5, 2.0, 0.25], jnp.float32)
    xsh = jax.device_put(xs, NamedSharding(mesh, P("data", None, "model")))
    f = jax.vmap(lambda x, s: ops.quantize(x, s, E4M3))
    q, scale_inv, amax = _xla(f, xsh, scales)
    for i in range(4):
        want = ops.quantize(_one_device(xs[i]), scales[i], E4M3)
        for g, w in zip((q[i], scale_inv[i], amax[i]), want, strict=True):
            _same(g, w)
    _assert_collectives(_compiled(f, xsh, scales), 4)  # each tensor is split over 'model'


def test_explicit_sharding_mode():
    mesh = make_mesh(explicit=True)  # skips on a JAX without explicit sharding
    x = _data((16, 32))
    f = lambda x: ops.cast_transpose(x, jnp.float32(1.0), E4M3)
    want = f(_one_device(x))
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, P("data", "model"))
        got = _xla(f, xs)
        hlo = _compiled(f, xs)
    for g, w in zip(got, want, strict=True):
        _same(g, w)
    assert got[0].sharding.spec == P("data", "model")
    assert got[1].sharding.spec == P("model", "data")
    _assert_collectives(hlo, 8)
