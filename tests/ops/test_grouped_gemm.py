"""fp8jax.ops.grouped_gemm: the ragged grouped FP8 GEMM (``jax.lax.ragged_dot`` semantics) under
every recipe's scales, in both forms (``"rows"``: forward and dgrad; ``"contracting"``: wgrad).

Against a float64 numpy oracle (per group, the dequantized operands' products summed exactly,
then the scales): within the float32 accumulation bound ``(K + 2) 2**-24 sum |a b|`` (float32
outputs). Bit for bit: the kernel path against its own numerics written in numpy float32 (each
product rounded, then added in the contraction's order: cpp/common/grouped_gemm.h), on random
codes under every kind of scale; rows past the sum and empty groups are 0; the kernel and the
reference give the same bits where the sums are exact; one group holding every row equals the
dense GEMM. Edge shapes: empty groups, one group with every row, sizes and dims that are not
multiples of 8/32/128, rows past the sum. The casts of the ragged operands are
tests/ops/test_grouped_scaling.py's.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _implementations import implementation_fixture, only, pytest_generate_tests  # noqa: F401
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


def _ordered_rows(a, b, sizes, scale=None):
    """The kernels' numerics in numpy float32 (cpp/common/grouped_gemm.h), rows form: each output
    the products rounded to float32 and added from +0, the contraction index ascending, then
    (per-group scales) times ``scale[g]``, the float32 product of the group's two scales. ``a [M,
    K]``, ``b [G, N, K]``: the operands' float32 values; rows past the sum are +0."""
    out = np.zeros((a.shape[0], b.shape[1]), np.float32)
    start = 0
    for g, s in enumerate(sizes):
        acc = np.zeros((s, b.shape[1]), np.float32)
        for t in range(a.shape[1]):
            acc = acc + np.outer(a[start : start + s, t], b[g, :, t])
        out[start : start + s] = acc if scale is None else acc * scale[g]
        start += s
    return out


def _ordered_contracting(a, b, sizes, scale=None):
    """The same, contracting form: ``a [K, M]``, ``b [N, M]`` -> ``[G, K, N]``, group g's sum
    over its own columns of M (an empty group's is +0, then scaled)."""
    out = np.zeros((len(sizes), a.shape[0], b.shape[0]), np.float32)
    start = 0
    for g, s in enumerate(sizes):
        acc = np.zeros(out.shape[1:], np.float32)
        for t in range(start, start + s):
            acc = acc + np.outer(a[:, t], b[:, t])
        out[g] = acc if scale is None else acc * scale[g]
        start += s
    return out


def _f32(x):
    return np.asarray(jnp.asarray(x, jnp.float32))


def _group_scales(sa, sb):
    return _f32(sa) * _f32(sb)  # float32 products, as the kernels form them


def _assert_kernel_bits(implementation, got, want):
    """The kernel path (CPU or CUDA kernel) gives its numerics' bits, signs of zeros included;
    the ``"xla"`` path (``ragged_dot``) sums in its own order, checked by the bound only."""
    if implementation == "kernel":
        np.testing.assert_array_equal(np.asarray(got).view(np.uint32), want.view(np.uint32))


def _within_f32_bound(got, want, mag, terms):
    got = np.asarray(got, np.float64)
    bound = (terms + 2) * 2.0**-24 * mag + 1e-30
    assert np.all(np.abs(got - want) <= bound), np.max(np.abs(got - want) - bound)


def _f64(x):
    return np.asarray(jnp.asarray(x, jnp.float32), np.float64)


@pytest.mark.parametrize("sizes", list(SIZES))
@pytest.mark.parametrize("dtypes", [(E4M3, E4M3), (E5M2, E4M3), (E4M3, E5M2)])
def test_rows_per_group_scales_against_the_oracle(sizes, dtypes, implementation):
    r = np.random.default_rng(0)
    g = len(SIZES[sizes])
    a, b = fp8_codes(r, (M, K), dtypes[0]), fp8_codes(r, (g, N, K), dtypes[1])
    sa = jnp.asarray(2.0 ** r.integers(-3, 3, g) * 1.37, jnp.float32)  # not powers of two
    sb = jnp.asarray(r.uniform(0.5, 2.0, g), jnp.float32)
    got = ops.grouped_gemm(a, b, _sizes(sizes), sa, sb, out_dtype=F32)
    want, mag = _oracle_rows(_f64(a), _f64(b), SIZES[sizes], _f64(sa), _f64(sb))
    _within_f32_bound(got, want, mag, K)
    ordered = _ordered_rows(_f32(a), _f32(b), SIZES[sizes], _group_scales(sa, sb))
    _assert_kernel_bits(implementation, got, ordered)
    past = sum(SIZES[sizes])
    assert np.all(np.asarray(got)[past:] == 0) and not np.signbit(np.asarray(got)[past:]).any()


