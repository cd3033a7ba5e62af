"""The fp8jax custom calls on a device mesh: each device works on its own block.

Run on 8 emulated CPU devices (``tools/test.sh`` does)::

    XLA_FLAGS=--xla_force_host_platform_device_count=8 JAX_PLATFORMS=cpu pytest tests/distributed

For every op and sharding: outputs bit-identical to the single-device call; ``q`` keeps the
sharding of ``x``; ``amax`` (and ``scale_inv``) identical on every device; and the compiled HLO
gathers nothing and has exactly one all-reduce for the amax (none when ``x`` is replicated),
whose replica groups are exactly the devices that share a tensor (the mesh axes that split it).
"""

from __future__ import annotations

import contextlib
import importlib
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _hlo import all_reduce_group_sizes, count
from _shared import make_mesh, normal
from conftest import needs_devices
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from fp8jax import DelayedScaling, ops

N_DEVICES = 8
pytestmark = needs_devices(N_DEVICES)

E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2

# (mesh, spec of a 2-D x): every way to split the two dims, including not at all.
CASES_2D = [
    ("8", P("data")),
    ("8", P(None, "data")),
    ("8", P()),
    ("2x4", P("data")),
    ("2x4", P(None, "model")),
    ("2x4", P("data", "model")),
    ("2x4", P("model", "data")),
    ("2x4", P(("data", "model"))),
    ("2x4", P(None, ("model", "data"))),
    ("2x4", P()),
]


def _ids(case) -> str:
    return f"{case[0]}-{case[1]}"


def _one_device(x):
    return jax.device_put(x, jax.devices()[0])


def _data(shape, dtype=jnp.float32, seed=0):
    """Random values whose largest magnitude sits in the last element (the last device's
    block under any sharding), so a device that skipped the reduction would see a smaller
    amax."""
    return normal(seed, shape, dtype, 40.0).at[(-1,) * len(shape)].set(-1000.0)


def _split_axes(mesh: Mesh, spec: P) -> tuple[str, ...]:
    return tuple(a for e in spec if e is not None for a in ((e,) if isinstance(e, str) else e))


def _group_size(mesh: Mesh, spec: P) -> int:
    return math.prod(mesh.shape[a] for a in _split_axes(mesh, spec))


# ------------------------------------------------------------------ HLO inspection


def _hlo(fn, *args) -> str:
    return jax.jit(fn).lower(*args).compile().as_text()


def _assert_collectives(hlo: str, *, all_reduce_group: int | None) -> None:
    """No gather of any kind; one all-reduce over ``all_reduce_group`` devices, or none."""
    for op in ("all-gather", "all-to-all", "collective-permute", "reduce-scatter"):
        assert count(hlo, op) == 0, f"unexpected {op} in\n{hlo}"
    want = [] if all_reduce_group is None else [all_reduce_group]
    assert all_reduce_group_sizes(hlo) == want, hlo


def _assert_same(got, want) -> None:
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape
    np.testing.assert_array_equal(  # bit for bit
        got.reshape(-1).view(np.uint8), want.reshape(-1).view(np.uint8)
    )


def _assert_everywhere(a: jax.Array, want) -> None:
    """``a`` holds the same full value on every device."""
    assert len(a.addressable_shards) == N_DEVICES
    for shard in a.addressable_shards:
        assert shard.data.shape == a.shape
        _assert_same(shard.data, want)


def _assert_sharded_like(a: jax.Array, sharding: NamedSharding) -> None:
    assert a.sharding.is_equivalent_to(sharding, a.ndim), (a.sharding, sharding)


# ------------------------------------------------------------------ quantize / dequantize


