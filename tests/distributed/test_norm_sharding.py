"""The norms on a device mesh: rows split any way, the hidden dim never split.

Run on 8 emulated CPU devices (``tools/test.sh`` does). For every sharding of ``x`` and both
implementations: ``y``, ``q``, ``q_t``, ``mu``, ``rsigma`` and ``dx`` bit-identical to the
single-device call (a row's math does not depend on where the row lives); ``amax`` global and
the same on every device; ``dgamma``/``dbeta`` the sum over *all* rows on every device, within
the float32 tolerance of a different summation order (tests/ops/test_norm.py). With the kernel,
the compiled HLO gathers nothing when only rows are split, and has exactly one all-reduce per
reduced output, over the devices that split the rows.
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

CASES = [
    ("8", P("data")),
    ("8", P()),
    ("2x4", P("data")),
    ("2x4", P(("data", "model"))),
    ("2x4", P("data", "model")),  # h split: gathered first (need_replication)
    ("2x4", P(None, "model")),
]
IMPLS = ["kernel", "xla"]
EPS = 1e-5
TOL = 64 * float(np.finfo(np.float32).eps)


def _ids(case):
    return f"{case[0]}-{case[1]}"


def _row_group(mesh, spec) -> int:
    """Devices that split the rows (dim 0 of x)."""
    e = spec[0] if len(spec) else None
    axes = () if e is None else ((e,) if isinstance(e, str) else e)
    return math.prod(mesh.shape[a] for a in axes)


def _data(m=32, h=64, dtype=jnp.bfloat16):
    rng = np.random.default_rng(0)
    x = normal(rng, (m, h), dtype, 3.0).at[-1, -1].set(60.0)  # the largest |y|: last device's
    g, b = normal(rng, h, scale=0.1, shift=1.0), normal(rng, h, scale=0.1)
    return x, g, b, normal(rng, (m, h), dtype)


def _one(x):
    return jax.device_put(x, jax.devices()[0])


def _same(got, want):
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(got.reshape(-1).view(np.uint8), want.reshape(-1).view(np.uint8))


def _everywhere(a, want, exact=True):
    for shard in a.addressable_shards:
        assert shard.data.shape == a.shape
        if exact:
            _same(shard.data, want)
        else:
            w = np.asarray(want)
            np.testing.assert_allclose(
                np.asarray(shard.data), w, rtol=0, atol=TOL * max(1.0, np.abs(w).max())
            )


def _no_gather(hlo):
    for op in ("all-gather", "all-to-all", "collective-permute"):
        assert count(hlo, op) == 0, f"unexpected {op}"


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_forward_and_fp8_sharded(case, impl):
    mesh, spec = make_mesh(case[0]), case[1]
    x, g, b, _ = _data()
    kw = dict(norm_type="layernorm", epsilon=EPS, implementation=impl)
    scale = jnp.float32(2.0)
    want = ops.norm_forward(_one(x), _one(g), _one(b), **kw)
    want8 = ops.norm_forward_fp8(_one(x), _one(g), _one(b), _one(scale), jnp.float8_e4m3fn, **kw)

    xs = jax.device_put(x, NamedSharding(mesh, spec))
    f = jax.jit(lambda x, g, b: ops.norm_forward(x, g, b, **kw))
    f8 = jax.jit(lambda x, g, b, s: ops.norm_forward_fp8(x, g, b, s, jnp.float8_e4m3fn, **kw))
    h_split = len(spec) > 1 and spec[1] is not None
    got8 = f8(xs, g, b, scale)
    if impl == "xla" and h_split:
        # XLA splits the row sums over the devices that hold the row's pieces: the same
        # values within the tolerance of a different summation order, not the same bits.
        for got, w in zip(f(xs, g, b), want, strict=True):
            np.testing.assert_allclose(
                np.asarray(got, np.float32), np.asarray(w, np.float32), rtol=1e-2, atol=1e-5
            )
        _everywhere(got8[3], np.asarray(got8[3]))
        return
    for got, w in zip(f(xs, g, b), want, strict=True):
        _same(got, w)
    for got, w in zip(got8, want8, strict=True):
        _same(got, w)
    _everywhere(got8[3], want8[3])  # amax: global, on every device
    assert float(got8[3]) == float(jnp.max(jnp.abs(want[0].astype(jnp.float32))))
    if impl == "kernel" and not h_split:
        _no_gather(f.lower(xs, g, b).compile().as_text())
        hlo = f8.lower(xs, g, b, scale).compile().as_text()
        _no_gather(hlo)
        group = _row_group(mesh, spec)
        assert all_reduce_group_sizes(hlo) == ([group] if group > 1 else [])


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_backward_sharded_psums_dgamma(case, impl):
    mesh, spec = make_mesh(case[0]), case[1]
    x, g, b, dy = _data()
    _, mu, rs = ops.norm_forward(x, g, b, norm_type="layernorm", epsilon=EPS)
    kw = dict(norm_type="layernorm", implementation=impl)
    want = ops.norm_backward(_one(dy), _one(x), _one(mu), _one(rs), _one(g), **kw)

    sh = NamedSharding(mesh, spec)
    row_spec = P(spec[0]) if len(spec) else P()
    rows = NamedSharding(mesh, row_spec)
    args = (jax.device_put(dy, sh), jax.device_put(x, sh))
    args += (jax.device_put(mu, rows), jax.device_put(rs, rows), g)
    f = jax.jit(lambda dy, x, mu, rs, g: ops.norm_backward(dy, x, mu, rs, g, **kw))
    dx, dgamma, dbeta = f(*args)
    if impl == "xla" and len(spec) > 1 and spec[1] is not None:  # row sums split by XLA
        np.testing.assert_allclose(
            np.asarray(dx, np.float32), np.asarray(want[0], np.float32), rtol=1e-2, atol=1e-4
        )
    else:
        _same(dx, want[0])
    h_split = len(spec) > 1 and spec[1] is not None
    for got, w in ((dgamma, want[1]), (dbeta, want[2])):
        if h_split:  # the partitioner may leave dgamma split like dy's columns
            w = np.asarray(w)
            np.testing.assert_allclose(np.asarray(got), w, rtol=0, atol=TOL * np.abs(w).max())
        else:
            _everywhere(got, w, exact=False)
    if impl == "kernel" and not h_split:
        hlo = f.lower(*args).compile().as_text()
        _no_gather(hlo)
        group = _row_group(mesh, spec)
        sizes = all_reduce_group_sizes(hlo)
        assert set(sizes) <= {group} and (len(sizes) >= 1) == (group > 1), sizes


@pytest.mark.parametrize("impl", IMPLS)
def test_grad_of_layernorm_with_rows_split(impl):
    mesh = make_mesh("2x4")
    x, g, b, dy = _data(dtype=jnp.float32)

    def loss(x, g, b):
        y = ops.layernorm(x, g, b, epsilon=EPS, implementation=impl)
        y = y + ops.rmsnorm(x, g, epsilon=EPS, implementation=impl)
        return jnp.sum(y * dy)

    want = jax.grad(loss, argnums=(0, 1, 2))(_one(x), _one(g), _one(b))
    xs = jax.device_put(x, NamedSharding(mesh, P(("data", "model"))))
    got = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(xs, g, b)
    np.testing.assert_allclose(np.asarray(got[0]), np.asarray(want[0]), rtol=1e-5, atol=1e-5)
    for i in (1, 2):
        _everywhere(got[i], want[i], exact=False)


def test_batch_and_sequence_split_separately_stay_split():
    """``[batch, seq, h]`` with batch over ``data`` and the sequence over ``model`` (sequence
    parallelism): the kernels run on the local rows as they are, with no gather (flattening
    ``[batch, seq]`` first would gather the sequence, as a merged dim cannot carry the split of
    its minor part); same bits as one device, amax and dgamma reduced over all 8 devices.
    (``q_t``, ``[h, rows]`` of the flattened rows, is itself such a merge: returning it gathers
    the sequence, in FP8.)"""
    mesh = make_mesh("2x4")
    x, g, b, dy = (v.reshape(4, 8, 64) if v.ndim == 2 else v for v in _data())
    kw = dict(norm_type="layernorm", epsilon=EPS, implementation="kernel")
    scale = jnp.float32(2.0)
    sh = NamedSharding(mesh, P("data", "model"))
    xs, dys = jax.device_put(x, sh), jax.device_put(dy, sh)

    def step(x, dy, g, b, with_t=False):
        q, q_t, _, amax, mu, rs = ops.norm_forward_fp8(x, g, b, scale, jnp.float8_e4m3fn, **kw)
        bwd = ops.norm_backward(dy, x, mu, rs, g, norm_type="layernorm", implementation="kernel")
        return (q, amax, mu, rs, *bwd) + ((q_t,) if with_t else ())

    f = jax.jit(step)
    hlo = f.lower(xs, dys, g, b).compile().as_text()
    _no_gather(hlo)
    assert set(all_reduce_group_sizes(hlo)) == {8}, all_reduce_group_sizes(hlo)
    got = f(xs, dys, g, b)
    want = step(_one(x), _one(dy), _one(g), _one(b), with_t=True)
    for i in range(5):  # q, amax, mu, rsigma, dx
        _same(got[i], want[i])
    for i in (5, 6):  # dgamma, dbeta
        _everywhere(got[i], want[i], exact=False)
    assert got[0].sharding.spec[:2] == ("data", "model")
    q_t = jax.jit(lambda *a: step(*a, with_t=True)[-1])(xs, dys, g, b)
    assert q_t.shape == (64, 32)
    _same(q_t, want[-1])
