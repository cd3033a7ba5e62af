"""fp8jax.ops.block.rowwise (Float8RowwiseScaling's casts and GEMM reference, issue 49) against
an independent numpy implementation: float32 arithmetic in numpy, ``frexp`` for the
power-of-two rounding, ``ml_dtypes`` for the FP8 rounding (saturated first); codes compared as
bits, scales exactly. The GEMM against a float64 oracle within float32 summation error. The cast
is an op (``fp8jax_rowwise_quantize``): both implementations against the oracle, the kernel
against the reference bit for bit on special values and ragged rows, its handler's checks, and
the conformance sample (``SAMPLES``)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _rowwise_numpy import numpy_rowwise
from _samples import F32_SCALE_GPU_CLOSE, M, Sample
from _shared import rand

from fp8jax import ops
from fp8jax.ops.block import block_scaling as bs
from fp8jax.ops.block import rowwise as rw

E4M3, E5M2 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)


def _bits(q) -> np.ndarray:
    return np.asarray(q).view(np.uint8)


def _magnitudes(m: int, k: int, seed: int) -> jnp.ndarray:
    """Rows of very different magnitudes (2**-30 .. 2**30), a few outliers."""
    x = rand((m, k), seed) * jnp.exp2(jnp.round(rand((m, 1), seed + 1) * 10))
    return x.at[3].multiply(1000.0)


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=str)
@pytest.mark.parametrize("pow2", [True, False], ids=["pow2", "f32"])
@pytest.mark.parametrize("eps", [0.0, 0.5])
@pytest.mark.parametrize("in_dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("impl", ["kernel", "xla"])
def test_rowwise_quantize_equals_numpy(dtype, pow2, eps, in_dtype, impl):
    x = _magnitudes(64, 96, 1).astype(in_dtype)
    x = x.at[5].set(0.0)  # an all-zero row: scale 1 (with an epsilon, fp8_max / epsilon)
    q, sinv = rw.rowwise_quantize(
        x, dtype, power_2_scale=pow2, amax_epsilon=eps, implementation=impl
    )
    want_q, want_sinv = numpy_rowwise(np.asarray(x, np.float32), dtype, pow2, eps)
    assert q.dtype == dtype and q.shape == x.shape and sinv.shape == (64, 1)
    assert sinv.dtype == jnp.float32
    np.testing.assert_array_equal(_bits(q), want_q)
    np.testing.assert_array_equal(np.asarray(sinv), want_sinv)
    assert float(sinv[5, 0]) == (1.0 if eps == 0 else want_sinv[5, 0])
    assert not np.asarray(_bits(q)[5]).any()
    if pow2:  # exact inverses: every scale a power of two
        assert np.all(np.frexp(np.asarray(sinv))[0] == 0.5)


def test_rowwise_is_one_block_per_row():
    """The same codes and scales as a block cast whose block is the whole row."""
    x = _magnitudes(32, 200, 3)
    for pow2 in (True, False):
        q, s = rw.rowwise_quantize(x, E4M3, power_2_scale=pow2, amax_epsilon=1e-3)
        bq, bsinv = bs.block_quantize(x, E4M3, (1, 200), power_2_scale=pow2, amax_epsilon=1e-3,
                                      implementation="xla")  # fmt: skip
        np.testing.assert_array_equal(_bits(q), _bits(bq))
        np.testing.assert_array_equal(np.asarray(s), np.asarray(bsinv))


@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=str)
@pytest.mark.parametrize("impl", ["kernel", "xla"])
def test_special_values(dtype, impl):
    """NaN is left out of its row's amax and stays NaN (with its sign); an inf gives its row
    scale 1 (the inf non-finite: E5M2's inf, E4M3's NaN); a subnormal amax gives scale 1; an
    amax so small that ``fp8_max / amax`` overflows gets float32's largest power of two."""
    x = np.array(
        [
            [1.0, np.nan, -2.0, 0.5],
            [-np.nan, 3.0, 0.0, 0.0],
            [np.inf, 1.0, -300.0, 2.0],
            [1e-39, -1e-40, 0.0, 0.0],  # subnormal amax
            [2e-38, -1.5e-38, 0.0, 0.0],  # 448 / 2e-38 overflows float32
            [np.nan, np.nan, np.nan, np.nan],
        ],
        np.float32,
    )
    q, sinv = rw.rowwise_quantize(jnp.asarray(x), dtype, implementation=impl)
    want_q, want_sinv = numpy_rowwise(x, dtype)
    bits, sinv = _bits(q), np.asarray(sinv)
    exact = np.isfinite(x) & (np.arange(6) != 3)[:, None]  # row 3: subnormal inputs, below
    np.testing.assert_array_equal(bits[exact], want_q[exact])
    # 1 / 2**127 is subnormal, which XLA:CPU may flush to 0
    np.testing.assert_array_equal(sinv[[0, 1, 2, 3, 5]], want_sinv[[0, 1, 2, 3, 5]])
    assert sinv[4, 0] in (2.0**-127, 0.0) and want_sinv[4, 0] == 2.0**-127
    nan_code = {E4M3: 0x7F, E5M2: 0x7E}[dtype]
    assert bits[0, 1] == nan_code and bits[1, 0] == 0x80 | nan_code  # NaN keeps its sign
    assert bits[2, 0] == (0x7F if dtype == E4M3 else 0x7C)  # +inf: E4M3 NaN, E5M2 inf
    assert sinv[2, 0] == sinv[3, 0] == sinv[5, 0] == 1.0
    assert sinv[0, 0] == want_sinv[0, 0] != 1.0  # NaN left out: the row's own scale
    assert not np.any(bits[3] & 0x7F)  # subnormal inputs at scale 1: (signed) zeros


