"""fp8jax.grouped_dense: the experts' GEMM (``jax.lax.ragged_dot``) in FP8 under every recipe.

FP8 off it is the plain-jnp twin (``ragged_dot`` + the per-group bias) bit for bit, gradients
too; FP8 on it is within the dense layer's normwise bounds (tests/functional/test_dense.py),
and it equals the same computation composed by hand from the ops (per-group casts, per-expert
kernel casts, segment blocks, the grouped GEMM), bit for bit; delayed scaling observes one amax
per expert and tensor.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from _shared import rand

import fp8jax
from fp8jax import ops
from fp8jax.ops.block.grouped_scaling import group_ids

pytestmark = pytest.mark.usefixtures("float32_matmuls")

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
U_E4M3 = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).eps) / 2
U_E5M2 = float(ml_dtypes.finfo(ml_dtypes.float8_e5m2).eps) / 2
T, K, N = 40, 48, 24
SIZES = jnp.asarray([9, 0, 17, 6], jnp.int32)  # an empty expert, 8 rows past the sum
G = 4
DELAYED = fp8jax.DelayedScaling(amax_history_len=4)
RECIPES = {
    "delayed": DELAYED,
    "current": fp8jax.Float8CurrentScaling(),
    "block": fp8jax.Float8BlockScaling(),
    "mxfp8": fp8jax.MXFP8BlockScaling(),
}


def _twin(x, w, sizes, b=None):
    """The plain-jnp twin: ``ragged_dot`` and the bias of each row's group."""
    y = jax.lax.ragged_dot(x, w, sizes)
    if b is not None:
        y = y + jnp.take(b, group_ids(sizes, x.shape[0]), axis=0, mode="fill", fill_value=0)
    return y


def _operands(seed=0):
    x = rand((T, K), seed) * jnp.asarray([1.0] * 9 + [30.0] * 17 + [0.05] * 6 + [1.0] * 8)[:, None]
    w = rand((G, K, N), seed + 1, 0.2)
    b = rand((G, N), seed + 2)
    return x, w, b


def _meta_for(x, w, g, sizes):
    """A delayed-scaling state whose scales are each tensor's per-expert ``448 / amax`` (as after
    a step's update), so the bounds below hold."""
    gid = group_ids(sizes, x.shape[0])
    amax = lambda v: jax.ops.segment_max(jnp.max(jnp.abs(v), 1), gid, num_segments=G)
    rows = jnp.stack([amax(x), jnp.max(jnp.abs(w), axis=(1, 2)), amax(g)], axis=1)
    scale = jnp.where(rows > 0, 448.0 / rows, 1.0).reshape(-1)
    meta = fp8jax.init_fp8_meta(DELAYED, n_roles=3 * G)
    return fp8jax.Fp8Meta(meta.amax_history, scale.astype(jnp.float32))


def _call(name, x, w, sizes, b=None, meta=None, probe=None):
    return fp8jax.grouped_dense(x, w, sizes, b, meta, RECIPES[name], probe=probe)


def test_fp8_off_is_the_ragged_dot_twin_values_and_gradients():
    x, w, b = _operands()
    c = rand((T, N), 3)
    got = fp8jax.grouped_dense(x, w, SIZES, b, enabled=False)
    np.testing.assert_array_equal(got, _twin(x, w, SIZES, b))
    mine = jax.grad(
        lambda *a: jnp.sum(fp8jax.grouped_dense(*a[:2], SIZES, a[2], enabled=False) * c), (0, 1, 2)
    )
    twin = jax.grad(lambda *a: jnp.sum(_twin(a[0], a[1], SIZES, a[2]) * c), (0, 1, 2))
    for g, t in zip(mine(x, w, b), twin(x, w, b), strict=True):
        np.testing.assert_array_equal(g, t)


def _normwise(x, w, sizes, u):
    """``(2u + u^2) || ragged_dot(|x|, |w|) ||``: the dense layer's bound, per group."""
    mag = jax.lax.ragged_dot(jnp.abs(x), jnp.abs(w), sizes, precision=jax.lax.Precision.HIGHEST)
    return (2 * u + u * u) * float(jnp.linalg.norm(mag))


