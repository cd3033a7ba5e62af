"""fp8jax.ops.block.block_scaling: the block scale rules against numpy oracles written from
TransformerEngine's and cuBLAS's definitions (frexp/ldexp, not bit masks), the block layouts
and ragged edges, the transposed copies, and the block-scaled GEMM against a float64 oracle
within the FP8 rounding bound."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _implementations import DIV_ULPS, reference_bits_promised
from _samples import F32_SCALE_GPU_CLOSE, M, Sample
from _shared import rand
from _values import assert_matches

from fp8jax.ops import quantize_reference
from fp8jax.ops.block import block_scaling as bs

E4M3, E5M2 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)
_quantize_reference = jax.jit(quantize_reference, static_argnums=2)
FMAX = {E4M3: 448.0, E5M2: 57344.0}


def _amaxes() -> np.ndarray:
    r = np.random.default_rng(0)
    v = np.concatenate([
        np.exp(r.uniform(-90, 88, 4000)),  # every binade float32 has
        [0.0, np.inf, np.nan, 1e-45, 1e-38, 2e-36, 448.0, 447.99, 896.0, 3.0, 1.0, 2**-20],
        np.float32(448.0) * 2.0 ** np.arange(-20, 20),  # exact powers of two around fp8_max
    ])  # fmt: skip
    return v.astype(np.float32)


TINY = np.finfo(np.float32).smallest_normal


def _scale_oracle(amax, fmax, pow2, eps=0.0, input_max=None):
    input_max = np.finfo(np.float32).max if input_max is None else input_max
    out = []
    for a in amax.astype(np.float64):
        a = max(a, eps) if not np.isnan(a) else a
        if a < TINY or np.isinf(a) or np.isnan(a):  # subnormal amax: as 0 (fp8jax's rule)
            out.append(1.0)
            continue
        with np.errstate(over="ignore"):
            s = np.float32(fmax) / np.float32(a)  # float32 division, round to nearest
        if np.isinf(s):
            s = np.float32(input_max)
        if pow2:
            _, e = np.frexp(s)  # s = m * 2**e, m in [0.5, 1): floor(log2(s)) = e - 1
            s = np.ldexp(1.0, int(e) - 1)
        out.append(float(s))
    return np.array(out, np.float32)


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=str)
@pytest.mark.parametrize("pow2", [True, False], ids=["pow2", "f32"])
def test_block_scale_follows_the_te_rule(dtype, pow2):
    a = _amaxes()
    got = np.asarray(bs.block_scale(jnp.asarray(a), dtype, power_2_scale=pow2))
    # XLA:GPU's float32 division is within DIV_ULPS of the rounded quotient
    assert_matches(got, _scale_oracle(a, FMAX[dtype], pow2), reference_bits_promised("xla"),
                   ulps=DIV_ULPS)  # fmt: skip


def test_block_scale_epsilon_and_the_input_dtype_clamp():
    a = np.array([0.0, 1e-8, 1e-3, 1.0, 1e-39], np.float32)
    got = bs.block_scale(jnp.asarray(a), E4M3, power_2_scale=False, amax_epsilon=1e-3)
    np.testing.assert_array_equal(np.asarray(got), _scale_oracle(a, 448.0, False, eps=1e-3))
    # 448 / 1e-37 overflows: the largest finite value of the input's dtype (TE's value_for_inf)
    bf16_max = float(jnp.finfo(jnp.bfloat16).max)
    got = bs.block_scale(jnp.float32(1e-37), E4M3, power_2_scale=False, input_dtype=jnp.bfloat16)
    assert float(got) == np.float32(bf16_max)


def _e8m0_oracle(amax, fmax):
    # v = amax * rcp rounded to float32's 24 bits (float64 product, then the nearest float32 of
    # the same binade: no subnormal rounding, as fp8jax defines it)
    rcp = np.float64(np.float32(1) / np.float32(fmax))
    out = []
    for a in amax.astype(np.float64):
        x = a * rcp
        if not np.isnan(x) and np.isfinite(x) and x > 0:
            m, e = np.frexp(x)
            x = np.ldexp(np.round(m * 2.0**24) / 2.0**24, e)  # round half even to 24 bits
        if np.isnan(a):
            out.append(255)
        elif np.isinf(a):
            out.append(254)
        elif a < TINY:
            out.append(0)
        else:
            m, e = np.frexp(x)  # x = m * 2**e: ceil(log2(x)) = e - 1 if m == 0.5 else e
            c = e - 1 if m == 0.5 else e
            out.append(int(np.clip(c + 127, 0, 254)))
    return np.array(out, np.uint8)


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=str)
def test_e8m0_exponent_rounds_up_to_a_power_of_two(dtype):
    a = _amaxes()
    got = np.asarray(bs.e8m0_exponent(jnp.asarray(a), dtype))
    np.testing.assert_array_equal(got, _e8m0_oracle(a, FMAX[dtype]))
    # every finite amax fits: amax / scale <= fp8_max
    ok = np.isfinite(a) & (a > 1e-30)
    scale = np.ldexp(1.0, got[ok].astype(np.int64) - 127)
    assert (a[ok] / scale <= FMAX[dtype]).all()


def test_power_2_block_scales_equal_the_mxfp8_scales():
    """TE runs Float8BlockScaling on Blackwell through MXFP8: with power-of-two scales both
    rules give the same inverse scale for every normal amax."""
    a = _amaxes()
    a = a[np.isfinite(a) & (a > 1e-30)]
    sinv = 1.0 / np.asarray(bs.block_scale(jnp.asarray(a), E4M3), np.float64)
    e = np.asarray(bs.e8m0_exponent(jnp.asarray(a), E4M3)).astype(np.int64)
    np.testing.assert_array_equal(sinv, np.ldexp(1.0, e - 127))


@pytest.mark.parametrize(
    ("shape", "block", "grid"),
    [
        ((4, 256), bs.BLOCK_1D, (4, 2)),
        ((3, 300), bs.BLOCK_1D, (3, 3)),  # ragged: the last block holds 44
        ((2, 5, 130), bs.BLOCK_1D, (2, 5, 2)),  # leading dims are rows
        ((200, 300), bs.BLOCK_2D, (2, 3)),
        ((64, 96), bs.MXFP8_BLOCK, (64, 3)),
        ((64, 100), (32, 32), (2, 4)),
    ],
    ids=str,
)
def test_each_block_is_quantized_with_its_own_scale(shape, block, grid):
    x = rand(shape, seed=1) * jnp.exp(rand(shape, seed=2) * 3)  # a wide range of magnitudes
    mx = block[1] == 32
    q, sinv = bs.mxfp8_quantize(x, E4M3, block) if mx else bs.block_quantize(x, E4M3, block)
    assert q.shape == x.shape and q.dtype == E4M3 and sinv.shape == grid
    assert sinv.dtype == (jnp.float8_e8m0fnu if mx else jnp.float32)
    m = np.asarray(x).reshape(-1, shape[-1])
    qm = np.asarray(q).reshape(-1, shape[-1])
    s = np.asarray(bs._scale_values(sinv)).reshape(-1, grid[-1])
    for i in range(0, m.shape[0], block[0]):
        for j in range(0, m.shape[1], block[1]):
            blk = m[i : i + block[0], j : j + block[1]]
            si = s[i // block[0], j // block[1]]
            amax = np.abs(blk).max()
            if mx:
                assert si == np.ldexp(1.0, int(_e8m0_oracle(np.array([amax]), 448.0)[0]) - 127)
            else:
                assert si == 1.0 / _scale_oracle(np.array([amax], np.float32), 448.0, True)[0]
            want, _, _ = _quantize_reference(jnp.asarray(blk), jnp.float32(1.0 / si), E4M3)
            np.testing.assert_array_equal(
                qm[i : i + block[0], j : j + block[1]].view(np.uint8),
                np.asarray(want).view(np.uint8),
            )


def test_nan_and_inf_in_a_block():
    x = np.linspace(-3, 3, 256, dtype=np.float32).reshape(1, 256)
    x[0, 5] = np.nan  # left out of its block's amax
    x[0, 200] = np.inf  # its block's amax is inf: scale 1
    q, sinv = bs.block_quantize(jnp.asarray(x), E4M3)
    clean, clean_sinv = bs.block_quantize(jnp.asarray(np.nan_to_num(x[:, :128], nan=0.0)), E4M3)
    assert float(sinv[0, 0]) == float(clean_sinv[0, 0]) and float(sinv[0, 1]) == 1.0
    qf = np.asarray(q.astype(jnp.float32))
    assert np.isnan(qf[0, 5]) and np.isnan(qf[0, 200])  # E4M3 has no inf
    keep = np.arange(128) != 5
    np.testing.assert_array_equal(qf[0, :128][keep], np.asarray(clean.astype(jnp.float32))[0][keep])


def test_zero_blocks_and_empty_inputs():
    q, sinv = bs.block_quantize(jnp.zeros((2, 130)), E4M3)
    assert (np.asarray(sinv) == 1).all() and (np.asarray(q.astype(jnp.float32)) == 0).all()
    q, s = bs.mxfp8_quantize(jnp.zeros((1, 32)))
    assert np.asarray(jax.lax.bitcast_convert_type(s, jnp.uint8))[0, 0] == 0
    assert float(bs.block_dequantize(q, s, bs.MXFP8_BLOCK).sum()) == 0.0
    q, sinv = bs.block_quantize(jnp.zeros((0, 256)), E4M3)
    assert q.shape == (0, 256) and sinv.shape == (0, 2)


def test_one_row_blocks_transposed_copy_is_requantized():
    x = rand((256, 384), seed=3) * jnp.exp(rand((256, 384), seed=4) * 2)
    q, sinv, q_t, sinv_t = bs.block_cast_transpose(x, E4M3)
    assert (q.shape, sinv.shape, q_t.shape, sinv_t.shape) == (
        (256, 384),
        (256, 3),
        (384, 256),
        (384, 2),
    )
    want_q_t, want_sinv_t = bs.block_quantize(x.T, E4M3)
    np.testing.assert_array_equal(
        np.asarray(q_t).view(np.uint8), np.asarray(want_q_t).view(np.uint8)
    )
    np.testing.assert_array_equal(np.asarray(sinv_t), np.asarray(want_sinv_t))
    # not a transpose of q's bytes: the blocks run the other way
    assert (np.asarray(q_t).view(np.uint8) != np.asarray(q).T.view(np.uint8)).any()
    # both copies dequantize to x within the FP8 rounding bound
    for qq, ss, ref in ((q, sinv, x), (q_t, sinv_t, x.T)):
        _within_fp8_rounding(bs.block_dequantize(qq, ss, bs.BLOCK_1D), ref, ss, bs.BLOCK_1D)


@pytest.mark.parametrize("mx", [False, True], ids=["128x128", "mxfp8-32x32"])
def test_square_blocks_transposed_copy_is_a_transpose(mx):
    x = rand((200, 300), seed=5)
    if mx:
        q, s, q_t, s_t = bs.mxfp8_cast_transpose(x, E4M3, (32, 32))
    else:
        q, s, q_t, s_t = bs.block_cast_transpose(x, E4M3, bs.BLOCK_2D)
    np.testing.assert_array_equal(np.asarray(q_t).view(np.uint8), np.asarray(q).T.view(np.uint8))
    np.testing.assert_array_equal(
        np.asarray(bs._scale_values(s_t)), np.asarray(bs._scale_values(s)).T
    )


def test_mxfp8_one_row_blocks_both_layouts_from_high_precision():
    x = rand((64, 96), seed=6) * 100
    q, s, q_t, s_t = bs.mxfp8_cast_transpose(x)
    assert s.shape == (64, 3) and s_t.shape == (96, 2)
    want, _ = bs.mxfp8_quantize(x.T)
    np.testing.assert_array_equal(np.asarray(q_t).view(np.uint8), np.asarray(want).view(np.uint8))
    _within_fp8_rounding(bs.block_dequantize(q, s, bs.MXFP8_BLOCK), x, s, bs.MXFP8_BLOCK)


def _within_fp8_rounding(deq, ref, sinv, block, dtype=E4M3):
    """|deq - ref| <= u |ref| + half the smallest subnormal times the block's inverse scale,
    u = 2**-(mantissa bits + 1)."""
    u = 2.0**-4 if dtype == E4M3 else 2.0**-3
    tiny = 2.0**-10 if dtype == E4M3 else 2.0**-17
    ref = np.asarray(ref, np.float64).reshape(-1, np.shape(ref)[-1])
    s = np.asarray(bs._scale_values(sinv), np.float64).reshape(-1, sinv.shape[-1])
    s = np.repeat(np.repeat(s, block[0], 0), block[1], 1)[: ref.shape[0], : ref.shape[1]]
    err = np.abs(np.asarray(deq, np.float64).reshape(ref.shape) - ref)
    assert (err <= u * np.abs(ref) + tiny * s).all(), err.max()


@pytest.mark.parametrize(
    ("a_block", "b_block", "dtypes"),
    [
        (bs.BLOCK_1D, bs.BLOCK_2D, (E4M3, E4M3)),  # fprop: x (1 x 128), w (128 x 128)
        (bs.BLOCK_1D, bs.BLOCK_1D, (E4M3, E5M2)),  # wgrad under HYBRID: x_t, g_t
        (bs.MXFP8_BLOCK, bs.MXFP8_BLOCK, (E4M3, E4M3)),
    ],
    ids=["1d-2d", "1d-1d-hybrid", "mxfp8"],
)
def test_block_scaled_gemm_is_within_the_fp8_bound_of_a_float64_oracle(a_block, b_block, dtypes):
    m, n, k = 96, 136, 300  # K ragged for every block size
    a = rand((m, k), seed=7) * jnp.exp(rand((m, k), seed=8) * 2)
    b = rand((n, k), seed=9) * jnp.exp(rand((n, k), seed=10) * 2)

    def quant(x, block, dt):
        if block[1] == 32:
            return bs.mxfp8_quantize(x, dt, block)
        if block[0] > 1:  # a weight's 128 x 128 grid over its [N, K] (K-major) copy
            return bs.block_quantize(x, dt, block)
        return bs.block_quantize(x, dt, block)

    a_q, a_s = quant(a, a_block, dtypes[0])
    b_q, b_s = quant(b, b_block, dtypes[1])
    c = bs.block_scaled_matmul(a_q, a_s, a_block, b_q, b_s, b_block)
    a64, b64 = np.asarray(a, np.float64), np.asarray(b, np.float64)
    oracle = a64 @ b64.T
    u = [2.0**-4 if d == E4M3 else 2.0**-3 for d in dtypes]
    mag = np.abs(a64) @ np.abs(b64).T
    # each product off by at most (1+u_a)(1+u_b)-1 relatively, plus the subnormal terms and
    # float32 accumulation over K
    bound = mag * ((1 + u[0]) * (1 + u[1]) - 1 + k * 2.0**-23) + 1e-6
    assert (np.abs(np.asarray(c, np.float64) - oracle) <= bound).all()
    # and it is the float32 product of the dequantized operands (up to summation order)
    da = np.asarray(bs.block_dequantize(a_q, a_s, a_block), np.float64)
    db = np.asarray(bs.block_dequantize(b_q, b_s, b_block), np.float64)
    assert (
        np.abs(np.asarray(c, np.float64) - da @ db.T) <= np.abs(da) @ np.abs(db).T * k * 2.0**-23
    ).all()


def test_block_scaled_gemm_refusals():
    q, s = bs.block_quantize(rand((128, 256)), E4M3, bs.BLOCK_2D)
    with pytest.raises(ValueError, match="both operands have 2-D blocks"):
        bs.block_scaled_matmul(q, s, bs.BLOCK_2D, q, s, bs.BLOCK_2D)
    q1, s1 = bs.block_quantize(rand((128, 256)), E4M3)
    with pytest.raises(ValueError, match="same size along K"):
        bs.block_scaled_matmul(q1, s1, bs.BLOCK_1D, q1, s1, (1, 32))
    with pytest.raises(ValueError, match="same K"):
        bs.block_scaled_matmul(q1, s1, bs.BLOCK_1D, q1[:, :128], s1[:, :1], bs.BLOCK_1D)


@pytest.mark.parametrize("block", [(0, 128), (1,), [1, 128], (1, True), "1x128"], ids=str)
def test_bad_blocks_name_the_argument(block):
    with pytest.raises(ValueError, match="block must be a pair of positive ints"):
        bs.block_quantize(rand((2, 128)), E4M3, block)


def test_square_blocks_need_two_dims_and_leading_dims_are_separate_matrices():
    with pytest.raises(ValueError, match="x must have at least 2 dims for 128 x 128 blocks"):
        bs.block_quantize(rand((128,)), E4M3, bs.BLOCK_2D)
    with pytest.raises(ValueError, match="x must have at least 2 dims"):
        bs.block_cast_transpose(rand((128,)), E4M3)
    x = rand((3, 130, 140), seed=4)
    q, s = bs.block_quantize(x, E4M3, bs.BLOCK_2D)
    assert s.shape == (3, 2, 2)
    for i in range(3):
        qi, si = bs.block_quantize(x[i], E4M3, bs.BLOCK_2D)
        np.testing.assert_array_equal(_bits(q[i]), _bits(qi))
        np.testing.assert_array_equal(np.asarray(s[i]), np.asarray(si))


def test_jit_and_vmap_give_the_same_bits():
    x = rand((3, 64, 256), seed=11)
    q, s = bs.block_quantize(x, E4M3)
    jq, js = jax.jit(lambda v: bs.block_quantize(v, E4M3))(x)
    vq, vs = jax.vmap(lambda v: bs.block_quantize(v, E4M3))(x)
    for a, b in ((q, jq), (q, vq)):
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(s), np.asarray(js))
    np.testing.assert_array_equal(np.asarray(s), np.asarray(vs))
    mq, ms = jax.jit(jax.vmap(bs.mxfp8_quantize))(x)
    wq, ws = bs.mxfp8_quantize(x)
    np.testing.assert_array_equal(np.asarray(mq).view(np.uint8), np.asarray(wq).view(np.uint8))
    np.testing.assert_array_equal(
        np.asarray(jax.lax.bitcast_convert_type(ms, jnp.uint8)),
        np.asarray(jax.lax.bitcast_convert_type(ws, jnp.uint8)),
    )


def test_the_error_table_tool_shows_blocks_following_magnitudes():
    """tools/block_scaling_error.py (the table of docs/numerics.md), on a small tensor: where
    row magnitudes differ, 1 x 128 blocks keep E4M3's own rounding error and lose nothing to 0,
    while one scale per tensor loses the small rows."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tools"))
    import block_scaling_error as tool

    result = tool.errors(rows=256, cols=256, seed=0)
    spread = result["rows spanning 2^+-8"]
    assert spread["1 x 128, power-of-two"][0] < 0.03 and spread["1 x 128, power-of-two"][1] == 0
    assert spread["per-tensor (current)"][0] > 2 * spread["1 x 128, power-of-two"][0]
    assert spread["per-tensor (current)"][1] > 0.01
    assert "| gaussian |" in tool.table(result)