def test_leading_dims_are_rows():
    x = _magnitudes(24, 40, 5).reshape(2, 3, 4, 40)
    q, sinv = rw.rowwise_quantize(x, E4M3)
    assert sinv.shape == (2, 3, 4, 1)
    want_q, want_sinv = numpy_rowwise(np.asarray(x), E4M3)
    np.testing.assert_array_equal(_bits(q), want_q)
    np.testing.assert_array_equal(np.asarray(sinv), want_sinv)
    v = rw.rowwise_dequantize(q, sinv)
    assert float(jnp.max(jnp.abs(v - x) / jnp.max(jnp.abs(x), axis=-1, keepdims=True))) <= 2**-4


def test_cast_transpose_quantizes_the_transpose_again():
    x = _magnitudes(48, 80, 7)
    q, s, q_t, s_t = rw.rowwise_cast_transpose(x, E5M2, power_2_scale=False)
    assert (q.shape, s.shape, q_t.shape, s_t.shape) == ((48, 80), (48, 1), (80, 48), (80, 1))
    for (gq, gs), (wq, ws) in zip(
        ((q, s), (q_t, s_t)),
        (numpy_rowwise(np.asarray(x), E5M2, False), numpy_rowwise(np.asarray(x).T, E5M2, False)),
        strict=True,
    ):
        np.testing.assert_array_equal(_bits(gq), wq)
        np.testing.assert_array_equal(np.asarray(gs), ws)


@pytest.mark.parametrize("dtypes", [(E4M3, E4M3), (E5M2, E4M3)], ids=["e4m3", "e5m2xe4m3"])
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_scaled_matmul_against_float64(dtypes, out_dtype):
    """``(a8 @ b8.T) * sa sb^T``: the exact float64 result of the FP8 values and their scales,
    within float32 summation (K exact products: at most K * 2**-24 = 2**-16 of the sum of
    magnitudes, and bfloat16's rounding of the result, 2**-9)."""
    a, b = _magnitudes(64, 256, 11), rand((96, 256), 13) * 0.05
    aq, asi = rw.rowwise_quantize(a, dtypes[0])
    bq, bsi = rw.rowwise_quantize(b, dtypes[1])
    got = np.asarray(rw.rowwise_scaled_matmul(aq, asi, bq, bsi, out_dtype), np.float64)
    av = np.asarray(aq, np.float64) * np.asarray(asi, np.float64)
    bv = np.asarray(bq, np.float64) * np.asarray(bsi, np.float64)
    want, mag = av @ bv.T, np.abs(av) @ np.abs(bv).T
    rel = 2.0**-16 + (2.0**-8 if out_dtype == jnp.bfloat16 else 0.0)
    assert np.all(np.abs(got - want) <= rel * mag + 1e-30)
    # the scales are where they belong: unscaled codes would be off by orders of magnitude
    assert np.max(np.abs(want)) > 0


def test_fp8jax_ops_exports_them():
    for name in rw.__all__:
        assert getattr(ops, name) is getattr(rw, name)


