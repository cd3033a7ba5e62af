"""quantize / dequantize: kernel vs jnp reference vs numpy oracle, bit for bit."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from _values import (
    FP8_TYPES,
    all_16bit,
    all_codes,
    assert_fp8_equal,
    assert_wide_equal,
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
    s = jnp.full(scale_shape, scale, jnp.float32)
    q, s_inv, amax = ops.quantize(jnp.asarray(x), s, fp8)
    rq, rs_inv, ramax = on_cpu(ops.quantize_reference, jnp.asarray(x), s, fp8)
    want = oracle_quantize(x, scale, fp8)
    assert_fp8_equal(q, want)
    assert_fp8_equal(rq, want)
    assert s_inv.shape == amax.shape == scale_shape
    np.testing.assert_array_equal(np.asarray(s_inv), np.asarray(rs_inv))
    np.testing.assert_array_equal(np.asarray(s_inv), np.float32(1) / np.float32(scale))
    np.testing.assert_array_equal(np.asarray(amax), np.asarray(ramax))
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


@pytest.mark.parametrize("fp8", FP8_TYPES, ids=lambda t: t.__name__)
def test_quantize_specials_documented_choices(fp8):
    fmax = float(ml_dtypes.finfo(fp8).max)
    x = jnp.array([np.inf, -np.inf, np.nan, 0.0, -0.0, 1e6, -1e6], jnp.float32)
    q, _, amax = ops.quantize(x, jnp.float32(1.0), fp8)
    qf = np.asarray(q).astype(np.float32)
    assert qf[0] == fmax and qf[1] == -fmax  # +-inf saturate to +-max
    assert np.isnan(qf[2])  # NaN stays NaN
    assert qf[3] == 0 and not np.signbit(qf[3])  # +0
    assert qf[4] == 0 and np.signbit(qf[4])  # -0 keeps its sign
    assert qf[5] == fmax and qf[6] == -fmax  # finite overflow saturates
    assert np.isnan(np.asarray(amax))  # amax propagates NaN


SHAPES = [(1,), (7,), (1023,), (4097,), (3, 5), (2, 3, 7), (2, 3, 4, 5), (0,), (4, 0)]


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("wide", WIDE, ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("scale_shape", [(), (1,)], ids=["scalar", "vec1"])
def test_quantize_shapes_dtypes(shape, wide, scale_shape):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(shape) * 50).astype(wide)
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
    want = (np.asarray(q).astype(np.float32) * np.float32(scale_inv)).astype(wide)
    assert got.dtype == wide and got.shape == q.shape
    assert_wide_equal(got, want)
    assert_wide_equal(ref, want)
    for n in (1, 7, 255):  # scalar path
        assert_wide_equal(ops.dequantize(q[:n], si, wide), want[:n])


def test_roundtrip_exact_for_representable_values():
    x = jnp.asarray(np.unique(all_codes(ml_dtypes.float8_e4m3fn).astype(np.float32)))
    x = x[jnp.isfinite(x)]
    q, s_inv, _ = ops.quantize(x, jnp.float32(1.0), jnp.float8_e4m3fn)
    np.testing.assert_array_equal(np.asarray(ops.dequantize(q, s_inv)), np.asarray(x))


# ------------------------------------------------------------------ jit, vmap, HLO


def test_jit_matches_eager_and_hlo_has_custom_call():
    x = jnp.linspace(-600, 600, 1000, dtype=jnp.bfloat16)
    f = jax.jit(lambda x, s: ops.quantize(x, s, jnp.float8_e4m3fn))
    s = jnp.float32(0.5)
    for a, b in zip(f(x, s), ops.quantize(x, s, jnp.float8_e4m3fn), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    hlo = f.lower(x, s).as_text()
    assert "fp8jax_quantize" in hlo
    g = jax.jit(lambda q, s: ops.dequantize(q, s, jnp.bfloat16))
    assert "fp8jax_dequantize" in g.lower(f(x, s)[0], s).as_text()


def test_vmap_each_element_is_its_own_tensor():
    rng = np.random.default_rng(2)
    xs = jnp.asarray(rng.standard_normal((5, 3, 33)).astype(np.float32) * 100)
    scales = jnp.asarray([1.0, 0.5, 2.0, 4.0, 0.25], jnp.float32)
    q, s_inv, amax = jax.vmap(lambda x, s: ops.quantize(x, s, jnp.float8_e4m3fn))(xs, scales)
    assert q.shape == xs.shape and amax.shape == (5,)
    for i in range(5):
        wq, ws, wa = ops.quantize(xs[i], scales[i], jnp.float8_e4m3fn)
        assert_fp8_equal(q[i], wq)
        assert s_inv[i] == ws and amax[i] == wa


def test_vmap_unbatched_scale_nested_and_in_axes():
    rng = np.random.default_rng(3)
    xs = jnp.asarray(rng.standard_normal((4, 2, 6, 9)).astype(np.float32) * 10)
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


def test_vmap_dequantize():
    q = jnp.asarray(np.tile(all_codes(ml_dtypes.float8_e4m3fn), (3, 1)))
    si = jnp.asarray([1.0, 0.5, 0.25], jnp.float32)
    got = jax.vmap(lambda q, s: ops.dequantize(q, s, jnp.float32))(q, si)
    for i in range(3):
        np.testing.assert_array_equal(np.asarray(got[i]), np.asarray(ops.dequantize(q[i], si[i])))


# ------------------------------------------------------------------ bad input


@pytest.mark.parametrize(
    ("args", "exc", "match"),
    [
        ((jnp.ones(3, jnp.int32), jnp.float32(1), jnp.float8_e4m3fn), TypeError, "x must be"),
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
    with pytest.raises(TypeError, match="q must be float8"):
        ops.dequantize(jnp.zeros(4, jnp.float32), jnp.float32(1))
    with pytest.raises(TypeError, match="out_dtype"):
        ops.dequantize(q, jnp.float32(1), jnp.int8)
    with pytest.raises(ValueError, match="scale_inv must hold"):
        ops.dequantize(q, jnp.ones(4, jnp.float32))