@pytest.mark.parametrize("sizes", list(SIZES))
def test_contracting_per_group_scales_against_the_oracle(sizes, implementation):
    r = np.random.default_rng(1)
    g = len(SIZES[sizes])
    a, b = fp8_codes(r, (K, M), E4M3), fp8_codes(r, (N, M), E5M2)
    sa, sb = (jnp.asarray(r.uniform(0.25, 4.0, g), jnp.float32) for _ in range(2))
    got = ops.grouped_gemm(a, b, _sizes(sizes), sa, sb, ragged="contracting", out_dtype=F32)
    assert got.shape == (g, K, N)
    want, mag = _oracle_contracting(_f64(a), _f64(b), SIZES[sizes], _f64(sa), _f64(sb))
    _within_f32_bound(got, want, mag, M)
    ordered = _ordered_contracting(_f32(a), _f32(b), SIZES[sizes], _group_scales(sa, sb))
    _assert_kernel_bits(implementation, got, ordered)
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
def test_rows_block_scaled_against_the_oracle(combo, sizes, implementation):
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
    ordered = _ordered_rows(a_deq.astype(np.float32), b_deq.astype(np.float32), SIZES[sizes])
    _assert_kernel_bits(implementation, got, ordered)


@pytest.mark.parametrize("width", [128, 32])
@pytest.mark.parametrize("sizes", ["uneven", "ragged", "one-holds-all"])
def test_contracting_segment_blocks_against_the_oracle(width, sizes, implementation):
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
    ordered = _ordered_contracting(a_deq.astype(np.float32), b_deq.astype(np.float32), SIZES[sizes])
    _assert_kernel_bits(implementation, got, ordered)


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


def test_traced_sizes_past_the_rows_are_clamped():
    """Sizes summing past the rows, and negative ones, known only on the device: the running sum
    stops at the last row and a negative size counts as 0, in the kernels as in the reference."""
    r = np.random.default_rng(6)
    a, b = exact_codes(r, (8, 16), E4M3), exact_codes(r, (2, 4, 16), E4M3)
    one = jnp.ones((2,), F32)
    f = jax.jit(lambda gs: ops.grouped_gemm(a, b, gs, one, one, out_dtype=F32))
    sizes = lambda *v: jnp.asarray(v, jnp.int32)
    np.testing.assert_array_equal(f(sizes(5, 9)), f(sizes(5, 3)))
    np.testing.assert_array_equal(f(sizes(-2, 4)), f(sizes(0, 4)))
    ct = jax.jit(lambda gs: ops.grouped_gemm(a, b[0], gs, one, one, ragged="contracting"))
    np.testing.assert_array_equal(ct(sizes(3, 20)), ct(sizes(3, 13)))


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
    """Traced sizes cannot be checked while tracing: the call traces (the kernels clamp them on
    the device, as the reference does)."""
    a, b, _, sa, sb = _args()
    jax.jit(lambda gs: ops.grouped_gemm(a, b, gs, sa, sb)).lower(jnp.asarray([5, 9], jnp.int32))


# ------------------------------------------------------------- the CUDA kernel, run on the host

HOST_CASES = {  # (form, sizes, scales, M, N)
    "rows-uneven-group": ("rows", SIZES["uneven"], "group", M, N),
    "rows-ragged-1x128": ("rows", SIZES["ragged"], "1x128", M, N),
    "rows-one-holds-all-mxfp8": ("rows", SIZES["one-holds-all"], "mxfp8", M, N),
    "rows-all-empty-group": ("rows", SIZES["all-empty"], "group", M, N),
    "contracting-uneven-1x128": ("contracting", SIZES["uneven"], "1x128", M, N),
    "contracting-ragged-group": ("contracting", SIZES["ragged"], "group", M, N),
    "contracting-one-holds-all-mxfp8": ("contracting", SIZES["one-holds-all"], "mxfp8", M, N),
    "contracting-all-empty-mxfp8": ("contracting", SIZES["all-empty"], "mxfp8", M, N),
    # several tiles a group (64 rows), two column tiles, rows past the sum
    "rows-tiles-group": ("rows", [7, 0, 110, 0], "group", 150, 80),
    "contracting-tiles-1x128": ("contracting", [7, 0, 110, 0], "1x128", 150, 80),
}


