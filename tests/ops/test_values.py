"""The test helper ``assert_matches`` (tests/ops/_values.py), on both branches.

Its not-exact branch runs only for ``"xla"`` on a GPU; here it is fed what the GPU run gave
(canonical NaNs, NaN codes without their sign, neighbouring codes, a division's last bits).
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from _values import assert_matches

E4M3, E5M2 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2


def _f32(*bits: int) -> np.ndarray:
    return np.array(bits, np.uint32).view(np.float32)


def _fp8(fp8, *codes: int) -> np.ndarray:
    return np.array(codes, np.uint8).view(fp8)


def _both(got, want, **kw) -> tuple[bool, bool]:
    """Whether ``assert_matches`` passes (exact, not exact)."""
    out = []
    for exact in (True, False):
        try:
            assert_matches(got, want, exact, **kw)
            out.append(True)
        except AssertionError:
            out.append(False)
    return out[0], out[1]


def test_identical_bits_pass_both():
    for a in (_f32(0x7FC00001, 0x80000000, 0x3F800000), _fp8(E5M2, 0xFE, 0x80, 0x7C)):
        assert _both(a, a.copy(), ulps=1) == (True, True)


def test_nan_payload_and_sign_only_when_not_exact():
    # amax: XLA:GPU's canonical NaN for the reference's; q: the NaN code without its sign.
    assert _both(_f32(0x7FFFFFFF), _f32(0x7FC00000)) == (False, True)
    assert _both(_fp8(E4M3, 0x7F, 0x01), _fp8(E4M3, 0xFF, 0x01)) == (False, True)
    assert _both(_fp8(E5M2, 0x7E), _fp8(E5M2, 0xFE)) == (False, True)
    # NaN against a number, a number against NaN: never.
    assert _both(_f32(0x7FC00000), _f32(0x3F800000), rtol=1.0) == (False, False)
    assert _both(_f32(0x3F800000), _f32(0x7FC00000), rtol=1.0) == (False, False)
    assert _both(_fp8(E4M3, 0x7E), _fp8(E4M3, 0x7F), ulps=1) == (False, False)


def test_finite_values_keep_their_bits_without_a_tolerance():
    assert _both(_f32(0x80000000), _f32(0x00000000)) == (False, False)  # -0 vs +0
    assert _both(_fp8(E4M3, 0x52), _fp8(E4M3, 0x53)) == (False, False)
    assert _both(_f32(0x40888001), _f32(0x40888000)) == (False, False)


def test_ulps_are_steps_on_the_number_line():
    assert _both(_fp8(E4M3, 0xD6, 0x53), _fp8(E4M3, 0xD7, 0x52), ulps=1) == (False, True)
    assert _both(_fp8(E4M3, 0x80), _fp8(E4M3, 0x01), ulps=1) == (False, True)  # -0 to 2**-9
    assert _both(_fp8(E4M3, 0x81), _fp8(E4M3, 0x01), ulps=1) == (False, False)  # 2 steps
    assert _both(_fp8(E4M3, 0x50), _fp8(E4M3, 0x52), ulps=1) == (False, False)
    # The state update's scales: XLA's div.full against the correctly rounded quotient.
    assert _both(_f32(0xC00387CC), _f32(0xC00387CD), ulps=2) == (False, True)
    assert _both(_f32(0x43155556), _f32(0x43155555), ulps=2) == (False, True)
    assert _both(_f32(0x43155558), _f32(0x43155555), ulps=2) == (False, False)


def test_infinities_match_exactly():
    # inf is one step above the largest finite value; no tolerance makes them equal.
    assert _both(_f32(0x7F800000), _f32(0x7F7FFFFF), ulps=2, rtol=1.0) == (False, False)
    assert _both(_fp8(E5M2, 0x7C), _fp8(E5M2, 0x7B), ulps=1) == (False, False)
    assert _both(_f32(0xFF800000), _f32(0x7F800000), ulps=2) == (False, False)


def test_rtol_and_atol():
    # Norm amax: float32 max of y not rounded to f16 (4.26575) vs of y rounded (4.265625).
    got, want = _f32(0x408880D0), _f32(0x40888000)
    assert _both(got, want, rtol=float(np.finfo(np.float16).eps)) == (False, True)
    assert _both(got, want, rtol=float(np.finfo(np.float32).eps)) == (False, False)
    assert _both(got, want, atol=1e-4) == (False, True)


def test_shape_and_dtype_must_agree():
    with pytest.raises(AssertionError):
        assert_matches(_f32(0, 0), _f32(0), False, ulps=1)
    with pytest.raises(AssertionError):
        assert_matches(_fp8(E4M3, 1), _fp8(E5M2, 1), False, ulps=1)


def test_scalars_and_the_message():
    assert_matches(np.float32(2.0), np.float32(2.0), True)
    with pytest.raises(AssertionError, match=r"1 of 2 values .* got 0x50 .* want 0x52"):
        assert_matches(_fp8(E4M3, 0, 0x50), _fp8(E4M3, 0, 0x52), False, ulps=1)