@pytest.mark.parametrize(
    "call, error, match",
    [
        (lambda: rw.rowwise_quantize(jnp.ones((4, 4), jnp.int32), E4M3), TypeError,
         r"rowwise_quantize: x must be float32, bfloat16 or float16"),
        (lambda: rw.rowwise_quantize(jnp.ones((4, 4)), jnp.float16), TypeError,
         r"rowwise_quantize: fp8_dtype must be float8_e4m3fn or float8_e5m2"),
        (lambda: rw.rowwise_quantize(jnp.ones((4, 4)), E4M3, amax_epsilon=-1.0), ValueError,
         r"rowwise_quantize: amax_epsilon must be a finite float >= 0"),
        (lambda: rw.rowwise_quantize(jnp.float32(1.0), E4M3), ValueError,
         r"rowwise_quantize: x must have at least one dim"),
        (lambda: rw.rowwise_cast_transpose(jnp.ones((2, 4, 4)), E4M3), ValueError,
         r"rowwise_cast_transpose: x must be a matrix"),
        (lambda: rw.rowwise_dequantize(jnp.ones((4, 4), E4M3), jnp.ones((4,))), ValueError,
         r"rowwise_dequantize: scale_inv must have shape \(4, 1\)"),
        (lambda: rw.rowwise_scaled_matmul(jnp.ones((4, 8), E4M3), jnp.ones((4, 1)),
                                          jnp.ones((5, 6), E4M3), jnp.ones((5, 1))), ValueError,
         r"rowwise_scaled_matmul: a_q \[M, K\] and b_q \[N, K\] must be matrices with the same K"),
        (lambda: rw.rowwise_scaled_matmul(jnp.ones((4, 8), E4M3), jnp.ones((1, 1)),
                                          jnp.ones((5, 8), E4M3), jnp.ones((5, 1))), ValueError,
         r"a_scale_inv must be float32 \[4, 1\]"),
        (lambda: rw.rowwise_scaled_matmul(jnp.ones((4, 8)), jnp.ones((4, 1)),
                                          jnp.ones((5, 8), E4M3), jnp.ones((5, 1))), TypeError,
         r"rowwise_scaled_matmul: a_q must be float8_e4m3fn or float8_e5m2"),
        (lambda: rw.rowwise_quantize(jnp.ones((4, 4)), E4M3, power_2_scale="yes"), TypeError,
         r"rowwise_quantize: power_2_scale must be a bool"),
        (lambda: rw.rowwise_quantize(jnp.ones((4, 4)), E4M3, implementation="fast"), ValueError,
         r"rowwise_quantize: implementation must be 'kernel' or 'xla'"),
        (lambda: rw.rowwise_quantize_reference(jnp.ones((4, 4)), E4M3, amax_epsilon=np.inf),
         ValueError, r"rowwise_quantize_reference: amax_epsilon must be a finite float >= 0"),
        (lambda: rw.rowwise_quantize_reference(jnp.ones(4, jnp.int8), E4M3), TypeError,
         r"rowwise_quantize_reference: x must be float32, bfloat16 or float16"),
        (lambda: rw.rowwise_cast_transpose(jnp.ones((4, 4)), E4M3, implementation="XLA"),
         ValueError, r"rowwise_quantize: implementation must be 'kernel' or 'xla'"),
    ],
)  # fmt: skip
def test_bad_arguments_are_named(call, error, match):
    with pytest.raises(error, match=match):
        call()


# ------------------------------------------------------------------ the kernel


def _special_rows(k: int, dtype) -> np.ndarray:
    """Rows of special values (``k >= 4``): NaNs of both signs, infs, zeros, subnormals (of
    float32 and of the input dtype), float32's largest values, values at the FP8 codes'
    midpoints after scaling, mixed with random values."""
    r = np.random.default_rng(k)
    x = (r.standard_normal((12, k)) * np.exp2(r.integers(-20, 20, (12, 1)))).astype(np.float32)
    x[0, ::3] = np.nan
    x[1, 1::2] = -np.nan
    x[2, 0], x[3, -1] = np.inf, -np.inf
    x[4] = 0.0
    x[5] = 1e-40 * np.sign(x[5])  # subnormal float32 (flushed to 0 by bf16 / f16 rounding)
    x[6] = np.float32(jnp.finfo(dtype).tiny) * np.linspace(-1, 1, k)  # the dtype's smallest normals
    x[7, :2] = np.float32(jnp.finfo(dtype).max) * np.array([1, -1])  # the dtype's largest value
    x[8] = np.nan
    x[9] = 2e-38 * np.sign(x[9])  # fp8_max / amax overflows float32
    x[10] = (np.arange(k) % 17 + 0.5) * 0.25  # ties between codes at power-of-two scales
    return x