def test_cublaslt_scales_checks_its_arguments():
    s = jnp.ones((8, 2), jnp.float32)
    with pytest.raises(ValueError, match="block must be one of"):
        bs.cublaslt_scales(s, (32, 32), 8, 256)
    with pytest.raises(ValueError, match="rows % 4 == 0"):
        bs.cublaslt_scales(jnp.ones((6, 2)), bs.BLOCK_1D, 6, 256)
    with pytest.raises(ValueError, match=r"scale must have shape \(8, 3\)"):
        bs.cublaslt_scales(s, bs.BLOCK_1D, 8, 300)
    # 1 x 128 scales, outer-dim-major: the 8 rows of K block 0, then of K block 1
    flat = bs.cublaslt_scales(jnp.arange(16.0).reshape(8, 2), bs.BLOCK_1D, 8, 256)
    np.testing.assert_array_equal(np.asarray(flat), np.arange(16.0).reshape(8, 2).T.ravel())


# ------------------------------------------------------------------ the kernels
# block_quantize and block_cast_transpose are ops (CPU and CUDA kernels beside the references
# above); the conformance suite runs their samples below (kernel == reference bit for bit, vmap,
# 8 devices, the CUDA kernel on the host). Here: the values and edges the samples miss.


def _assert_kernel_matches_xla(got, want) -> None:
    """The same bits where "xla" is the reference (CPU); on a GPU within F32_SCALE_GPU_CLOSE (XLA's
    divisions, and its canonical NaN: an FP8 NaN code without its sign)."""
    assert_matches(got, want, reference_bits_promised("xla"), **F32_SCALE_GPU_CLOSE)