@pytest.mark.parametrize("case", CASES_2D, ids=_ids)
@pytest.mark.parametrize(
    ("wide", "fp8", "scale_shape"),
    [(jnp.float32, E4M3, ()), (jnp.bfloat16, E5M2, (1,))],
    ids=["f32-e4m3-scalar", "bf16-e5m2-vec1"],
)
def test_quantize_sharded(case, wide, fp8, scale_shape):
    mesh, spec = make_mesh(case[0]), case[1]
    x = _data((16, 32), wide)
    scale = jnp.full(scale_shape, 0.37, jnp.float32)
    want = ops.quantize(_one_device(x), _one_device(scale), fp8)

    xs = jax.device_put(x, NamedSharding(mesh, spec))
    f = jax.jit(lambda x, s: ops.quantize(x, s, fp8))
    q, scale_inv, amax = f(xs, scale)

    _assert_same(q, want[0])
    _assert_sharded_like(q, xs.sharding)
    _assert_everywhere(scale_inv, want[1])
    _assert_everywhere(amax, want[2])
    assert float(np.asarray(amax).reshape(())) == 1000.0  # the global max, not a block's
    group = _group_size(mesh, spec)
    _assert_collectives(_hlo(f, xs, scale), all_reduce_group=group if group > 1 else None)


@pytest.mark.parametrize("op", ["quantize", "cast_transpose"])
@pytest.mark.parametrize("case", CASES_2D, ids=_ids)
def test_amax_reduction_mesh(case, op):
    """``amax_reduction="mesh"``: the same amax, reduced over the whole mesh whenever x is split
    (one device group for every tensor), and not at all when x is replicated."""
    mesh, spec = make_mesh(case[0]), case[1]
    x = _data((16, 32), jnp.bfloat16, seed=5)
    scale = jnp.float32(0.5)
    fn = getattr(ops, op)
    want = fn(_one_device(x), _one_device(scale), E4M3)
    xs = jax.device_put(x, NamedSharding(mesh, spec))
    f = jax.jit(lambda x, s: fn(x, s, E4M3, amax_reduction="mesh"))
    got = f(xs, scale)
    for g, w in zip(got, want, strict=True):
        _assert_same(g, w)
    _assert_everywhere(got[-1], want[-1])
    split = _group_size(mesh, spec) > 1
    _assert_collectives(_hlo(f, xs, scale), all_reduce_group=mesh.size if split else None)


def test_amax_reductions_of_many_tensors_combine_into_one():
    """Tensors split over different axes of a 2-D mesh: with "split" XLA needs one all-reduce
    per device group (three here); with "mesh" one for all."""
    mesh = make_mesh("2x4")
    specs = [P("data"), P(None, "model"), P("data", "model")]
    xs = [
        jax.device_put(_data((16, 32), seed=i), NamedSharding(mesh, s)) for i, s in enumerate(specs)
    ]

    def amaxes(reduction):
        def f(*xs):
            return [ops.quantize(x, jnp.float32(1), E4M3, amax_reduction=reduction)[2] for x in xs]

        return f

    assert all_reduce_group_sizes(_hlo(amaxes("split"), *xs)) == [2, 4, 8]
    assert all_reduce_group_sizes(_hlo(amaxes("mesh"), *xs)) == [8]
    got = jax.jit(amaxes("mesh"))(*xs)
    want = jax.jit(amaxes("split"))(*xs)
    for g, w in zip(got, want, strict=True):
        _assert_same(g, w)


@pytest.mark.parametrize("case", CASES_2D, ids=_ids)
def test_dequantize_sharded_is_local(case):
    mesh, spec = make_mesh(case[0]), case[1]
    q, scale_inv, _ = ops.quantize(_data((16, 32)), jnp.float32(0.25), E4M3)
    want = ops.dequantize(_one_device(q), _one_device(scale_inv), jnp.bfloat16)
    qs = jax.device_put(q, NamedSharding(mesh, spec))
    f = jax.jit(lambda q, s: ops.dequantize(q, s, jnp.bfloat16))
    got = f(qs, scale_inv)
    _assert_same(got, want)
    _assert_sharded_like(got, qs.sharding)
    _assert_collectives(_hlo(f, qs, scale_inv), all_reduce_group=None)