@pytest.mark.parametrize("k", [1, 4, 7, 33, 130, 1000])
@pytest.mark.parametrize("in_dtype", [jnp.float32, jnp.bfloat16, jnp.float16],
                         ids=["f32", "bf16", "f16"])  # fmt: skip
@pytest.mark.parametrize("dtype", [E4M3, E5M2], ids=str)
def test_kernel_equals_reference_bit_for_bit(k, in_dtype, dtype):
    """The CPU kernel's codes and scales are the reference's bits: every input dtype, both
    formats, power-of-two and float32 scales, with and without an epsilon, rows of any length
    with special values (the bits, NaNs included).

    Except where float32 subnormals enter (docs/numerics.md: they follow the platform, and
    XLA:CPU flushes them or not depending on the thread that runs the code): an inverse scale
    below 2**-126 (``fp8_max / amax`` overflowed to the input dtype's largest value) and the
    codes of subnormal inputs. Those rows equal the numpy oracle, which keeps subnormals, or
    its flushed form (scale_inv 0; the codes of subnormal inputs are not compared)."""
    x = np.asarray(_magnitudes(20, k, k))
    if k >= 4:
        x = np.concatenate([x, _special_rows(k, in_dtype)])
    x = jnp.asarray(x).astype(in_dtype)
    x32 = np.asarray(x).astype(np.float32)  # numpy's conversion keeps subnormals
    tiny = np.finfo(np.float32).smallest_normal
    sub_x = (x32 != 0) & (np.abs(x32) < tiny)
    for pow2, eps in ((True, 0.0), (False, 0.0), (True, 1e-3), (False, 2.5)):
        kw = dict(power_2_scale=pow2, amax_epsilon=eps)
        q, s = rw.rowwise_quantize(x, dtype, implementation="kernel", **kw)
        wq, ws = rw.rowwise_quantize_reference(x, dtype, **kw)
        oq, os_ = numpy_rowwise(x32, dtype, pow2, eps, float(jnp.finfo(in_dtype).max))
        odd = sub_x.any(axis=-1) | (os_[:, 0] < tiny)  # rows where subnormals enter
        for got_q, got_s in ((q, s), (wq, ws)):
            got_s = np.asarray(got_s)
            assert np.all((got_s[odd] == os_[odd]) | (got_s[odd] == 0)), kw
            keep = odd[:, None] & ~sub_x & np.isfinite(x32)
            np.testing.assert_array_equal(_bits(got_q)[keep], oq[keep], err_msg=str(kw))
        np.testing.assert_array_equal(_bits(q)[~odd], _bits(wq)[~odd], err_msg=str(kw))
        bits_s, bits_ws = (np.asarray(a)[~odd].view(np.uint32) for a in (s, ws))
        np.testing.assert_array_equal(bits_s, bits_ws, err_msg=str(kw))
        if k >= 4 and eps == 0 and in_dtype != jnp.float16:  # float16 has no such rows
            assert odd.sum() >= 2, kw


def test_the_kernel_is_called():
    """``"kernel"`` (the default) lowers to the custom call; ``"xla"`` to none."""
    x = jnp.ones((8, 5))
    hlo = {impl: jax.jit(lambda a, i=impl: rw.rowwise_quantize(a, E4M3, implementation=i))
           .lower(x).compile().as_text() for impl in ("kernel", "xla")}  # fmt: skip
    assert 'custom_call_target="fp8jax_rowwise_quantize"' in hlo["kernel"]
    assert "fp8jax_" not in hlo["xla"]
    with ops.implementation(cast="xla"):
        assert "fp8jax_" not in jax.jit(lambda a: rw.rowwise_quantize(a, E4M3)).lower(
            x).compile().as_text()  # fmt: skip


@pytest.mark.parametrize("shape", [(6, 0), (0, 5), (0,), (3, 0, 4)])
def test_empty_rows_and_empty_tensors(shape):
    """A row of no elements has amax 0, hence scale 1; no rows, no scales."""
    x = jnp.zeros(shape, jnp.bfloat16)
    for impl in ("kernel", "xla"):
        q, s = rw.rowwise_quantize(x, E5M2, implementation=impl)
        assert q.shape == shape and q.dtype == E5M2 and s.shape == (*shape[:-1], 1)
        np.testing.assert_array_equal(np.asarray(s), np.ones(s.shape, np.float32))