def _bits(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a


def _special(shape, dtype, seed=0) -> jax.Array:
    """Normal values with whole blocks of zeros, tiny (subnormal-amax) values, huge values,
    and NaN, +-inf and signed zeros scattered in."""
    r = np.random.default_rng(seed)
    x = r.standard_normal(shape).astype(np.float32)
    flat = x.reshape(-1, shape[-1])
    flat[0, :] = 0.0
    flat[1 % len(flat), :] *= 1e-39  # every |x| below float32's smallest normal
    top = 3e38 if dtype == jnp.float32 else 6e4
    flat[2 % len(flat), :] = np.clip(flat[2 % len(flat), :], -1, 1) * top
    flat[-1, : shape[-1] // 2] *= 1e-30
    idx = r.integers(0, x.size, 12)
    x.reshape(-1)[idx] = [np.nan, -np.nan, np.inf, -np.inf, -0.0, 0.0] * 2
    return jnp.asarray(x, dtype)


SPECIAL_BLOCKS = [
    ((1, 128), "pow2"), ((1, 128), "f32"), ((128, 128), "pow2"), ((1, 32), "mx"),
    ((32, 32), "mx"), ((128, 1), "f32"), ((4, 8), "pow2"),
]  # fmt: skip


def _casts(x, fp8, block, mode, implementation):
    """Both layouts where the block allows (1-row or square), else the one layout."""
    kw = {"implementation": implementation}
    if mode != "mx":
        kw["power_2_scale"] = mode == "pow2"
    both = block[0] in (1, block[1])
    if mode == "mx":
        fn = bs.mxfp8_cast_transpose if both else bs.mxfp8_quantize
    else:
        fn = bs.block_cast_transpose if both else bs.block_quantize
    return fn(x, fp8, block, **kw)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16, jnp.float16], ids=str)
