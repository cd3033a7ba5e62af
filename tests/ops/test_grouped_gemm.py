"""fp8jax.ops.grouped_gemm: the ragged grouped FP8 GEMM (``jax.lax.ragged_dot`` semantics) under
every recipe's scales, in both forms (``"rows"``: forward and dgrad; ``"contracting"``: wgrad).

Against a float64 numpy oracle (per group, the dequantized operands' products summed exactly,
then the scales): within the float32 accumulation bound ``(K + 2) 2**-24 sum |a b|`` (float32
outputs). Exactly: rows past the sum and empty groups are 0; the kernel and the reference give
the same bits on CPU; one group holding every row equals the dense GEMM. Edge shapes: empty
groups, one group with every row, sizes and dims that are not multiples of 8/32/128, rows past
the sum. The casts of the ragged operands are tests/ops/test_grouped_scaling.py's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _implementations import implementation_fixture, pytest_generate_tests  # noqa: F401
from _samples import BF16, E4M3, E5M2, F32, GEMM_GPU_CLOSE, Sample, fp8_codes
from _shared import normal
from _values import assert_matches

from fp8jax import ops
from fp8jax.ops.block.grouped_scaling import segment_grid_size

SIZES = {  # group sizes over M = 45 rows
    "uneven": [7, 0, 30, 0],  # empty groups, rows past the sum (37 < 45)
    "one-holds-all": [0, 45, 0, 0],
    "all-empty": [0, 0, 0, 0],
    "ragged": [1, 13, 2, 29],  # sums to M; no size a multiple of 8
}
M, K, N = 45, 100, 24  # K: not a multiple of 32 or 128


def _sizes(name):
    return jnp.asarray(SIZES[name], jnp.int32)


def _oracle_rows(a, b, sizes, sa, sb):
    """float64 ``out[M, N]`` and ``sum |a b|`` per element (for the bound), dequantized
    operands ``a [M, K]``, ``b [G, N, K]`` (numpy float64), per-group scales ``sa``, ``sb``."""
    out = np.zeros((a.shape[0], b.shape[1]))
    mag = np.zeros_like(out)
    start = 0
    for g, s in enumerate(sizes):
        rows = slice(start, start + s)
        out[rows] = a[rows] @ b[g].T * sa[g] * sb[g]
        mag[rows] = np.abs(a[rows]) @ np.abs(b[g]).T * abs(sa[g] * sb[g])
        start += s
    return out, mag


def _oracle_contracting(a, b, sizes, sa, sb):
    g_n = len(sizes)
    out = np.zeros((g_n, a.shape[0], b.shape[0]))
    mag = np.zeros_like(out)
    start = 0
    for g, s in enumerate(sizes):
        cols = slice(start, start + s)
        out[g] = a[:, cols] @ b[:, cols].T * sa[g] * sb[g]
        mag[g] = np.abs(a[:, cols]) @ np.abs(b[:, cols]).T * abs(sa[g] * sb[g])
        start += s
    return out, mag


def _within_f32_bound(got, want, mag, terms):
    got = np.asarray(got, np.float64)
    bound = (terms + 2) * 2.0**-24 * mag + 1e-30
    assert np.all(np.abs(got - want) <= bound), np.max(np.abs(got - want) - bound)


def _f64(x):
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


@pytest.mark.parametrize("sizes", list(SIZES))
@pytest.mark.parametrize("dtypes", [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2)])
def test_rows_per_group_scales_against_the_oracle(sizes, dtypes):
    r = np.random.default_rng(0)
    g = len(SIZES[sizes])
    a, b = fp8_codes(r, (M, K), dtypes[0]), fp8_codes(r, (g, N, K), dtypes[1])
    sa = jnp.asarray(2.0 ** r.integers(-3, 3, g) * 1.37, jnp.float32)  # not powers of two
    sb = jnp.asarray(r.uniform(0.5, 2.0, g), jnp.float32)
    got = ops.grouped_gemm(a, b, _sizes(sizes), sa, sb, out_dtype=F32)
    want, mag = _oracle_rows(_f64(a), _f64(b), SIZES[sizes], _f64(sa), _f64(sb))
    _within_f32_bound(got, want, mag, K)
    past = sum(SIZES[sizes])
    assert np.all(np.asarray(got)[past:] == 0) and not np.signbit(np.asarray(got)[past:]).any()


@pytest.mark.parametrize("sizes", list(SIZES))
def test_contracting_per_group_scales_against_the_oracle(sizes):
    r = np.random.default_rng(1)
    g = len(SIZES[sizes])
    a, b = fp8_codes(r, (K, M), E4M3), fp8_codes(r, (N, M), E5M2)
    sa, sb = (jnp.asarray(r.uniform(0.25, 4.0, g), jnp.float32) for _ in range(2))
    got = ops.grouped_gemm(a, b, _sizes(sizes), sa, sb, ragged="contracting", out_dtype=F32)
    assert got.shape == (g, K, N)
    want, mag = _oracle_contracting(_f64(a), _f64(b), SIZES[sizes], _f64(sa), _f64(sb))
    _within_f32_bound(got, want, mag, M)
    for i, s in enumerate(SIZES[sizes]):
        if s == 0:
            assert np.all(np.asarray(got[i]) == 0)


BLOCKS = {
    "1x128-128x128": ((1, 128), (128, 128), False),
    "1x128-1x128": ((1, 128), (1, 128), False),
    "mxfp8": ((1, 32), (1, 32), True),
    "mxfp8-32x32": ((1, 32), (32, 32), True),
}


def _block_cast(x, block, mx, dtype=E4M3):
    if mx:
        return ops.mxfp8_quantize(x, dtype, block)
    return ops.block_quantize(x, dtype, block, power_2_scale=False)


@pytest.mark.parametrize("combo", list(BLOCKS))
@pytest.mark.parametrize("sizes", ["uneven", "ragged"])
def test_rows_block_scaled_against_the_oracle(combo, sizes):
    a_block, b_block, mx = BLOCKS[combo]
    r = np.random.default_rng(2)
    g = len(SIZES[sizes])
    x = jnp.asarray(r.standard_normal((M, K)) * np.exp(r.standard_normal((M, 1))), F32)
    w = normal(r, (g, N, K), F32, 0.1)
    a, sa = _block_cast(x, a_block, mx)
    qs = [_block_cast(w[i], b_block, mx) for i in range(g)]
    b, sb = jnp.stack([q for q, _ in qs]), jnp.stack([s for _, s in qs])
    got = ops.grouped_gemm(
        a, b, _sizes(sizes), sa, sb, a_block=a_block, b_block=b_block, out_dtype=F32
    )
    a_deq = _f64(ops.block_dequantize(a, sa, a_block))
    b_deq = np.stack([_f64(ops.block_dequantize(b[i], sb[i], b_block)) for i in range(g)])
    ones = np.ones(g)
    want, mag = _oracle_rows(a_deq, b_deq, SIZES[sizes], ones, ones)
    _within_f32_bound(got, want, mag, K)


@pytest.mark.parametrize("width", [128, 32])
@pytest.mark.parametrize("sizes", ["uneven", "ragged", "one-holds-all"])
def test_contracting_segment_blocks_against_the_oracle(width, sizes):
    mx = width == 32
    r = np.random.default_rng(3)
    g = len(SIZES[sizes])
    gs = _sizes(sizes)
    xt, gt = normal(r, (K, M)), normal(r, (N, M), F32, 1e-3)
    kw = dict(mxfp8=mx, power_2_scale=True)
    a, sa = ops.segment_block_quantize(xt, gs, E4M3, (1, width), **kw)
    b, sb = ops.segment_block_quantize(gt, gs, E5M2, (1, width), **kw)
    assert sa.shape == (K, segment_grid_size(M, g, width))
    got = ops.grouped_gemm(
        a,
        b,
        gs,
        sa,
        sb,
        ragged="contracting",
        a_block=(1, width),
        b_block=(1, width),
        out_dtype=F32,
    )
    a_deq = _f64(ops.segment_block_dequantize(a, sa, gs, (1, width)))
    b_deq = _f64(ops.segment_block_dequantize(b, sb, gs, (1, width)))
    ones = np.ones(g)
    want, mag = _oracle_contracting(a_deq, b_deq, SIZES[sizes], ones, ones)
    _within_f32_bound(got, want, mag, M)


def test_one_group_holding_every_row_is_the_dense_gemm():
    r = np.random.default_rng(4)
    a, b = fp8_codes(r, (M, K), E4M3), fp8_codes(r, (3, N, K), E4M3)
    s = jnp.asarray([0.5, 0.25, 2.0], F32)
    gs = jnp.asarray([0, M, 0], jnp.int32)
    got = ops.grouped_gemm(a, b, gs, s, s, out_dtype=BF16)
    want = ops.gemm(a, b[1], s[1], s[1], out_dtype=BF16)
    exact = jax.default_backend() == "cpu"
    assert_matches(got, want, exact, **({} if exact else GEMM_GPU_CLOSE))


def test_scalar_scales_apply_to_every_group():
    r = np.random.default_rng(5)
    a, b = fp8_codes(r, (16, 32), E4M3), fp8_codes(r, (2, 8, 32), E4M3)
    gs = jnp.asarray([9, 5], jnp.int32)
    one = ops.grouped_gemm(a, b, gs, jnp.float32(0.5), jnp.full((1,), 2.0, F32), out_dtype=F32)
    per = ops.grouped_gemm(
        a, b, gs, jnp.full((2,), 0.5, F32), jnp.full((2,), 2.0, F32), out_dtype=F32
    )
    np.testing.assert_array_equal(one, per)


def test_traced_sizes_past_the_rows_are_clamped_by_the_reference():
    """The reference's answer for sizes summing past the rows (the kernels refuse them): the
    running sum stops at the last row."""
    r = np.random.default_rng(6)
    a, b = fp8_codes(r, (8, 16), E4M3), fp8_codes(r, (2, 4, 16), E4M3)
    one = jnp.ones((2,), F32)
    f = jax.jit(lambda gs: ops.grouped_gemm_reference(a, b, gs, one, one, out_dtype=F32))
    np.testing.assert_array_equal(
        f(jnp.asarray([5, 9], jnp.int32)), f(jnp.asarray([5, 3], jnp.int32))
    )


# ------------------------------------------------------------------ refusals


def _args():
    r = np.random.default_rng(7)
    a, b = fp8_codes(r, (8, 16), E4M3), fp8_codes(r, (2, 4, 16), E4M3)
    return a, b, jnp.asarray([3, 4], jnp.int32), jnp.ones((2,), F32), jnp.ones((2,), F32)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        (dict(group_sizes=jnp.asarray([5, 4], jnp.int32)), ValueError, "group_sizes sum to 9"),
        (dict(group_sizes=jnp.asarray([-1, 4], jnp.int32)), ValueError, "group_sizes must be >= 0"),
        (dict(group_sizes=jnp.asarray([3, 4], jnp.int16)), TypeError, "group_sizes must be int32"),
        (dict(group_sizes=jnp.asarray([3, 4, 0], jnp.int32)), ValueError, "one entry per group"),
        (dict(a=jnp.ones((8, 16), BF16)), TypeError, "a must be float8"),
        (dict(b=jnp.ones((2, 4, 15), E4M3)), ValueError, "same K"),
        (dict(a_scale_inv=jnp.ones((3,), F32)), ValueError, "a_scale_inv must be float32"),
        (dict(ragged="cols"), ValueError, "ragged must be 'rows' or 'contracting'"),
        (dict(a_block=(1, 128)), ValueError, "both a_block and b_block"),
        (dict(a_block=(128, 128), b_block=(128, 128)), ValueError, "a_block must be one row"),
        (dict(out_dtype=jnp.int8), TypeError, "out_dtype"),
        (dict(accumulate="slow"), ValueError, "accumulate"),
    ],
)
def test_bad_arguments_are_named(change, error, match):
    a, b, gs, sa, sb = _args()
    kw = dict(a=a, b=b, group_sizes=gs, a_scale_inv=sa, b_scale_inv=sb)
    kw.update(change)
    with pytest.raises(error, match=match):
        ops.grouped_gemm(**kw)


def test_traced_sizes_are_checked_by_no_one_at_trace_time():
    """Traced sizes cannot be checked while tracing: the call traces (the kernel checks them
    on the device)."""
    a, b, _, sa, sb = _args()
    jax.jit(lambda gs: ops.grouped_gemm(a, b, gs, sa, sb)).lower(jnp.asarray([5, 9], jnp.int32))


# ------------------------------------------------------------------ the conformance sample


def _sample(key):
    r = np.random.default_rng(key)
    m, k, n, g = 16, 64, 24, 3
    gs = jnp.asarray([5, 0, 9], jnp.int32)  # an empty group, rows past the sum
    a, b = fp8_codes(r, (m, k), E4M3), fp8_codes(r, (g, n, k), E4M3)
    b5 = fp8_codes(r, (g, n, k), E5M2)
    sa, sb = (jnp.asarray(r.uniform(0.5, 2.0, g), F32) for _ in range(2))
    x = normal(r, (m, 160), F32)
    xq, xs = ops.block_quantize(x, E4M3, (1, 128))
    wq, ws = jax.vmap(lambda v: ops.block_quantize(v, E4M3, (128, 128)))(
        normal(r, (g, n, 160), F32)
    )
    mq, ms = ops.mxfp8_quantize(x, E4M3)
    mwq, mws = ops.mxfp8_quantize(normal(r, (g, n, 160), F32), E4M3)
    ct_a, ct_b = fp8_codes(r, (m, 40), E4M3), fp8_codes(r, (n, 40), E5M2)
    gs_c = jnp.asarray([13, 0, 20], jnp.int32)
    seg_a = ops.segment_block_quantize(normal(r, (m, 40), F32), gs_c, E4M3, (1, 32), mxfp8=True)
    seg_b = ops.segment_block_quantize(normal(r, (n, 40), F32), gs_c, E5M2, (1, 32), mxfp8=True)

    def sample(args, **kw):
        return Sample(ops.grouped_gemm, args, kw, gpu_close=GEMM_GPU_CLOSE, integer=INT)

    return {
        "rows-e4m3-bf16": sample((a, b, gs, sa, sb)),
        "rows-e4m3xe5m2-f32-split": sample((a, b5, gs, sa, sb), out_dtype=F32, accumulate="split"),
        "rows-1x128-128x128": sample((xq, wq, gs, xs, ws), a_block=(1, 128), b_block=(128, 128)),
        "rows-mxfp8": sample(
            (mq, mwq, gs, ms, mws), a_block=(1, 32), b_block=(1, 32), out_dtype=F32
        ),
        "contracting-e4m3xe5m2": sample(
            (ct_a, ct_b, gs_c, sa, sb), ragged="contracting", out_dtype=F32
        ),
        "contracting-mxfp8-segments": sample(
            (seg_a[0], seg_b[0], gs_c, seg_a[1], seg_b[1]),
            ragged="contracting",
            a_block=(1, 32),
            b_block=(1, 32),
        ),
    }


INT = ("group_sizes",)
SAMPLES = {"grouped_gemm": _sample}
