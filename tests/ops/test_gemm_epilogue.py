"""gemm_gelu and gemm_dgelu (fp8jax/ops/gemms/gemm_epilogue.py): the references against a float64
numpy oracle, the CUDA branch with an emulated handler (padding, slicing, attributes), vmap,
bad input, and the custom calls in the program lowered for CUDA.

Tolerances. The inputs are small integers in FP8, so every float32 GEMM sum here is exact and
the oracle's pre-activation equals the reference's. What remains is the float32 GELU (a few
ulps apart from numpy's float64) and one FP8 rounding: the dequantized output is within half an
FP8 step of the oracle, ``2**-(mantissa bits + 1)`` relative, plus the format's subnormal step.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from _implementations import implementation_fixture, only, pytest_generate_tests  # noqa: F401
from _shared import normal

from fp8jax.ops.gemms import gemm_epilogue as ge
from fp8jax.ops.gemms.gemm import WORKSPACE_BYTES

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _gelu(h):
    return 0.5 * h * (1.0 + np.tanh(SQRT_2_OVER_PI * (h + 0.044715 * h**3)))


def _dgelu(h):
    t = np.tanh(SQRT_2_OVER_PI * (h + 0.044715 * h**3))
    return 0.5 * (1 + t) + 0.5 * h * (1 - t * t) * SQRT_2_OVER_PI * (1 + 3 * 0.044715 * h * h)


def _ints(rng, shape, dtype, lo=-4, hi=5):
    return jnp.asarray(rng.integers(lo, hi, shape).astype(np.float32), dtype)


def _operands(m=24, n=40, k=32, seed=0, a_dt=E4M3, b_dt=E4M3):
    rng = np.random.default_rng(seed)
    return _ints(rng, (m, k), a_dt), _ints(rng, (n, k), b_dt), rng


def _within_fp8(q, scale_inv, want, fp8):
    """Dequantized ``q`` is the FP8 rounding of ``want * scale`` (half a step, relative)."""
    info = ml_dtypes.finfo(fp8)
    got = np.asarray(q.astype(jnp.float32), np.float64) * float(scale_inv)
    step = 2.0 ** -(info.nmant + 1) * np.abs(want) + float(info.smallest_subnormal) * float(
        scale_inv
    )
    assert np.all(np.abs(got - want) <= step * 1.0001 + 1e-6 * np.abs(want)), np.max(
        np.abs(got - want) - step
    )


@pytest.mark.parametrize("with_bias", [False, True])
def test_gelu_reference_against_numpy(with_bias, implementation):
    a, b, rng = _operands()
    sa, sb, scale = jnp.float32(0.25), jnp.float32(0.5), jnp.float32(8.0)
    bias = _ints(rng, (40,), jnp.bfloat16) / 4 if with_bias else None
    q, aux, scale_inv, amax = ge.gemm_gelu(a, b, sa, sb, scale, fp8_dtype=E4M3, bias=bias,
                                           implementation=implementation)  # fmt: skip
    h = np.asarray(a, np.float64) @ np.asarray(b, np.float64).T * 0.125
    if with_bias:
        h = h + np.asarray(bias, np.float64)
    assert q.dtype == E4M3 and q.shape == (24, 40)
    assert aux.dtype == jnp.float16
    np.testing.assert_array_equal(np.asarray(aux, np.float64), h.astype(np.float16))
    assert float(scale_inv) == 0.125
    g = _gelu(h)
    np.testing.assert_allclose(float(amax), np.max(np.abs(g)), rtol=1e-6)
    _within_fp8(q, scale_inv, g, E4M3)


@pytest.mark.parametrize("with_dbias", [False, True])
@pytest.mark.parametrize("dbias_dtype", [jnp.bfloat16, jnp.float16])
def test_dgelu_reference_against_numpy(with_dbias, dbias_dtype, implementation):
    a, b, rng = _operands(a_dt=E5M2)
    aux = normal(rng, (24, 40), jnp.float16)
    sa, sb, scale = jnp.float32(0.5), jnp.float32(0.25), jnp.float32(4.0)
    q, scale_inv, amax, dbias = ge.gemm_dgelu(
        a, b, sa, sb, aux, scale, fp8_dtype=E5M2, dbias_dtype=dbias_dtype,
        with_dbias=with_dbias, implementation=implementation,
    )  # fmt: skip
    dh = (np.asarray(a, np.float64) @ np.asarray(b, np.float64).T * 0.125) * _dgelu(
        np.asarray(aux, np.float64)
    )
    np.testing.assert_allclose(float(amax), np.max(np.abs(dh)), rtol=1e-5)
    _within_fp8(q, scale_inv, dh, E5M2)
    if not with_dbias:
        assert dbias is None
        return
    assert dbias.dtype == dbias_dtype and dbias.shape == (40,)
    want = dh.sum(axis=0)
    tol = float(ml_dtypes.finfo(dbias_dtype).eps) * np.abs(want) + 1e-4 * np.abs(dh).sum(axis=0)
    assert np.all(np.abs(np.asarray(dbias, np.float64) - want) <= tol)


@only("kernel")
def test_kernel_equals_xla_on_cpu():
    """On CPU the kernel implementation is the reference: the same bits as ``"xla"``."""
    a, b, rng = _operands(m=17, n=33, k=40)
    bias = _ints(rng, (33,), jnp.float16)
    s = jnp.float32(0.5)
    got = ge.gemm_gelu(a, b, s, s, jnp.float32(16.0), fp8_dtype=E4M3, bias=bias)
    want = ge.gemm_gelu(a, b, s, s, jnp.float32(16.0), fp8_dtype=E4M3, bias=bias,
                        implementation="xla")  # fmt: skip
    for x, y in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    aux = got[1]
    got = ge.gemm_dgelu(a, b, s, s, aux, jnp.float32(2.0), fp8_dtype=E4M3)
    want = ge.gemm_dgelu(a, b, s, s, aux, jnp.float32(2.0), fp8_dtype=E4M3, implementation="xla")
    for x, y in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@only("kernel")
def test_codes_are_viewed_as_their_dtypes():
    a, b, _ = _operands(a_dt=E5M2)
    s = jnp.float32(1.0)
    codes = [jax.lax.bitcast_convert_type(x, jnp.uint8) for x in (a, b)]
    want = ge.gemm_gelu(a, b, s, s, s, fp8_dtype=E4M3)
    got = ge.gemm_gelu(*codes, s, s, s, fp8_dtype=E4M3, dtypes=(E5M2, E4M3))
    for x, y in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# ------------------------------------------------------------------ the CUDA branch, emulated


def _emulated(target, result_types):
    """``jax.ffi.ffi_call`` as the handlers' contract (cpp/cuda/gemm_cublaslt.cc): K and N padded
    to multiples of 16, the 16-bit epilogue dtype from the bias buffer, one scale, one amax."""
    assert target in ("fp8jax_gemm_gelu", "fp8jax_gemm_dgelu")
    seen = result_types

    def call(a, b, a_sinv, b_sinv, x, d_scale, *, has_bias, fast_accum, autotune):
        (m, k), n = a.shape, b.shape[0]
        assert k % 16 == 0 and n % 16 == 0 and b.shape[1] == k
        assert d_scale.shape == (1,) and autotune in (0, 1)
        assert seen[-1].shape == (WORKSPACE_BYTES,)
        ws = jnp.zeros(seen[-1].shape, seen[-1].dtype)
        if target == "fp8jax_gemm_gelu":
            assert fast_accum == 1
            assert x.shape == ((n,) if has_bias else (0,)) and x.dtype in ge.EPILOGUE_DTYPES
            q, aux, _, amax = ge.gemm_gelu_reference(
                a, b, a_sinv, b_sinv, d_scale[0], fp8_dtype=seen[0].dtype,
                bias=x if has_bias else None,
            )  # fmt: skip
            assert seen[1].shape == (m, n) and seen[1].dtype == jnp.float16
            return q, aux, jnp.reshape(amax, (1,)), ws
        assert fast_accum == 0 and x.shape == (m, n) and x.dtype == jnp.float16
        dbias_type = seen[2]
        assert dbias_type.shape == ((n,) if has_bias else (0,))
        q, _, amax, dbias = ge.gemm_dgelu_reference(
            a, b, a_sinv, b_sinv, x, d_scale[0], fp8_dtype=seen[0].dtype,
            dbias_dtype=dbias_type.dtype, with_dbias=bool(has_bias),
        )  # fmt: skip
        dbias = dbias if has_bias else jnp.zeros((0,), dbias_type.dtype)
        return q, jnp.reshape(amax, (1,)), dbias, ws

    return call


@only("kernel")
@pytest.mark.parametrize(("m", "n", "k"), [(5, 7, 9), (16, 32, 48), (3, 40, 20)])
def test_cuda_branch_with_an_emulated_handler(monkeypatch, m, n, k):
    """Padding N adds columns with h = 0 (gelu 0: the amax is unchanged) and p = 0 (dh = 0: the
    bias gradient's padding is dropped); the results are the reference's."""
    monkeypatch.setattr(jax.ffi, "ffi_call", _emulated)
    a, b, rng = _operands(m, n, k)
    s, scale = jnp.float32(0.5), jnp.float32(8.0)
    bias = _ints(rng, (n,), jnp.bfloat16)
    for bias_ in (None, bias):
        cfg = (np.dtype(E4M3), jnp.dtype(jnp.bfloat16), True, True)
        got = ge._gelu_cuda(a, b, s, s, scale, bias_, cfg=cfg)
        q, aux, _, amax = ge.gemm_gelu_reference(a, b, s, s, scale, fp8_dtype=E4M3, bias=bias_)
        for x, y in zip(got, (q, aux, amax), strict=True):
            np.testing.assert_array_equal(np.asarray(x), np.asarray(y))
    aux = normal(rng, (m, n), jnp.float16)
    for with_dbias in (False, True):
        cfg = (np.dtype(E4M3), jnp.dtype(jnp.float16), with_dbias, False)
        got = ge._dgelu_cuda(a, b, s, s, aux, scale, cfg=cfg)
        q, _, amax, dbias = ge.gemm_dgelu_reference(a, b, s, s, aux, scale, fp8_dtype=E4M3,
                                                    dbias_dtype=jnp.float16,
                                                    with_dbias=with_dbias)  # fmt: skip
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(q))
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(amax))
        if with_dbias:
            np.testing.assert_array_equal(np.asarray(got[2]), np.asarray(dbias))
        else:
            assert got[2] is None


def _lowered_cuda_lines(fn, *args) -> list[str]:
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    return [ln for ln in text.splitlines() if "custom_call @fp8jax_gemm" in ln]


@only("kernel")
def test_lowered_for_cuda_each_is_one_custom_call():
    a, b, rng = _operands(m=32, n=48, k=64)
    s = jnp.float32(1.0)
    bias = _ints(rng, (48,), jnp.bfloat16)
    (line,) = _lowered_cuda_lines(
        lambda a, b: ge.gemm_gelu(a, b, s, s, s, fp8_dtype=E4M3, bias=bias), a, b
    )
    assert "@fp8jax_gemm_gelu(" in line and "has_bias = 1" in line and "fast_accum = 1" in line
    assert "autotune = 1" in line
    aux = jnp.zeros((32, 48), jnp.float16)
    (line,) = _lowered_cuda_lines(
        lambda a, b: ge.gemm_dgelu(a, b, s, s, aux, s, fp8_dtype=E4M3, with_dbias=False), a, b
    )
    assert "@fp8jax_gemm_dgelu(" in line and "has_bias = 0" in line and "fast_accum = 0" in line


# ------------------------------------------------------------------ vmap, bad input


@only("kernel")
def test_vmap_is_one_gemm_per_batch_element():
    a, b, _ = _operands(m=8, n=16, k=16)
    a3 = jnp.stack([a, -a, 2 * a])
    s, scale = jnp.float32(0.5), jnp.float32(4.0)
    got = jax.vmap(lambda x: ge.gemm_gelu(x, b, s, s, scale, fp8_dtype=E4M3))(a3)
    for i in range(3):  # each element its own amax
        want = ge.gemm_gelu(a3[i], b, s, s, scale, fp8_dtype=E4M3)
        for x, y in zip(got, want, strict=True):
            np.testing.assert_array_equal(np.asarray(x[i] if x.ndim else x), np.asarray(y))


@pytest.mark.parametrize(
    ("fn", "change", "exc", "match"),
    [
        (
            "gelu",
            dict(a=jnp.ones((4, 16), E5M2), b=jnp.ones((8, 16), E5M2)),
            TypeError,
            "cannot both be float8_e5m2",
        ),
        ("gelu", dict(b=jnp.ones((8, 32), E4M3)), ValueError, "the same K"),
        ("gelu", dict(bias=jnp.ones((8,), jnp.float32)), ValueError, "bfloat16 or float16"),
        ("gelu", dict(bias=jnp.ones((7,), jnp.bfloat16)), ValueError, r"\[N\]"),
        ("gelu", dict(scale=jnp.ones((2,), jnp.float32)), ValueError, "scale must hold one"),
        ("gelu", dict(dtypes=(E4M3, E4M3)), TypeError, "must hold uint8 codes"),
        ("dgelu", dict(aux=jnp.ones((4, 8), jnp.bfloat16)), ValueError, "aux must be float16"),
        ("dgelu", dict(dbias_dtype=jnp.float32), ValueError, "dbias_dtype must be"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_bad_input(fn, change, exc, match):
    kw = dict(a=jnp.ones((4, 16), E4M3), b=jnp.ones((8, 16), E4M3), a_scale_inv=jnp.float32(1),
              b_scale_inv=jnp.float32(1), scale=jnp.float32(1), fp8_dtype=E4M3)  # fmt: skip
    if fn == "dgelu":
        kw["aux"] = jnp.ones((4, 8), jnp.float16)
    kw.update(change)
    with pytest.raises(exc, match=match):
        (ge.gemm_gelu if fn == "gelu" else ge.gemm_dgelu)(**kw)
