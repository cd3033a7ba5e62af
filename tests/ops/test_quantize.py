"""quantize / dequantize: kernel vs jnp reference vs numpy oracle, bit for bit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from _implementations import (  # noqa: F401
    DIV_ULPS,
    implementation_fixture,
    pytest_generate_tests,
    reference_bits_promised,
)
from _samples import BF16, E4M3, E5M2, F16, F32, M, N, Sample, fp8_codes, scale_of
from _shared import normal
from _values import (
    CODES,
    FP8_TYPES,
    all_16bit,
    all_codes,
    assert_fp8_equal,
    assert_matches,
    assert_wide_equal,
    bits,
    oracle_dequantize,
    oracle_quantize,
    special_values,
)
from conftest import on_cpu

from fp8jax import ops

SCALES = (1.0, 0.125, 0.7, 3.3, 1e-3)
WIDE = (jnp.float32, jnp.bfloat16, jnp.float16)


def _oracle_amax(x: np.ndarray) -> np.float32:
    a = np.abs(x.astype(np.float32))
    return np.float32(np.nan) if np.isnan(a).any() else np.float32(a.max(initial=0.0))


def _check_quantize(x: np.ndarray, scale: float, fp8, scale_shape=()) -> None:
    # The bits, NaN signs and payloads included, unless the implementation in force is "xla" on a
    # GPU: then NaN codes may lose their sign, amax's NaN its payload, and 1 / scale is div.full's.
    exact = reference_bits_promised(ops.get_implementation("cast"))
    s = jnp.full(scale_shape, scale, jnp.float32)
    q, s_inv, amax = ops.quantize(jnp.asarray(x), s, fp8)
    rq, rs_inv, ramax = on_cpu(ops.quantize_reference, jnp.asarray(x), s, fp8)
    want = oracle_quantize(x, scale, fp8)
    assert_matches(q, want, exact)
    assert_fp8_equal(rq, want)
    assert s_inv.shape == amax.shape == scale_shape
    assert_matches(s_inv, rs_inv, exact, ulps=DIV_ULPS)
    with np.errstate(divide="ignore"):
        assert_matches(
            s_inv, np.full(scale_shape, np.float32(1) / np.float32(scale)), exact, ulps=DIV_ULPS
        )
    assert_matches(amax, ramax, exact)
    np.testing.assert_array_equal(np.asarray(amax).reshape(()), _oracle_amax(x))


@pytest.mark.parametrize("fp8", FP8_TYPES, ids=lambda t: t.__name__)
@pytest.mark.parametrize("scale", SCALES)
def test_quantize_f32_every_code_tie_and_special(fp8, scale):
    x = special_values(fp8)
    # Values whose product with ``scale`` lands on the codes, ties and ulps (scale-relative).
    x = np.concatenate([x, (x.astype(np.float64) / scale).astype(np.float32)])
    with np.errstate(over="ignore", invalid="ignore"):
        _check_quantize(x, scale, fp8)


@pytest.mark.parametrize("fp8", FP8_TYPES, ids=lambda t: t.__name__)
@pytest.mark.parametrize("wide", [jnp.bfloat16, jnp.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("scale", (1.0, 0.7, 64.0))
def test_quantize_every_16bit_input(fp8, wide, scale):
    with np.errstate(over="ignore", invalid="ignore"):
        _check_quantize(all_16bit(wide), scale, fp8)


@pytest.mark.parametrize("fp8", FP8_TYPES, ids=lambda t: t.__name__)
def test_quantize_random_f32_bit_patterns(fp8):
    rng = np.random.default_rng(0)
    x = rng.integers(0, 1 << 32, size=1 << 18, dtype=np.uint64).astype(np.uint32).view(np.float32)
    with np.errstate(over="ignore", invalid="ignore"):
        _check_quantize(x, 1.0, fp8)
        _check_quantize(x * np.float32(1e-30), 1e30, fp8)


# The documented codes (docs/numerics.md), written out: +inf, -inf, NaN, -NaN, +max, -max.
DOCUMENTED_CODES = {
    ml_dtypes.float8_e4m3fn: [0x7F, 0xFF, 0x7F, 0xFF, 0x7E, 0xFE],  # no inf: inf -> NaN
    ml_dtypes.float8_e5m2: [0x7C, 0xFC, 0x7E, 0xFE, 0x7B, 0xFB],
}


@pytest.mark.parametrize("fp8", FP8_TYPES, ids=lambda t: t.__name__)
@pytest.mark.parametrize("wide", WIDE, ids=["f32", "bf16", "f16"])
def test_quantize_specials_documented_codes(fp8, wide, implementation):
    x = np.array([np.inf, -np.inf, np.nan, -np.nan, 1e6, -1e6, 0.0, -0.0], np.float32)
    with np.errstate(over="ignore"):
        x = x.astype(wide)
    if wide == jnp.float16:
        x[4:6] = [60000.0, -60000.0]  # beyond both formats' max, finite in float16
    q, _, amax = ops.quantize(jnp.asarray(x), jnp.float32(1.0), fp8)
    rq = on_cpu(ops.quantize_reference, jnp.asarray(x), jnp.float32(1.0), fp8)[0]
    want = [*DOCUMENTED_CODES[fp8], 0x00, 0x80]  # finite overflow saturates; zeros keep sign
    assert_matches(q, np.array(want, np.uint8).view(fp8), reference_bits_promised(implementation))
    assert bits(rq).tolist() == want
    assert np.isnan(np.asarray(amax))  # amax propagates NaN


@pytest.mark.parametrize("fp8", FP8_TYPES, ids=lambda t: t.__name__)
def test_quantize_codes_match_ml_dtypes_for_nonfinite(fp8):
    # NaN (both signs) and +-inf get the codes ml_dtypes' and XLA:CPU's astype give.
    x = np.array([np.inf, -np.inf, np.nan, -np.nan], np.float32)
    q = ops.quantize(jnp.asarray(x), jnp.float32(1.0), fp8)[0]
    assert bits(q).tolist() == bits(x.astype(fp8)).tolist()
    xla = on_cpu(lambda a: a.astype(fp8), jnp.asarray(x))
    assert bits(q).tolist() == bits(xla).tolist()


@pytest.mark.parametrize("fp8", FP8_TYPES, ids=lambda t: t.__name__)
def test_quantize_overflow_of_the_multiply_saturates(fp8):
    # A finite x times a finite scale can overflow float32 to inf: still a finite value beyond
    # the range, so it saturates; only a non-finite x (or scale) gives a non-finite code.
    x = np.array([3e38, -3e38, 1e30, np.inf], np.float32)
    q = ops.quantize(jnp.asarray(x), jnp.float32(1e10), fp8)[0]
    max_code, _, inf_code = CODES[np.dtype(fp8)]
    assert bits(q).tolist() == [max_code, 0x80 | max_code, max_code, inf_code]
    _check_quantize(x, 1e10, fp8)


@pytest.mark.parametrize("fp8", FP8_TYPES, ids=lambda t: t.__name__)
@pytest.mark.parametrize("scale", [0.0, -0.0, -2.0, np.inf, -np.inf, np.nan, -np.nan])
def test_quantize_special_scales(fp8, scale):
    # Not what delayed scaling produces, but the rule holds: a NaN product gets the sign of
    # x XOR scale, an infinite one the inf code unless x and scale were both finite.
    x = special_values(fp8)
    # XLA:CPU runs kernels with denormals-are-zero: a float32-subnormal x times inf is NaN there
    # (0 * inf) and inf in numpy; leave those out (docs/numerics.md, known consequences).
    x = x[~((np.abs(x) < np.finfo(np.float32).smallest_normal) & (x != 0))]
    with np.errstate(over="ignore", invalid="ignore"):
        _check_quantize(x, scale, fp8)


@pytest.mark.parametrize("fp8", FP8_TYPES, ids=lambda t: t.__name__)
@pytest.mark.parametrize("wide", WIDE, ids=["f32", "bf16", "f16"])
def test_cast_to_representable_keeps_nonfinite(fp8, wide, implementation):
    x = jnp.asarray(np.array([np.inf, -np.inf, np.nan, -np.nan, 6e4, -6e4], np.float32), wide)
    got = np.asarray(ops.cast_to_representable(x, fp8)).astype(np.float32)
    inf = np.inf if fp8 == ml_dtypes.float8_e5m2 else np.nan  # E4M3 has no inf: NaN, its sign
    fmax = float(ml_dtypes.finfo(fp8).max)  # finite overflow still saturates
    want = np.array([inf, -inf, np.nan, -np.nan, fmax, -fmax], np.float32)
    # NaN keeps its sign and is the quiet NaN of `wide` ("xla" on a GPU: NaN of any sign)
    assert_matches(got, want, reference_bits_promised(implementation))


NAN_BITS = {  # signalling and quiet NaNs of both signs, with payloads
    jnp.float32: (np.uint32, [0x7F800001, 0xFF800001, 0x7FC00001, 0xFFFFFFFF, 0x7F812345]),
    jnp.bfloat16: (np.uint16, [0x7F81, 0xFF81, 0x7FC1, 0xFFFF, 0x7FA5]),
    jnp.float16: (np.uint16, [0x7C01, 0xFC01, 0x7E01, 0xFFFF, 0x7D55]),
}


@pytest.mark.parametrize("wide", WIDE, ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("i", range(5))
def test_quantize_nan_amax_bits_match_reference(wide, i, implementation):
    # One NaN among finite values: amax is that NaN, with the same bits in kernel and reference
    # ("xla" on a GPU: a NaN, the canonical one; the NaN codes of q may lose their sign).
    exact = reference_bits_promised(implementation)
    uint, patterns = NAN_BITS[wide]
    x = np.array([1.0, -3.0, 0.0, 2.0], np.float32).astype(wide)
    x.view(uint)[2] = patterns[i]
    for fp8 in FP8_TYPES:
        q, _, amax = ops.quantize(jnp.asarray(x), jnp.float32(2.0), fp8)
        rq, _, ramax = on_cpu(ops.quantize_reference, jnp.asarray(x), jnp.float32(2.0), fp8)
        assert np.isnan(np.asarray(amax))
        assert_matches(amax, ramax, exact)
        assert_matches(q, rq, exact)
        assert_matches(q, oracle_quantize(x, 2.0, fp8), exact)


SHAPES = [(1,), (7,), (1023,), (4097,), (3, 5), (2, 3, 7), (2, 3, 4, 5), (0,), (4, 0)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("wide", WIDE, ids=["f32", "bf16", "f16"])
def test_quantize_shapes_dtypes(shape, wide):
    scale_shape = ((), (1,))[(SHAPES.index(shape) + WIDE.index(wide)) % 2]  # both, alternating
    x = normal(1, shape, wide, 50.0)
    q, s_inv, amax = ops.quantize(
        jnp.asarray(x), jnp.full(scale_shape, 2.0, jnp.float32), jnp.float8_e4m3fn
    )
    assert q.shape == shape and q.dtype == jnp.float8_e4m3fn
    assert s_inv.shape == scale_shape and amax.shape == scale_shape
    _check_quantize(np.asarray(x), 2.0, ml_dtypes.float8_e4m3fn, scale_shape)


@pytest.mark.parametrize("fp8", FP8_TYPES, ids=lambda t: t.__name__)
@pytest.mark.parametrize("wide", WIDE, ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("scale_inv", (1.0, 0.5, 1 / 3, 1e-3, 300.0))
def test_dequantize_every_code(fp8, wide, scale_inv):
    q = jnp.asarray(np.tile(all_codes(fp8), 3))  # 768 elements: vector path + odd lengths
    si = jnp.float32(scale_inv)
    got = ops.dequantize(q, si, wide)
    ref = on_cpu(ops.dequantize_reference, q, si, wide)
    want = oracle_dequantize(np.asarray(q), scale_inv, wide)
    # NaN codes keep their sign in every output dtype (the quiet NaN of that dtype).
    nan_bits = np.asarray(got).view({4: np.uint32, 2: np.uint16}[jnp.dtype(wide).itemsize])
    quiet = {jnp.float32: 0x7FC00000, jnp.bfloat16: 0x7FC0, jnp.float16: 0x7E00}[wide]
    sign = 1 << (8 * jnp.dtype(wide).itemsize - 1)
    codes = bits(q)
    assert set(nan_bits[np.isnan(np.asarray(q).astype(np.float32)) & (codes < 0x80)]) == {quiet}
    assert set(nan_bits[np.isnan(np.asarray(q).astype(np.float32)) & (codes >= 0x80)]) == {
        quiet | sign
    }
    assert got.dtype == wide and got.shape == q.shape
    assert_wide_equal(got, want)
    assert_wide_equal(ref, want)
    for n in (1, 7, 255):  # scalar path
        # (sliced on the host: XLA:CPU in JAX 0.12 rewrites negative E5M2 NaN codes to 0x7F
        # when it slices an FP8 array, so q[:n] on the device would not hold the same codes)
        part = jnp.asarray(np.asarray(q)[:n])
        assert_wide_equal(ops.dequantize(part, si, wide), want[:n])


@pytest.mark.parametrize("fp8", FP8_TYPES, ids=lambda t: t.__name__)
@pytest.mark.parametrize("wide", WIDE, ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("scale_inv", [0.0, -0.5, np.inf, -np.inf, np.nan, -np.nan])
def test_dequantize_special_scale_inv(fp8, wide, scale_inv):
    q = jnp.asarray(np.tile(all_codes(fp8), 3))
    si = jnp.float32(scale_inv)
    want = oracle_dequantize(np.asarray(q), scale_inv, wide)
    assert_wide_equal(ops.dequantize(q, si, wide), want)
    assert_wide_equal(on_cpu(ops.dequantize_reference, q, si, wide), want)
    assert_wide_equal(ops.dequantize(q[:7], si, wide), want[:7])


def test_roundtrip_exact_for_representable_values():
    x = jnp.asarray(np.unique(all_codes(ml_dtypes.float8_e4m3fn).astype(np.float32)))
    x = x[jnp.isfinite(x)]
    q, s_inv, _ = ops.quantize(x, jnp.float32(1.0), jnp.float8_e4m3fn)
    np.testing.assert_array_equal(np.asarray(ops.dequantize(q, s_inv)), np.asarray(x))


# ------------------------------------------------------------------ vmap


def test_vmap_unbatched_scale_nested_and_in_axes():
    xs = normal(3, (4, 2, 6, 9), scale=10.0)
    s = jnp.ones((1,), jnp.float32) * 3.0
    f = lambda x: ops.quantize(x, s, jnp.float8_e5m2)
    q, _, amax = jax.jit(jax.vmap(jax.vmap(f)))(xs)
    assert amax.shape == (4, 2, 1)
    for i in range(4):
        for j in range(2):
            wq, _, wa = ops.quantize(xs[i, j], s, jnp.float8_e5m2)
            assert_fp8_equal(q[i, j], wq)
            assert amax[i, j, 0] == wa[0]
    # batch on a non-leading axis
    q2, _, amax2 = jax.vmap(f, in_axes=1)(xs[0])
    assert q2.shape == (6, 2, 9) and amax2.shape == (6, 1)
    assert amax2[3, 0] == jnp.max(jnp.abs(xs[0][:, 3, :]))


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    ("args", "exc", "match"),
    [
        ((jnp.ones(3), jnp.float16(1), jnp.float8_e4m3fn), TypeError, "scale must be float32"),
        ((jnp.ones(3), jnp.ones(2, jnp.float32), jnp.float8_e4m3fn), ValueError, "scale must hold"),
        ((jnp.ones(3), jnp.ones((1, 1), jnp.float32), jnp.float8_e4m3fn), ValueError, "shape"),
        ((jnp.ones(3), jnp.float32(1), jnp.bfloat16), TypeError, "fp8_dtype"),
        ((jnp.ones(3), jnp.float32(1), jnp.float8_e4m3fnuz), TypeError, "fp8_dtype"),
        ((jnp.ones(3), jnp.float32(1), "nonsense"), TypeError, "fp8_dtype"),
        (("abc", jnp.float32(1), jnp.float8_e4m3fn), TypeError, "x must be"),
    ],
)
def test_quantize_bad_input(args, exc, match):
    with pytest.raises(exc, match=match):
        ops.quantize(*args)


def test_dequantize_bad_input():
    q = jnp.zeros(4, jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="scale_inv must hold"):
        ops.dequantize(q, jnp.ones(4, jnp.float32))


# ------------------------------------------------------------------ the conformance sample
# This op's entries in the conformance suite's table (tests/ops/_samples.py, tests/ops/
# test_conformance.py, tests/distributed/test_ops_conformance.py).


def _sample_quantize(key):
    r = np.random.default_rng(key)
    return {
        "f32-e4m3": Sample(ops.quantize, (normal(r, (M, N), F32, 300), scale_of(0.9), E4M3)),
        "bf16-e5m2-vec1": Sample(
            ops.quantize, (normal(r, (M, N), BF16, 3e4), scale_of(0.5, (1,)), E5M2)
        ),
        "f16-rank3": Sample(ops.quantize, (normal(r, (M, 3, 5), F16, 100), scale_of(2.0), E4M3)),
    }


def _sample_dequantize(key):
    r = np.random.default_rng(key)
    return {
        "e4m3-f32": Sample(ops.dequantize, (fp8_codes(r, (M, N), E4M3), scale_of(1 / 3), F32)),
        "e5m2-bf16": Sample(
            ops.dequantize, (fp8_codes(r, (M, N), E5M2), scale_of(300.0, (1,)), BF16)
        ),
        "e4m3-f16-rank3": Sample(
            ops.dequantize, (fp8_codes(r, (M, 2, 7), E4M3), scale_of(0.25), F16)
        ),
    }


SAMPLES = {"quantize": _sample_quantize, "dequantize": _sample_dequantize}
