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


# The contract's codes, written out (docs/numerics.md): (largest finite, NaN, +inf) magnitude
# codes; the sign bit is OR-ed in. E4M3 has no inf, so inf becomes its NaN.
CODES = {
    np.dtype(ml_dtypes.float8_e4m3fn): (0x7E, 0x7F, 0x7F),
    np.dtype(ml_dtypes.float8_e5m2): (0x7B, 0x7E, 0x7C),
}


def oracle_quantize(x: np.ndarray, scale: float, fp8) -> np.ndarray:
    """Independent numpy/ml_dtypes oracle of the FP8 cast of ``float32(x) * scale``.

    Finite products: clipped to +-max and cast with ml_dtypes (RNE). NaN products: the NaN code
    with sign ``sign(x) XOR sign(scale)``. Infinite products: +-max if ``x`` and ``scale`` are
    finite (the multiply overflowed), else the inf code (E5M2 inf, E4M3 NaN) with the product's
    sign.
    """
    max_code, nan_code, inf_code = CODES[np.dtype(fp8)]
    fmax = np.float32(ml_dtypes.finfo(fp8).max)
    x = np.asarray(x).astype(np.float32)
    s = np.float32(scale)
    with np.errstate(over="ignore", invalid="ignore"):
        y = x * s
    finite = np.isfinite(y)
    codes = np.clip(np.where(finite, y, 0), -fmax, fmax).astype(fp8).view(np.uint8)
    nan = np.where(np.signbit(x) ^ np.signbit(s), 0x80, 0) | nan_code
    big = np.where(np.isfinite(x) & np.isfinite(s), max_code, inf_code)
    inf = np.where(np.signbit(y), 0x80, 0) | big
    out = np.where(finite, codes, np.where(np.isnan(y), nan, inf)).astype(np.uint8)
    return out.view(fp8)


def oracle_dequantize(q: np.ndarray, scale_inv: float, out_dtype) -> np.ndarray:
    """Independent oracle of ``dequantize``: ``(float32(q) * scale_inv)`` cast to ``out_dtype``,
    a NaN result being that dtype's quiet NaN with sign ``sign(q) XOR sign(scale_inv)``."""
    out_dtype = np.dtype(out_dtype)
    si = np.float32(scale_inv)
    with np.errstate(over="ignore", invalid="ignore"):
        y = (np.asarray(q).astype(np.float32) * si).astype(out_dtype)
    width, quiet = _QUIET_NAN[out_dtype]
    neg = np.signbit(np.asarray(q).astype(np.float32)) ^ np.signbit(si)  # q's sign, NaN or not
    sign = np.where(neg, 1 << (8 * out_dtype.itemsize - 1), 0).astype(width)
    bits = np.where(np.isnan(y.astype(np.float32)), sign | quiet, y.view(width)).astype(width)
    return bits.view(out_dtype)


_QUIET_NAN = {  # (bits type, positive quiet NaN) per output dtype
    np.dtype(np.float32): (np.uint32, 0x7FC00000),
    np.dtype(ml_dtypes.bfloat16): (np.uint16, 0x7FC0),
    np.dtype(np.float16): (np.uint16, 0x7E00),
}


def bits(a) -> np.ndarray:
    return np.asarray(a).view(np.uint8)


def _assert_same_bits(got, want, width, digits: int) -> None:
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    assert got.shape == want.shape, (got.shape, want.shape)
    gb, wb = got.view(width), want.view(width)
    bad = np.nonzero(gb != wb)
    if bad[0].size:
        i = tuple(b[0] for b in bad)
        raise AssertionError(
            f"{bad[0].size} of {gb.size} values differ in their bits; first at {i}: "
            f"got {gb[i]:#0{digits + 2}x}, want {wb[i]:#0{digits + 2}x}"
        )


def assert_fp8_equal(got, want) -> None:
    """Bit-identical FP8 arrays: every code equal, NaN codes (and their signs) included."""
    _assert_same_bits(got, want, np.uint8, 2)


def assert_wide_equal(got, want) -> None:
    """Bit-identical float32/bfloat16/float16 arrays, NaN bit patterns included."""
    got = np.asarray(got)
    width = {2: np.uint16, 4: np.uint32}[got.dtype.itemsize]
    _assert_same_bits(got, want, width, 2 * got.dtype.itemsize)


def assert_matches(
    got, want, exact: bool, *, ulps: int = 0, rtol: float = 0.0, atol: float = 0.0
) -> None:
    """``got`` equals ``want`` as far as its implementation promises (``exact``: pass
    ``reference_bits_promised(implementation)`` from ``_implementations``).

    ``exact``: the same bits, NaN payloads and signs included (``assert_fp8_equal`` and
    ``assert_wide_equal``); ``ulps``, ``rtol`` and ``atol`` are then ignored. Otherwise (``"xla"``
    on a GPU, docs/numerics.md): NaN exactly where ``want`` is NaN, with any sign and payload (XLA
    gives NaN results its canonical NaN); +-inf exactly where ``want`` has it; and each finite value
    with ``want``'s bits, or at most ``ulps`` steps of its dtype from it on the number line (for
    FP8, codes; +0 and -0 are one point), or within ``atol + rtol * |want|``. FP8 or wide arrays.
    """
    got, want = np.atleast_1d(np.asarray(got)), np.atleast_1d(np.asarray(want))
    size = got.dtype.itemsize
    width = {1: np.uint8, 2: np.uint16, 4: np.uint32}[size]
    if exact:
        _assert_same_bits(got, want, width, 2 * size)
        return
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    assert got.shape == want.shape, (got.shape, want.shape)
    gb, wb = got.view(width), want.view(width)
    with np.errstate(invalid="ignore"):  # signalling NaNs
        gv, wv = (a.astype(np.float32).astype(np.float64) for a in (got, want))
    finite = np.isfinite(gv) & np.isfinite(wv)
    ok = gb == wb
    if ulps:
        sign = 1 << (8 * size - 1)

        def ordinal(b):  # sign-magnitude bits to their order on the number line
            b = b.astype(np.int64)
            return np.where(b & sign, -(b & (sign - 1)), b & (sign - 1))

        ok |= finite & (np.abs(ordinal(gb) - ordinal(wb)) <= ulps)
    if rtol or atol:
        ok |= finite & (np.abs(gv - wv) <= atol + rtol * np.abs(wv))
    bad = np.where(np.isnan(wv), ~np.isnan(gv), ~ok)
    if bad.any():
        i = tuple(b[0] for b in np.nonzero(bad))
        d = 2 * size + 2
        raise AssertionError(
            f"{int(bad.sum())} of {gb.size} values differ beyond ulps={ulps}, rtol={rtol}, "
            f"atol={atol} (NaN: any sign and payload); first at {i}: got {gb[i]:#0{d}x} "
            f"({gv[i]!r}), want {wb[i]:#0{d}x} ({wv[i]!r})"
        )