@pytest.mark.parametrize("name", list(RECIPES))
def test_fp8_within_the_dense_layers_bounds(name):
    x, w, b = _operands()
    c = rand((T, N), 4, 1e-3)
    meta = _meta_for(x, w, c, SIZES) if name == "delayed" else None
    probe = jnp.zeros((3 * G,), jnp.float32)

    def loss(x, w, b, p):
        return jnp.sum(fp8jax.grouped_dense(x, w, SIZES, b, meta, RECIPES[name], probe=p) * c)

    y = _call(name, x, w, SIZES, b, meta)
    ref = _twin(x, w, SIZES, b)
    assert float(jnp.linalg.norm(y - ref)) <= _normwise(x, w, SIZES, U_E4M3)
    dx, dw, db, _ = jax.grad(loss, (0, 1, 2, 3))(x, w, b, probe)
    dx_ref, dw_ref, db_ref = jax.grad(
        lambda x, w, b: jnp.sum(_twin(x, w, SIZES, b) * c), (0, 1, 2)
    )(x, w, b)
    bwd = RECIPES[name].bwd_dtype
    u = U_E4M3 + (U_E5M2 if bwd == E5M2 else U_E4M3)
    if name in ("block", "mxfp8"):  # the wgrad's copies are cast twice (from the FP8 rows)
        u_w = 2 * u + U_E4M3 * U_E4M3
    else:
        u_w = u
    w_t = jnp.swapaxes(w, 1, 2)
    assert float(jnp.linalg.norm(dx - dx_ref)) <= _normwise(c, w_t, SIZES, u)
    # the wgrad: per group, |x_g|^T |c_g|
    gid = group_ids(SIZES, T)
    mag = jnp.stack([jnp.abs(jnp.where(gid[:, None] == g, x, 0)).T @ jnp.abs(c) for g in range(G)])
    assert float(jnp.linalg.norm(dw - dw_ref)) <= (2 * u_w + u_w**2) * float(jnp.linalg.norm(mag))
    np.testing.assert_allclose(db, db_ref, rtol=1e-5, atol=1e-7)
    assert not np.asarray(dw[1]).any()  # the empty expert gets no gradient


def test_delayed_scaling_uses_each_experts_scales_bit_for_bit():
    x, w, _ = _operands(5)
    c = rand((T, N), 6)
    meta = _meta_for(x, w, c, SIZES)
    y = _call("delayed", x, w, SIZES, meta=meta)
    sc = meta.scale.reshape(G, 3)
    xq, xs, _ = ops.grouped_quantize(x, SIZES, sc[:, 0], E4M3)
    wq, ws, _ = jax.vmap(lambda v, s: ops.quantize(v, s, E4M3))(w, sc[:, 1])
    want = ops.grouped_gemm(xq, jnp.swapaxes(wq, 1, 2), SIZES, xs, ws, out_dtype=jnp.float32)
    np.testing.assert_array_equal(y, want)


def test_delayed_scaling_observes_one_amax_per_expert_and_tensor():
    x, w, _ = _operands(7)
    c = rand((T, N), 8)
    meta = fp8jax.init_fp8_meta(DELAYED, n_roles=3 * G)
    probe = jnp.zeros((3 * G,), jnp.float32)
    seen = jax.grad(lambda p: jnp.sum(_call("delayed", x, w, SIZES, meta=meta, probe=p) * c))(probe)
    gid = group_ids(SIZES, T)

    def per_group(v):
        return jax.ops.segment_max(jnp.max(jnp.abs(v), 1), gid, num_segments=G).clip(0)

    want = jnp.stack([per_group(x), jnp.max(jnp.abs(w), (1, 2)), per_group(c)], 1).reshape(-1)
    np.testing.assert_array_equal(seen, want)
    assert seen[3] == 0 and seen[5] == 0  # the empty expert's input and grad: nothing seen
    assert fp8jax.grouped_roles(G)[3:6] == (
        "expert_1/input",
        "expert_1/kernel",
        "expert_1/grad_output",
    )