def test_quantize_then_dequantize_in_one_jit_stays_sharded():
    mesh = make_mesh("2x4")
    x = _data((16, 32))
    xs = jax.device_put(x, NamedSharding(mesh, P("data", "model")))

    def roundtrip(x):
        q, s_inv, amax = ops.quantize(x, jnp.float32(2.0), E4M3)
        return ops.dequantize(q, s_inv, jnp.float32), amax

    y, amax = jax.jit(roundtrip)(xs)
    wy, wamax = roundtrip(_one_device(x))
    _assert_same(y, wy)
    _assert_everywhere(amax, wamax)
    _assert_sharded_like(y, xs.sharding)
    _assert_collectives(_hlo(roundtrip, xs), all_reduce_group=8)


def test_eager_call_on_sharded_input_is_partitioned_too():
    mesh = make_mesh("2x4")
    x = _data((16, 32))
    xs = jax.device_put(x, NamedSharding(mesh, P("data", "model")))
    q, scale_inv, amax = ops.quantize(xs, jnp.float32(1.0), E4M3)  # no jit
    want = ops.quantize(_one_device(x), jnp.float32(1.0), E4M3)
    _assert_same(q, want[0])
    _assert_everywhere(scale_inv, want[1])
    _assert_sharded_like(q, xs.sharding)
    _assert_everywhere(amax, want[2])


def test_unevenly_split_dims_are_not_split():
    # 12 rows over 8 devices: XLA would pad the blocks; the rule runs that dim unsplit instead,
    # so no padding reaches the amax.
    mesh = make_mesh("8")
    x = _data((12, 16))
    want = ops.quantize(_one_device(x), jnp.float32(1.0), E4M3)

    def f(x):
        x = jax.lax.with_sharding_constraint(x, NamedSharding(mesh, P("data")))
        return ops.quantize(x, jnp.float32(1.0), E4M3)

    got = jax.jit(f)(x)
    for a, b in zip(got, want, strict=True):
        _assert_same(a, b)


# ------------------------------------------------------------------ cast_transpose

CASES_CT = [
    ("8", P(None, "data")),
    ("8", P(None, None, "data")),
    ("8", P("data")),
    ("2x4", P(None, "data", "model")),
    ("2x4", P(None, "model", "data")),
    ("2x4", P(None, ("data", "model"))),
    ("2x4", P(None, None, ("data", "model"))),
    ("2x4", P("data", None, "model")),
    ("2x4", P("data", "model")),
    ("2x4", P()),
]


def _transposed(spec: P, ndim: int) -> P:
    s = (*spec, *(None,) * (ndim - len(spec)))
    return P(*s[:-2], s[-1], s[-2])


@pytest.mark.parametrize("case", CASES_CT, ids=_ids)
def test_cast_transpose_sharded(case):
    mesh, spec = make_mesh(case[0]), case[1]
    x = _data((8, 16, 32), jnp.bfloat16)
    scale = jnp.float32(3.0)
    want = ops.cast_transpose(_one_device(x), scale, E4M3)

    xs = jax.device_put(x, NamedSharding(mesh, spec))
    f = jax.jit(lambda x, s: ops.cast_transpose(x, s, E4M3))
    q, q_t, scale_inv, amax = f(xs, scale)

    _assert_same(q, want[0])
    _assert_same(q_t, want[1])
    _assert_sharded_like(q, xs.sharding)
    _assert_sharded_like(q_t, NamedSharding(mesh, _transposed(spec, 3)))
    _assert_everywhere(scale_inv, want[2])
    _assert_everywhere(amax, want[3])
    group = _group_size(mesh, spec)
    _assert_collectives(_hlo(f, xs, scale), all_reduce_group=group if group > 1 else None)


# ------------------------------------------------------------------ update_fp8_states


def _states(n=16, hist_len=4, seed=3):
    rng = np.random.default_rng(seed)
    hist = jnp.asarray(rng.random((n, hist_len)).astype(np.float32) * 10)
    scales = jnp.asarray(rng.random(n).astype(np.float32) + 0.5)
    amaxes = jnp.asarray(rng.random(n).astype(np.float32) * 20)
    return hist, scales, amaxes