@pytest.mark.parametrize(("block", "mode"), SPECIAL_BLOCKS, ids=str)
def test_kernels_equal_the_reference_on_special_values(block, mode, dtype):
    x = _special((140, 260), dtype, seed=block[0] + block[1])
    for fp8 in (E4M3, E5M2):
        got = _casts(x, fp8, block, mode, "kernel")
        want = _casts(x, fp8, block, mode, "xla")
        for g, w in zip(got, want, strict=True):
            assert g.dtype == w.dtype and g.shape == w.shape
            _assert_kernel_matches_xla(g, w)


def test_epsilon_and_non_power_of_two_scales_on_the_kernel():
    x = _special((64, 300), jnp.bfloat16, seed=3)
    for i in ("kernel", "xla"):
        q, s = bs.block_quantize(x, E5M2, power_2_scale=False, amax_epsilon=1e-3,
                                 implementation=i)  # fmt: skip
        if i == "kernel":
            kq, ks = q, s
    _assert_kernel_matches_xla(kq, q)
    _assert_kernel_matches_xla(ks, s)
    assert np.all(np.asarray(ks)[0] == np.float32(1e-3) / np.float32(57344.0))  # a zero row


def test_blocks_the_kernel_does_not_take_run_the_reference():
    assert bs.kernel_block((1, 128)) and bs.kernel_block((128, 128)) and bs.kernel_block((1, 32))
    assert not bs.kernel_block((1, 16)) and not bs.kernel_block((2, 3))
    assert not bs.kernel_block((1, 256))
    x = rand((6, 50), seed=5)
    q, s = bs.block_quantize(x, E4M3, (2, 3))  # default: falls back to the reference
    rq, rs = bs.block_quantize(x, E4M3, (2, 3), implementation="xla")
    np.testing.assert_array_equal(_bits(q), _bits(rq))
    np.testing.assert_array_equal(np.asarray(s), np.asarray(rs))
    with pytest.raises(ValueError, match=r"block_quantize: the kernel takes blocks .* got block"):
        bs.block_quantize(x, E4M3, (2, 3), implementation="kernel")