def _host_case(form, sizes, scales, m, n):
    """Arguments and keywords of one grouped GEMM: random codes (their sums are not exact)."""
    r = np.random.default_rng(11)
    g, gs = len(sizes), jnp.asarray(sizes, jnp.int32)
    kw = dict(ragged=form, out_dtype=BF16 if scales == "group" else F32)
    if form == "rows":
        if scales == "group":
            a, b = fp8_codes(r, (m, K), E4M3), fp8_codes(r, (g, n, K), E5M2)
            sa, sb = (jnp.asarray(r.uniform(0.5, 2.0, g), F32) for _ in range(2))
            return (a, b, gs, sa, sb), kw
        x, w = normal(r, (m, K), F32, 3.0), normal(r, (g, n, K), F32)
        a_block, b_block, mx = BLOCKS["1x128-128x128" if scales == "1x128" else "mxfp8"]
        a, sa = _block_cast(x, a_block, mx)
        b, sb = jax.vmap(lambda v: _block_cast(v, b_block, mx))(w)
        return (a, b, gs, sa, sb), dict(kw, a_block=a_block, b_block=b_block)
    if scales == "group":
        a, b = fp8_codes(r, (K, m), E4M3), fp8_codes(r, (n, m), E5M2)
        sa, sb = (jnp.asarray(r.uniform(0.5, 2.0, g), F32) for _ in range(2))
        return (a, b, gs, sa, sb), kw
    xt, gt = normal(r, (K, m), F32), normal(r, (n, m), F32, 1e-2)
    width, mx = (128, False) if scales == "1x128" else (32, True)
    a, sa = ops.segment_block_quantize(xt, gs, E4M3, (1, width), mxfp8=mx)
    b, sb = ops.segment_block_quantize(gt, gs, E5M2, (1, width), mxfp8=mx)
    return (a, b, gs, sa, sb), dict(kw, a_block=(1, width), b_block=(1, width))


@only("kernel")
@pytest.mark.parametrize("case", list(HOST_CASES))
def test_cuda_kernel_on_the_host_gives_the_cpu_kernels_bits(case, monkeypatch):
    """The CUDA kernel's body, run on the host (tests/ops/_host_cuda.py), against the CPU kernel:
    the same bits on random codes (the same products summed in the same order), with no shared
    memory bank conflict; threads in lane order and in reverse order. (_host_cuda is imported
    here, not at the top: tests/ops/_samples.py imports this file for its sample, also in builds
    without the test-only extensions, such as CI's oldest-JAX leg.)"""
    import _host_cuda

    if _host_cuda.EXT is None:
        pytest.skip("no CUDA toolkit headers to build fp8jax._fp8jax_host_cuda with")
    ext = _host_cuda.EXT
    with jax.default_device(_host_cuda.CPU):
        args, kw = _host_case(*HOST_CASES[case])
        args = _host_cuda.to_cpu(args)
        cpu = ops.grouped_gemm(*args, **kw, implementation="kernel")
        for reverse in (False, True):
            ext.reset_stats()
            with _host_cuda.on_host_cuda(monkeypatch, reverse=reverse, banks=not reverse):
                host = ops.grouped_gemm(*args, **kw, implementation="kernel")
                host = jax.block_until_ready(host)
            stats = ext.stats()
            assert stats["launches"] == 1
            assert stats["shared_wavefronts"] == stats["shared_ideal"], stats
            assert_matches(host, cpu, True)


# ------------------------------------------------------------------ the conformance sample

# Kernel vs reference (XLA's ragged_dot) on random codes: both sum float32 products, in other
# orders (each kernel t ascending, XLA its dot's blocking), so a float32 output may differ by the
# rounding of a few adds, and a bfloat16 one by one step where a sum lies near a rounding
# boundary. The samples' sums are at most about 2**14 (64 products of codes up to 2**4 x 8, times
# scales up to 4); the float32 accumulation bound (K + 2) 2**-24 sum |a b| is then below 2**-4.
GROUPED_CLOSE = {"ulps": 1, "atol": 2.0**-4}