@pytest.mark.parametrize(
    ("case", "algo"),
    [
        (("8", P("data")), "max"),
        (("2x4", P("data")), "most_recent"),
        (("2x4", P(("data", "model"))), "max"),
        (("2x4", P("model")), "max"),
        (("2x4", P()), "max"),
    ],
    ids=lambda v: _ids(v) if isinstance(v, tuple) else v,
)
def test_update_fp8_states_sharded_over_rows(case, algo):
    mesh, spec = make_mesh(case[0]), case[1]
    recipe = DelayedScaling(amax_history_len=4, amax_compute_algo=algo, margin=1)
    hist, scales, amaxes = _states()
    backward = [i % 3 == 0 for i in range(16)]
    want = ops.update_fp8_states(
        _one_device(hist), _one_device(scales), _one_device(amaxes), recipe, backward=backward
    )
    rows = NamedSharding(mesh, spec)
    args = (jax.device_put(hist, rows), jax.device_put(scales, rows), jax.device_put(amaxes, rows))
    f = jax.jit(lambda h, s, a: ops.update_fp8_states(h, s, a, recipe, backward=backward))
    new_hist, new_scales = f(*args)
    _assert_same(new_hist, want[0])
    _assert_same(new_scales, want[1])
    _assert_sharded_like(new_hist, rows)
    _assert_sharded_like(new_scales, rows)
    _assert_collectives(_hlo(f, *args), all_reduce_group=None)


def test_update_fp8_states_history_dim_is_never_split():
    mesh = make_mesh("2x4")
    recipe = DelayedScaling(amax_history_len=4)
    hist, scales, amaxes = _states()
    want = ops.update_fp8_states(_one_device(hist), scales, amaxes, recipe)
    h = jax.device_put(hist, NamedSharding(mesh, P("data", "model")))  # history split 4 ways
    f = jax.jit(lambda h, s, a: ops.update_fp8_states(h, s, a, recipe))
    got = f(h, scales, amaxes)
    _assert_same(got[0], want[0])
    _assert_same(got[1], want[1])
    # The history is gathered (needed); rows stay split and no amax is reduced.
    assert all_reduce_group_sizes(_hlo(f, h, scales, amaxes)) == []


# ------------------------------------------------------------------ vmap with sharding


@pytest.mark.parametrize(
    ("spec", "group"),
    [
        (P("data"), None),  # the batch is split: each device quantizes whole tensors
        (P(None, "model"), 4),  # each tensor is split over 'model': its amax is reduced there
        (P("data", None, "model"), 4),
        (P(None, "data", "model"), 8),
        (P(), None),
    ],
    ids=str,
)
@pytest.mark.parametrize("jit", [True, False], ids=["jit", "eager"])
def test_vmap_quantize_sharded(spec, group, jit):
    mesh = make_mesh("2x4")
    xs = _data((4, 16, 32))
    scales = jnp.asarray([1.0, 0.5, 2.0, 0.25], jnp.float32)
    xsh = jax.device_put(xs, NamedSharding(mesh, spec))
    f = jax.vmap(lambda x, s: ops.quantize(x, s, E4M3))
    q, scale_inv, amax = (jax.jit(f) if jit else f)(xsh, scales)
    assert amax.shape == (4,)
    for i in range(4):
        wq, ws, wa = ops.quantize(_one_device(xs[i]), scales[i], E4M3)
        _assert_same(q[i], wq)
        _assert_same(scale_inv[i], ws)
        _assert_same(amax[i], wa)
    _assert_sharded_like(q, xsh.sharding)
    if jit:
        _assert_collectives(_hlo(f, xsh, scales), all_reduce_group=group)