@pytest.mark.parametrize("eps", [-1.0, float("nan"), float("inf")])
def test_bad_epsilon_names_the_argument(eps):
    with pytest.raises(ValueError, match="block_quantize: amax_epsilon must be"):
        bs.block_quantize(rand((2, 128)), E4M3, amax_epsilon=eps)


def test_bad_dtypes_name_the_argument():
    with pytest.raises(TypeError, match="fp8_dtype"):
        bs.block_quantize(rand((2, 128)), jnp.int8)
    with pytest.raises(TypeError, match="x"):
        bs.mxfp8_quantize(jnp.zeros((2, 128), jnp.int32))


def test_the_kernel_is_one_custom_call_per_cast():
    x = rand((256, 384))
    hlo = jax.jit(lambda v: bs.block_cast_transpose(v, E4M3)).lower(x).as_text()
    assert hlo.count("fp8jax_block_cast_transpose") == 1
    hlo = jax.jit(lambda v: bs.mxfp8_quantize(v)).lower(x).as_text()
    assert hlo.count("fp8jax_block_quantize") == 1


# ------------------------------------------------------------------ the conformance sample


def _heavy(r, shape, dtype):
    """Normal values with magnitudes over many binades (every block its own scale)."""
    x = r.standard_normal(shape) * np.exp(r.standard_normal(shape) * 3)
    top = float(jnp.finfo(dtype).max)
    return jnp.asarray(np.clip(x, -top, top).astype(np.float32), dtype)