@pytest.mark.parametrize("name", ["block", "mxfp8"])
def test_block_scaling_is_the_ops_composed_by_hand(name):
    recipe = RECIPES[name]
    mx = name == "mxfp8"
    x, w, _ = _operands(9)
    c = rand((T, N), 10)
    (bx, _, _), (bw, _, _), (bg, _, _) = ((recipe.block(r), None, None) for r in ("x", "w", "grad"))

    def rows(v, block, dt):
        return ops.mxfp8_quantize(v, dt, block) if mx else ops.block_quantize(v, dt, block)

    def both(v, block):
        if mx:
            return ops.mxfp8_cast_transpose(v, E4M3, block)
        return ops.block_cast_transpose(v, E4M3, block)

    xq, xs = rows(x, bx, E4M3)
    wq, ws, wtq, wts = both(w, bw)
    y = ops.grouped_gemm(xq, wtq, SIZES, xs, wts, a_block=bx, b_block=bw, out_dtype=jnp.float32)
    np.testing.assert_array_equal(_call(name, x, w, SIZES), y)
    bwd = recipe.bwd_dtype
    gq, gsc = rows(c, bg, bwd)
    dx = ops.grouped_gemm(gq, wq, SIZES, gsc, ws, a_block=bg, b_block=bw, out_dtype=jnp.float32)

    def seg(q, s, block, dt):
        values = ops.block_dequantize(q, s, block)
        kw = dict(mxfp8=True) if mx else dict(power_2_scale=True)
        return ops.segment_block_quantize(values.T, SIZES, dt, (1, block[1]), **kw)

    xtq, xts = seg(xq, xs, bx, E4M3)
    gtq, gts = seg(gq, gsc, bg, bwd)
    dw = ops.grouped_gemm(
        xtq,
        gtq,
        SIZES,
        xts,
        gts,
        ragged="contracting",
        a_block=(1, bx[1]),
        b_block=(1, bg[1]),
        out_dtype=jnp.float32,
    )
    got_dx, got_dw = jax.grad(lambda x, w: jnp.sum(_call(name, x, w, SIZES) * c), (0, 1))(x, w)
    np.testing.assert_array_equal(got_dx, dx)
    np.testing.assert_array_equal(got_dw, dw)


def test_jit_with_traced_group_sizes_and_a_state_update():
    x, w, _ = _operands(11)
    meta = fp8jax.init_fp8_meta(DELAYED, n_roles=3 * G)

    @jax.jit
    def step(w, meta, sizes):
        def loss(w, p):
            return jnp.sum(fp8jax.grouped_dense(x, w, sizes, None, meta, DELAYED, probe=p) ** 2)

        (gw, seen) = jax.grad(loss, (0, 1))(w, jnp.zeros((3 * G,), jnp.float32))
        return gw, fp8jax.update_fp8_meta(meta, seen, DELAYED)

    gw, new = step(w, meta, SIZES)
    assert gw.shape == w.shape and np.isfinite(np.asarray(gw)).all()
    scale = np.asarray(new.scale).reshape(G, 3)
    assert scale[1, 0] == 1.0 and scale[1, 2] == 1.0  # no token: the old scale is kept
    assert (scale[[0, 2, 3], 0] != 1.0).all()


@pytest.mark.parametrize(
    ("args", "error", "match"),
    [
        (dict(x=jnp.ones((T, K), jnp.int32)), TypeError, "x must be a floating-point"),
        (dict(w=jnp.ones((G, K + 1, N))), ValueError, "kernel must be"),
        (dict(sizes=jnp.asarray([9, 0, 17], jnp.int32)), ValueError, "one entry per group"),
        (dict(sizes=jnp.asarray([9, 0, 17, 60], jnp.int32)), ValueError, "sum to 86"),
        (dict(sizes=jnp.asarray([9, 0, 17, 6], jnp.uint8)), TypeError, "group_sizes must be int32"),
        (dict(b=jnp.ones((G, N + 1))), ValueError, "bias must be"),
        (dict(recipe="delayed"), ValueError, "fp8_meta"),
    ],
)
def test_bad_arguments_are_named(args, error, match):
    x, w, _ = _operands()
    kw = dict(x=x, w=w, sizes=SIZES, b=None, recipe="current")
    kw.update(args)
    fn = lambda: fp8jax.grouped_dense(
        kw["x"], kw["w"], kw["sizes"], kw["b"], None, RECIPES[kw["recipe"]]
    )
    with pytest.raises((error, TypeError), match=match):
        fn()