def test_nested_vmap_with_unbatched_scale_sharded():
    mesh = make_mesh("2x4")
    xs = _data((2, 4, 8, 16))
    s = jnp.full((1,), 0.5, jnp.float32)
    xsh = jax.device_put(xs, NamedSharding(mesh, P("data", None, None, "model")))
    f = jax.jit(jax.vmap(jax.vmap(lambda x: ops.quantize(x, s, E5M2))))
    q, _, amax = f(xsh)
    assert amax.shape == (2, 4, 1)
    for i in range(2):
        for j in range(4):
            wq, _, wa = ops.quantize(_one_device(xs[i, j]), s, E5M2)
            _assert_same(q[i, j], wq)
            _assert_same(amax[i, j], wa)
    _assert_sharded_like(q, xsh.sharding)
    _assert_collectives(_hlo(f, xsh), all_reduce_group=4)


def test_vmap_cast_transpose_dequantize_and_update_sharded():
    mesh = make_mesh("2x4")
    xs = _data((4, 16, 32), jnp.bfloat16)
    scales = jnp.asarray([1.0, 0.5, 2.0, 0.25], jnp.float32)
    xsh = jax.device_put(xs, NamedSharding(mesh, P("data", "model")))
    ct = jax.jit(jax.vmap(lambda x, s: ops.cast_transpose(x, s, E4M3)))
    q, q_t, s_inv, amax = ct(xsh, scales)
    for i in range(4):
        want = ops.cast_transpose(_one_device(xs[i]), scales[i], E4M3)
        for got, w in zip((q[i], q_t[i], s_inv[i], amax[i]), want, strict=True):
            _assert_same(got, w)
    _assert_sharded_like(q_t, NamedSharding(mesh, P("data", None, "model")))
    _assert_collectives(_hlo(ct, xsh, scales), all_reduce_group=4)

    dq = jax.jit(jax.vmap(lambda q, s: ops.dequantize(q, s, jnp.float32)))
    y = dq(q, s_inv)
    for i in range(4):
        _assert_same(y[i], ops.dequantize(_one_device(q[i]), _one_device(s_inv[i])))
    _assert_collectives(_hlo(dq, q, s_inv), all_reduce_group=None)

    recipe = DelayedScaling(amax_history_len=4)
    hist, sc, am = (jnp.stack([a, a * 2]) for a in _states(n=8))
    rows = NamedSharding(mesh, P("data", "model"))
    up = jax.jit(jax.vmap(lambda h, s, a: ops.update_fp8_states(h, s, a, recipe)))
    args = (jax.device_put(hist, rows), jax.device_put(sc, rows), jax.device_put(am, rows))
    new_hist, new_scales = up(*args)
    for i in range(2):
        w = ops.update_fp8_states(_one_device(hist[i]), sc[i], am[i], recipe)
        _assert_same(new_hist[i], w[0])
        _assert_same(new_scales[i], w[1])
    _assert_collectives(_hlo(up, *args), all_reduce_group=None)


# ------------------------------------------------------------------ shard_map, one device


def test_inside_shard_map_amax_is_local():
    mesh = make_mesh("2x4")
    x = _data((16, 32))
    spec = P("data", "model")

    def body(x):
        q, _, amax = ops.quantize(x, jnp.float32(1.0), E4M3)
        return q, amax[None], jax.lax.pmax(amax, ("data", "model"))

    f = jax.jit(
        jax.shard_map(body, mesh=mesh, in_specs=spec, out_specs=(spec, P(("data", "model")), P()))
    )
    q, local, global_ = f(jax.device_put(x, NamedSharding(mesh, spec)))
    want = ops.quantize(_one_device(x), jnp.float32(1.0), E4M3)
    _assert_same(q, want[0])
    blocks = np.abs(np.asarray(x)).reshape(2, 8, 4, 8).max(axis=(1, 3)).reshape(-1)
    _assert_same(local, blocks)  # each block's own amax: reducing them is the caller's business
    _assert_same(global_, want[2])