def test_vector_is_one_row():
    x = _magnitudes(1, 77, 2)[0]
    q, s = rw.rowwise_quantize(x, E4M3)
    wq, ws = numpy_rowwise(np.asarray(x)[None], E4M3)
    assert q.shape == (77,) and s.shape == (1,)
    np.testing.assert_array_equal(_bits(q), wq[0])
    np.testing.assert_array_equal(np.asarray(s), ws[0])


def test_vmap_is_more_rows():
    """A vmapped call is the kernel on more leading dims: each element's rows keep their own
    scales, equal to the unbatched call's."""
    x = _magnitudes(3 * 8, 50, 9).reshape(3, 8, 50)
    f = jax.jit(jax.vmap(lambda a: rw.rowwise_quantize(a, E5M2, power_2_scale=False)))
    q, s = f(x)
    assert q.shape == x.shape and s.shape == (3, 8, 1)
    for i in range(3):
        wq, ws = rw.rowwise_quantize(x[i], E5M2, power_2_scale=False)
        np.testing.assert_array_equal(_bits(q[i]), _bits(wq))
        np.testing.assert_array_equal(np.asarray(s[i]), np.asarray(ws))
    hlo = f.lower(x).compile().as_text()
    assert 'custom_call_target="fp8jax_rowwise_quantize"' in hlo


def test_cast_transpose_is_the_kernel_on_both_layouts():
    x = _magnitudes(40, 72, 4).astype(jnp.bfloat16)
    got = rw.rowwise_cast_transpose(x, E4M3, implementation="kernel")
    want = (*rw.rowwise_quantize_reference(x, E4M3),
            *rw.rowwise_quantize_reference(x.T, E4M3))  # fmt: skip
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g).view(np.uint8), np.asarray(w).view(np.uint8))
    hlo = jax.jit(lambda a: rw.rowwise_cast_transpose(a, E4M3)).lower(x).compile().as_text()
    assert hlo.count('custom_call_target="fp8jax_rowwise_quantize"') == 2


def _direct_call(x, scale_rows, **attrs):
    """The FFI call itself, bypassing the Python checks."""
    from fp8jax import _ffi

    _ffi.ensure_registered()
    out = (jax.ShapeDtypeStruct(x.shape, E4M3), jax.ShapeDtypeStruct((scale_rows,), jnp.float32))
    kw = {"scale_mode": np.int64(1), "epsilon": np.float32(0.0), **attrs}
    return jax.ffi.ffi_call("fp8jax_rowwise_quantize", out)(x, **kw)


@pytest.mark.parametrize(
    "rows, attrs, match",
    [
        (5, {}, "scale_inv must hold one float32 scale per row"),
        (4, {"scale_mode": np.int64(2)}, "scale_mode must be 0 or 1"),
        (4, {"epsilon": np.float32(-1.0)}, "epsilon must be >= 0"),
        (4, {"epsilon": np.float32(np.inf)}, "epsilon must be >= 0"),
    ],
)
def test_handler_refuses_bad_calls(rows, attrs, match):
    """The handler's own check (cpp/ops/block_casts.h), for callers that skip the Python one:
    an error naming the op and what is wrong, never a write out of bounds."""
    with pytest.raises(jax.errors.JaxRuntimeError, match=f"rowwise_quantize.*{match}"):
        jax.block_until_ready(_direct_call(jnp.ones((4, 6)), rows, **attrs))


def _sample_rowwise_quantize(key):
    r = np.random.default_rng(key)

    def heavy(shape, dtype):
        x = r.standard_normal(shape) * np.exp(r.standard_normal((*shape[:-1], 1)) * 3)
        return jnp.asarray(x.astype(np.float32), dtype)

    q = rw.rowwise_quantize
    return {
        "f32-e4m3": Sample(q, (heavy((M, 300), jnp.float32), E4M3)),
        "bf16-e5m2-f32scale": Sample(
            q,
            (heavy((M, 37), jnp.bfloat16), E5M2),
            {"power_2_scale": False, "amax_epsilon": 1e-4},
            gpu_close=F32_SCALE_GPU_CLOSE,
        ),
        "f16-e4m3-rank3": Sample(q, (heavy((8, 6, 130), jnp.float16), E4M3)),
    }


SAMPLES = {"rowwise_quantize": _sample_rowwise_quantize}