def _sample_block_quantize(key):
    r = np.random.default_rng(key)
    q, mx = bs.block_quantize, bs.mxfp8_quantize
    return {
        "1x128-f32-e4m3": Sample(q, (_heavy(r, (M, 300), jnp.float32), E4M3)),
        "1x128-bf16-e5m2-f32scale": Sample(
            q,
            (_heavy(r, (M, 260), jnp.bfloat16), E5M2),
            {"power_2_scale": False, "amax_epsilon": 1e-4},
            gpu_close=F32_SCALE_GPU_CLOSE,
        ),
        "128x128-f32-rank3": Sample(q, (_heavy(r, (8, 130, 140), jnp.float32), E4M3, (128, 128))),
        "mxfp8-1x32-f16": Sample(mx, (_heavy(r, (M, 100), jnp.float16), E4M3)),
        "mxfp8-32x32-bf16-rank3": Sample(
            mx, (_heavy(r, (8, 40, 70), jnp.bfloat16), E5M2, (32, 32))
        ),
    }


def _sample_block_cast_transpose(key):
    r = np.random.default_rng(key)
    ct, mx = bs.block_cast_transpose, bs.mxfp8_cast_transpose
    return {
        # 1-row blocks: q_t's blocks run down M, so the leading (split) dim is a batch dim
        "1x128-bf16-e4m3-rank3": Sample(ct, (_heavy(r, (8, 20, 300), jnp.bfloat16), E4M3)),
        "128x128-f32-rank3": Sample(ct, (_heavy(r, (8, 130, 140), jnp.float32), E5M2, (128, 128))),
        "mxfp8-1x32-f32-rank3": Sample(mx, (_heavy(r, (8, 40, 100), jnp.float32), E4M3)),
        "mxfp8-32x32-f16-rank3": Sample(mx, (_heavy(r, (8, 40, 70), jnp.float16), E4M3, (32, 32))),
    }


SAMPLES = {
    "block_quantize": _sample_block_quantize,
    "block_cast_transpose": _sample_block_cast_transpose,
}
