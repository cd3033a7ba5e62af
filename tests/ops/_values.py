"""Test inputs for the FP8 casts: every code, every tie, +-1 ulp, and the special values."""

from __future__ import annotations

import ml_dtypes
import numpy as np

FP8_TYPES = (ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2)


def all_codes(fp8) -> np.ndarray:
    """All 256 codes of an FP8 type, as that type."""
    return np.arange(256, dtype=np.uint8).view(fp8)


def finite_positive_values(fp8) -> np.ndarray:
    """Every finite non-negative value of ``fp8`` in increasing order, as float32."""
    v = all_codes(fp8).astype(np.float32)
    v = v[np.isfinite(v) & (v >= 0) & ~np.signbit(v)]
    return np.unique(v)


def special_values(fp8) -> np.ndarray:
    """float32 inputs covering the whole contract of a saturating RNE cast to ``fp8``.

    Every FP8 value, every midpoint between neighbours (ties to even), one float32 ulp either side
    of each value and midpoint, values past max (saturate), +-inf, NaN, signed zeros and float32
    subnormals, with both signs.
    """
    vals = finite_positive_values(fp8)
    mids = (vals[:-1].astype(np.float64) + vals[1:]) / 2
    mids = mids.astype(np.float32)  # exact: FP8 midpoints fit in float32
    fmax = np.float32(ml_dtypes.finfo(fp8).max)
    ulp = np.float32(ml_dtypes.finfo(fp8).eps) * fmax / 2  # spacing just below max
    above = np.array(
        [fmax + ulp / 2, fmax + ulp, fmax * 1.5, 1e30, np.finfo(np.float32).max], np.float32
    )
    base = np.concatenate([vals, mids, above])
    with np.errstate(over="ignore"):
        up = np.nextafter(base, np.float32(np.inf))
    down = np.nextafter(base, np.float32(0))
    tiny = np.array(
        [1e-45, 1e-40, np.finfo(np.float32).tiny, np.finfo(np.float32).smallest_normal / 3],
        np.float32,
    )
    pos = np.concatenate([base, up, down, tiny, [np.inf, 0.0]]).astype(np.float32)
    out = np.concatenate([pos, -pos, [np.nan, -np.nan]]).astype(np.float32)
    return out


def all_16bit(dtype) -> np.ndarray:
    """Every bit pattern of a 16-bit float type (bfloat16 or float16)."""
    return np.arange(1 << 16, dtype=np.uint32).astype(np.uint16).view(dtype)


def oracle_quantize(x: np.ndarray, scale: float, fp8) -> np.ndarray:
    """Independent numpy/ml_dtypes oracle: clip(float32(x) * scale) cast with ml_dtypes (RNE)."""
    fmax = np.float32(ml_dtypes.finfo(fp8).max)
    y = x.astype(np.float32) * np.float32(scale)
    with np.errstate(invalid="ignore"):
        y = np.clip(y, -fmax, fmax)
    return y.astype(fp8)


def bits(a) -> np.ndarray:
    return np.asarray(a).view(np.uint8)


def assert_fp8_equal(got, want) -> None:
    """Bit-identical FP8 arrays; NaNs must sit at the same places (any NaN code)."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    assert got.shape == want.shape, (got.shape, want.shape)
    gn, wn = np.isnan(got.astype(np.float32)), np.isnan(want.astype(np.float32))
    np.testing.assert_array_equal(gn, wn)
    bad = np.nonzero((bits(got) != bits(want)) & ~wn.reshape(-1).reshape(wn.shape))
    if bad[0].size:
        i = tuple(b[0] for b in bad)
        raise AssertionError(
            f"{bad[0].size} codes differ; first at {i}: got {bits(got)[i]:#04x}, "
            f"want {bits(want)[i]:#04x}"
        )


def assert_wide_equal(got, want) -> None:
    """Bit-identical float32/bfloat16/float16 arrays; NaNs compare equal to NaNs."""
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    gf, wf = got.astype(np.float32), want.astype(np.float32)
    np.testing.assert_array_equal(np.isnan(gf), np.isnan(wf))
    ok = ~np.isnan(wf)
    width = {2: np.uint16, 4: np.uint32}[got.dtype.itemsize]
    np.testing.assert_array_equal(got.view(width)[ok], want.view(width)[ok])