@pytest.mark.parametrize("name", ["off", "current"])
def test_traced_negative_group_sizes_read_as_zero_fp8_on_and_off(name):
    """Was: FP8 off (plain ragged_dot, which shifts the later groups' rows) and on (clamped)
    disagreed; both now read a negative size as 0, the running sum capped at the rows."""
    x, w = rand((8, 16), 3), rand((2, 16, 8), 4)
    sizes = jnp.asarray([-2, 6], jnp.int32)
    recipe = None if name == "off" else fp8jax.Float8CurrentScaling()
    got = jax.jit(
        lambda s: fp8jax.grouped_dense(x, w, s, recipe=recipe, enabled=recipe is not None)
    )(sizes)
    want = fp8jax.grouped_dense(x, w, jnp.asarray([0, 6], jnp.int32), recipe=recipe,
                                enabled=recipe is not None)  # fmt: skip
    np.testing.assert_array_equal(got, want)
    assert not np.any(np.asarray(got)[6:])


@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("n", [8, 32])
def test_a_gated_pair_equals_its_concatenated_kernel(name, n):
    """The pair ``(wi_0, wi_1)`` gives the values and gradients of ``concatenate([wi_0, wi_1],
    -1)``, bit for bit, under every recipe; ``n = 8`` puts both halves in one block of MXFP8's
    1 x 32 along the dgrad's contraction (was: cast apart into two, a scale grid the GEMM
    refused)."""
    x = rand((T, K), 1)
    w0, w1 = rand((G, K, n), 2, 0.2), rand((G, K, n), 3, 0.2)
    c = rand((T, 2 * n), 4, 1e-3)
    recipe = RECIPES[name]
    meta = _meta_for(x, jnp.concatenate([w0, w1], -1), c, SIZES) if name == "delayed" else None
    probe = jnp.zeros((3 * G,), jnp.float32)

    def loss(x, w0, w1, p, pair):
        kernel = (w0, w1) if pair else jnp.concatenate([w0, w1], axis=-1)
        return jnp.sum(fp8jax.grouped_dense(x, kernel, SIZES, None, meta, recipe, probe=p) * c)

    grad = lambda pair: jax.jit(jax.value_and_grad(functools.partial(loss, pair=pair),
                                                   (0, 1, 2, 3)))(x, w0, w1, probe)  # fmt: skip
    for g, h in zip(jax.tree.leaves(grad(True)), jax.tree.leaves(grad(False)), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(h))


@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("pair", [False, True])
def test_the_tensor_core_option_keeps_the_cpu_numbers(name, pair):
    """``gemm_options(grouped_tensor_cores=True)`` lays the wgrad operands out as the tensor-core
    path reads them (transpose_padded, the segment-block cast's padded layout) and the GEMMs
    gather them back where that path does not run: on CPU the values and gradients are those
    without the option, bit for bit, under every recipe, for a kernel and a gated pair."""
    x, w, b = _operands()
    w1 = rand((G, K, N), 9, 0.2)
    kernel = (w, w1) if pair else w
    c = rand((T, 2 * N if pair else N), 4, 1e-3)
    meta = _meta_for(x, w, c[:, :N], SIZES) if name == "delayed" else None

    probe = jnp.zeros((3 * G,), jnp.float32)

    def loss(x, kernel, b, p):
        b = jnp.concatenate([b, b], axis=-1) if pair else b
        y = fp8jax.grouped_dense(x, kernel, SIZES, b, meta, RECIPES[name], probe=p)
        return jnp.sum(y * c)

    want = jax.jit(jax.value_and_grad(loss, (0, 1, 2, 3)))(x, kernel, b, probe)
    with fp8jax.ops.gemm_options(grouped_tensor_cores=True):
        got = jax.jit(jax.value_and_grad(loss, (0, 1, 2, 3)))(x, kernel, b, probe)
    for g, h in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(h))