def exact_codes(rng, shape, dtype):
    """Integer codes in [-8, 8] (exact in E4M3 and E5M2): their products' float32 sums over at
    most 2**11 terms are exact in any order, so the kernels give the reference's bits."""
    return jnp.asarray(rng.integers(-8, 9, shape).astype(np.float32), dtype)


def pow2_grid(rng, shape, e8m0=False):
    """A scale grid of powers of two in [1/4, 4] (float32, or E8M0): products of dequantized
    integer codes stay multiples of 2**-4 below 2**10, so their sums stay exact too."""
    e = rng.integers(-2, 3, shape)
    if e8m0:
        return jax.lax.bitcast_convert_type(jnp.asarray(e + 127, jnp.uint8), jnp.float8_e8m0fnu)
    return jnp.asarray(2.0**e, F32)


def _sample(key):
    r = np.random.default_rng(key)
    m, k, n, g = 16, 64, 24, 3
    gs = jnp.asarray([5, 0, 9], jnp.int32)  # an empty group, rows past the sum
    a, b = fp8_codes(r, (m, k), E4M3), fp8_codes(r, (g, n, k), E4M3)
    sa, sb = (jnp.asarray(r.uniform(0.5, 2.0, g), F32) for _ in range(2))
    ct_a, ct_b = fp8_codes(r, (m, 40), E4M3), fp8_codes(r, (n, 40), E5M2)
    gs_c = jnp.asarray([13, 0, 20], jnp.int32)  # columns past the sum, an empty group
    # exact sums: integer codes, powers of two as block scales
    ea, eb5 = exact_codes(r, (m, 160), E4M3), exact_codes(r, (g, n, 160), E5M2)
    eb = exact_codes(r, (g, n, 160), E4M3)
    all_rows = jnp.asarray([0, m, 0], jnp.int32)  # one group holds every row
    eca, ecb = exact_codes(r, (m, 40), E5M2), exact_codes(r, (n, 40), E4M3)
    nb = segment_grid_size(40, g, 32)

    def sample(args, close=GROUPED_CLOSE, **kw):
        return Sample(
            ops.grouped_gemm, args, kw, close=close, gpu_close=GEMM_GPU_CLOSE, integer=INT
        )

    return {
        "rows-e4m3-bf16": sample((a, b, gs, sa, sb)),
        "contracting-e4m3xe5m2": sample(
            (ct_a, ct_b, gs_c, sa, sb), ragged="contracting", out_dtype=F32
        ),
        "rows-exact-e4m3xe5m2-f32-split": sample(
            (ea, eb5, gs, sa, sb), None, out_dtype=F32, accumulate="split"
        ),
        "rows-exact-1x128-128x128": sample(
            (ea, eb, gs, pow2_grid(r, (m, 2)), pow2_grid(r, (g, 1, 2))),
            None,
            a_block=(1, 128),
            b_block=(128, 128),
        ),
        "rows-exact-mxfp8-one-group": sample(
            (ea, eb, all_rows, pow2_grid(r, (m, 5), True), pow2_grid(r, (g, n, 5), True)),
            None,
            a_block=(1, 32),
            b_block=(1, 32),
            out_dtype=F32,
        ),
        "contracting-exact-f16": sample(
            (eca, ecb, gs_c, sa, sb), None, ragged="contracting", out_dtype=jnp.float16
        ),
        "contracting-exact-1x32-segments": sample(
            (eca, ecb, gs_c, pow2_grid(r, (m, nb)), pow2_grid(r, (n, nb))),
            None,
            ragged="contracting",
            a_block=(1, 32),
            b_block=(1, 32),
            out_dtype=F32,
        ),
        "contracting-exact-mxfp8-segments": sample(
            (eca, ecb, gs_c, pow2_grid(r, (m, nb), True), pow2_grid(r, (n, nb), True)),
            None,
            ragged="contracting",
            a_block=(1, 32),
            b_block=(1, 32),
        ),
    }


INT = ("group_sizes",)
SAMPLES = {"grouped_gemm": _sample}