def test_inside_partly_manual_shard_map():
    # Manual over 'data', automatic over 'model': the kernel runs on the 'data' block.
    mesh = make_mesh("2x4")
    x = _data((16, 32))

    def body(x):
        x = jax.lax.with_sharding_constraint(x, P(None, "model"))
        q, _, amax = ops.quantize(x, jnp.float32(1.0), E4M3)
        return q, amax[None]

    f = jax.jit(
        jax.shard_map(
            body,
            mesh=mesh,
            in_specs=P("data"),
            out_specs=(P("data"), P("data")),
            axis_names={"data"},
        )
    )
    for ctx in (contextlib.nullcontext, lambda: jax.set_mesh(mesh)):
        with ctx():
            q, amax = f(jax.device_put(x, NamedSharding(mesh, P("data", "model"))))
        _assert_same(q, ops.quantize(_one_device(x), jnp.float32(1.0), E4M3)[0])
        _assert_same(amax, np.abs(np.asarray(x)).reshape(2, -1).max(axis=1))


def test_single_device_lowering_is_the_bare_kernel():
    x = _data((16, 32))
    # a one-device mesh (not a standard one): what this test is about
    for arg in (x, jax.device_put(x, NamedSharding(Mesh(jax.devices()[:1], ("data",)), P()))):
        f = jax.jit(lambda x: ops.quantize(x, jnp.float32(1.0), E4M3))
        text = f.lower(arg).as_text()
        assert "fp8jax_quantize" in text and "CustomSPMDPartitioning" not in text
        for a, b in zip(f(arg), ops.quantize(_one_device(x), jnp.float32(1.0), E4M3), strict=True):
            _assert_same(a, b)


def test_sharding_rules():
    quantize_mod = importlib.import_module("fp8jax.ops.casts.quantize")
    ct_mod = importlib.import_module("fp8jax.ops.casts.cast_transpose")
    scaling_mod = importlib.import_module("fp8jax.ops.casts.scaling")
    assert quantize_mod._quantize_rule(0, 2, 1) == "d0 d1, s -> d0 d1, s, s"
    assert quantize_mod._quantize_rule(0, 2, 0) == "d0 d1,  -> d0 d1, , "
    assert quantize_mod._quantize_rule(1, 3, 1) == "g0 d0 d1, g0 -> g0 d0 d1, g0, g0"
    assert quantize_mod._dequantize_rule(0, 3, 1) == "d0 d1 d2, s -> d0 d1 d2"
    assert ct_mod._rule(0, 2, 1) == "m n, s -> m n, n m, s, s"
    assert ct_mod._rule(1, 4, 2) == "g0 d0 m n, g0 s -> g0 d0 m n, g0 d0 n m, g0 s, g0 s"
    assert scaling_mod._rule(0) == "n l, n, n, n -> n l, n"


# ------------------------------------------------------------------ other partitioners


@pytest.mark.parametrize("spec", [P("data"), P(None, "model"), P(("data", "model"))], ids=str)
def test_gspmd_partitioner(gspmd, spec):
    mesh = make_mesh("2x4")
    x = _data((16, 32))
    xs = jax.device_put(x, NamedSharding(mesh, spec))
    want = ops.cast_transpose(_one_device(x), jnp.float32(1.0), E4M3)
    f = jax.jit(lambda x: ops.cast_transpose(x, jnp.float32(1.0), E4M3))
    got = f(xs)
    for a, b in zip(got, want, strict=True):
        _assert_same(a, b)
    _assert_sharded_like(got[0], xs.sharding)
    _assert_everywhere(got[3], want[3])
    _assert_collectives(_hlo(f, xs), all_reduce_group=_group_size(mesh, spec))


def test_explicit_sharding_mode():
    mesh = make_mesh(explicit=True)  # skips on a JAX without explicit sharding
    x = _data((16, 32))
    want = ops.cast_transpose(_one_device(x), jnp.float32(1.0), E4M3)
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, P("data", "model"))
        f = jax.jit(lambda x: ops.cast_transpose(x, jnp.float32(1.0), E4M3))
        got = f(xs)
        hlo = _hlo(f, xs)
    for a, b in zip(got, want, strict=True):
        _assert_same(a, b)
    assert got[0].sharding.spec == P("data", "model")
    assert got[1].sharding.spec == P("model", "data")
    _assert_collectives(hlo, all_reduce_group=8)
