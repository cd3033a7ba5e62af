"""Activations: values vs the references and a float64 oracle, FP8 forms exact, gradients.

Tolerances. The ``"xla"`` implementation *is* the reference (compared bit for bit). The CPU
kernel computes the same float32 expressions in the same order, but its tanh/erf/exp are the C
library's, which may differ from XLA's by a few float32 ulps; after the one rounding to the
output dtype that is at most one ulp of the output dtype, plus, where the formula cancels
(``1 + tanh(u)`` for large negative ``u``, ``1 - t * t`` near ``t = 1``), a few float32 ulps of
the inputs' magnitude: ``|got - want| <= ulp(want) + 16 * eps32 * scale`` where ``scale`` is
the product of ``1 + |.|`` of the operands. The same bound (with the ulp of the float32 math)
holds against a float64 oracle. Within one implementation the FP8 forms are bit-identical to
``quantize`` of the high-precision forms.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import jax.test_util
import ml_dtypes
import numpy as np
import pytest
from _dbias import strip_order_sum
from _implementations import (  # noqa: F401
    implementation_fixture,
    pytest_generate_tests,
    reference_bits_promised,
)
from _samples import ACT_CLOSE, BF16, F16, F32, M, N, Sample, dyadic, scale_of
from _shared import normal
from _values import assert_matches
from conftest import on_cpu
from scipy import special

from fp8jax import ops

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
ACTS = [
    ("gelu",),
    ("gelu_exact",),
    ("relu",),
    ("silu",),
    ("linear",),
    ("gelu", "linear"),
    ("silu", "linear"),
    ("relu", "linear"),
    ("gelu_exact", "linear"),
]
WIDE = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}
SHAPES = [(1, 768), (3, 1000), (37, 4097)]  # (m, n): odd rows, odd and unaligned columns


def _shape(acts, wide):
    """Every activation and dtype once, each with one of SHAPES in turn (each shape with
    every activation): the cross product adds nothing per shape but time."""
    return SHAPES[(ACTS.index(acts) + list(WIDE).index(wide)) % len(SHAPES)]


def _inputs(m, n, k, dtype, seed=0):
    rng = np.random.default_rng(seed)
    return normal(rng, (m, k, n), dtype, 3.0), normal(rng, (m, n), dtype)


# ------------------------------------------------------------------ float64 oracle


def _act64(name, a):
    if name == "gelu":
        return 0.5 * a * (1 + np.tanh(np.sqrt(2 / np.pi) * (a + 0.044715 * a**3)))
    if name == "gelu_exact":
        return 0.5 * a * (1 + special.erf(a / np.sqrt(2)))
    if name == "relu":
        return np.maximum(a, 0)
    if name == "silu":
        return a * special.expit(a)
    return a


def _dact64(name, a):
    if name == "gelu":
        c = np.sqrt(2 / np.pi)
        t = np.tanh(c * (a + 0.044715 * a**3))
        return 0.5 * (1 + t) + 0.5 * a * (1 - t * t) * c * (1 + 3 * 0.044715 * a * a)
    if name == "gelu_exact":
        return 0.5 * (1 + special.erf(a / np.sqrt(2))) + a * np.exp(-a * a / 2) / np.sqrt(2 * np.pi)
    if name == "relu":
        return (a > 0).astype(np.float64)
    if name == "silu":
        s = special.expit(a)
        return s * (1 + a * (1 - s))
    return np.ones_like(a)


def _oracle(x, g, acts):
    x = np.asarray(x, np.float64)
    g = np.asarray(g, np.float64)
    a = x[:, 0]
    b = x[:, 1] if len(acts) == 2 else 1.0
    y = _act64(acts[0], a) * b
    da = g * _dact64(acts[0], a) * b
    dx = np.stack([da, g * _act64(acts[0], a)], axis=1) if len(acts) == 2 else da[:, None]
    return y, dx


def _assert_close(got, want, dtype, scale):
    """``|got - want| <= ulp(want) in dtype + 16 eps32 * scale`` (module docstring)."""
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    eps = float(ml_dtypes.finfo(dtype).eps)
    tol = eps * np.abs(want) + 16 * float(np.finfo(np.float32).eps) * scale
    tol += float(ml_dtypes.finfo(dtype).smallest_subnormal)
    bad = np.abs(got - want) > tol
    assert not bad.any(), (got[bad][:5], want[bad][:5], int(bad.sum()))


def _scales(x, g):
    x = np.abs(np.asarray(x, np.float64))
    g = np.abs(np.asarray(g, np.float64))
    sx = (1 + x[:, 0]) ** 3 * ((1 + x[:, 1]) if x.shape[1] == 2 else 1.0)
    return sx, sx * (1 + g)


def _same(got, want):
    got, want = np.asarray(got), np.asarray(want)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.tobytes() == want.tobytes()


# ------------------------------------------------------------------ values


@pytest.mark.parametrize("wide", list(WIDE), ids=list(WIDE))
@pytest.mark.parametrize("acts", ACTS, ids="-".join)
def test_activation_values(acts, wide, implementation):
    dtype = WIDE[wide]
    m, n = _shape(acts, wide)
    x, g = _inputs(m, n, len(acts), dtype)
    y = ops.activation(x, acts)
    dx = ops.dactivation(g, x, acts)
    assert y.shape == (m, n) and y.dtype == dtype
    assert dx.shape == (m, len(acts), n) and dx.dtype == dtype
    ry = on_cpu(jax.jit(ops.activation_reference, static_argnums=1), x, acts)
    rdx = on_cpu(jax.jit(ops.dactivation_reference, static_argnums=2), g, x, acts)
    sy, sdx = _scales(x, g)
    if implementation == "xla" and reference_bits_promised(implementation):  # it is the reference
        _same(y, ry)
        _same(dx, rdx)
    else:
        _assert_close(y, ry, dtype, sy)
        _assert_close(dx, rdx, dtype, sdx[:, None])
    oy, odx = _oracle(x, g, acts)
    _assert_close(y, oy, dtype, sy)
    _assert_close(dx, odx, dtype, sdx[:, None])


@pytest.mark.parametrize("wide", list(WIDE), ids=list(WIDE))
@pytest.mark.parametrize("acts", ACTS, ids="-".join)
def test_fp8_forms_are_quantize_of_the_same_implementation(acts, wide, implementation):
    dtype = WIDE[wide]
    m, n = _shape(acts, wide)
    k = len(acts)
    x, g = _inputs(m, n, k, dtype, seed=1)
    scale = jnp.float32(7.0)
    fp8 = E4M3 if wide != "f16" else E5M2

    # Exact within an implementation; "xla" on a GPU may skip the rounding to dtype inside its
    # fusion (excess precision): then a code may be its neighbour and amax off by one ulp of dtype.
    exact = reference_bits_promised(implementation)
    eps = float(ml_dtypes.finfo(dtype).eps)

    y = ops.activation(x, acts)
    wq, wsi, wamax = ops.quantize(y, scale, fp8)
    q, qt, si, amax = ops.activation_cast_transpose(x, scale, fp8, acts)
    assert_matches(q, wq, exact, ulps=1)
    assert_matches(qt, np.swapaxes(np.asarray(wq), 0, 1), exact, ulps=1)
    _same(si, wsi)
    assert_matches(amax, wamax, exact, rtol=eps)

    dx = ops.dactivation(g, x, acts)
    wq, wsi, wamax = ops.quantize(dx, scale, fp8)
    q, qt, si, amax, dbias = ops.dactivation_cast_transpose_dbias(g, x, scale, fp8, acts)
    assert q.shape == (m, k, n) and qt.shape == (k, n, m) and dbias.shape == (k, n)
    assert_matches(q, wq, exact, ulps=1)
    assert_matches(qt, np.transpose(np.asarray(wq), (1, 2, 0)), exact, ulps=1)
    _same(si, wsi)
    assert_matches(amax, wamax, exact, rtol=eps)
    want = np.asarray(dx, np.float64).sum(axis=0)
    mag = np.abs(np.asarray(dx, np.float64)).sum(axis=0)
    if implementation == "kernel":  # the kernels' fixed order (tests/ops/_dbias.py), bit for bit
        want_bits = strip_order_sum(np.asarray(dx, np.float32).reshape(m, k * n)).reshape(k, n)
        np.testing.assert_array_equal(np.asarray(dbias), want_bits)
    tol = 4e-7 * mag * np.log2(m + 1) + 1e-30
    if implementation == "xla":
        # XLA fuses dx into the sum: it may skip the rounding to dtype and contract the float32
        # math differently (FMA), so its dbias is the sum of a slightly different dx.
        tol += (eps + 8 * float(np.finfo(np.float32).eps)) * mag
    if not exact:  # a rounding to dtype skipped on a GPU is also up to half a subnormal of dtype
        tol += m * float(ml_dtypes.finfo(dtype).smallest_subnormal)
    np.testing.assert_array_less(np.abs(np.asarray(dbias) - want), tol)


def test_dbias_is_deterministic():
    x, g = _inputs(300, 520, 2, jnp.bfloat16, seed=3)
    f = jax.jit(
        lambda g, x: ops.dactivation_cast_transpose_dbias(
            g, x, jnp.float32(1), E5M2, ("gelu", "linear")
        )
    )
    first = f(g, x)
    for _ in range(3):
        for a, b in zip(f(g, x), first, strict=True):
            _same(a, b)


# ------------------------------------------------------------------ gradients and vmap


@pytest.mark.parametrize("acts", ACTS, ids="-".join)
def test_check_grads(acts):
    x, _ = _inputs(3, 16, len(acts), jnp.float32, seed=2)
    if acts[0] == "relu":  # keep away from the kink, where finite differences are meaningless
        x = jnp.where(jnp.abs(x) < 0.1, 0.5, x)
    jax.test_util.check_grads(lambda x: ops.activation(x, acts), (x,), order=1, modes=["rev"])


def test_grad_matches_dactivation():
    x, g = _inputs(4, 24, 2, jnp.float32, seed=4)
    acts = ("silu", "linear")
    _, vjp = jax.vjp(lambda x: ops.activation(x, acts), x)
    _same(vjp(g)[0], ops.dactivation(g, x, acts))


def test_empty_rows():
    x = jnp.zeros((0, 2, 8), jnp.float32)
    g = jnp.zeros((0, 8), jnp.float32)
    assert ops.activation(x, ("silu", "linear")).shape == (0, 8)
    q, qt, si, amax, dbias = ops.dactivation_cast_transpose_dbias(
        g, x, jnp.float32(2), E4M3, ("silu", "linear")
    )
    assert q.shape == (0, 2, 8) and qt.shape == (2, 8, 0)
    assert float(amax) == 0.0 and float(si) == 0.5
    np.testing.assert_array_equal(np.asarray(dbias), np.zeros((2, 8), np.float32))


# ------------------------------------------------------------------ bad input


def test_bad_activations():
    x = jnp.ones((2, 1, 4))
    for bad in [("tanh",), ("linear", "gelu"), ("gelu", "gelu"), ("linear", "linear"), (), 3]:
        with pytest.raises(ValueError, match="activations must be"):
            ops.activation(x, bad)
    assert ops.activation(x, "swish").shape == (2, 4)  # one name, an alias


def test_bad_shapes_and_dtypes():
    x = jnp.ones((2, 2, 4))
    with pytest.raises(ValueError, match="k = len"):
        ops.activation(x, ("gelu",))
    with pytest.raises(ValueError, match=r"\[m, k, n\]"):
        ops.activation(jnp.ones((2, 4)), ("gelu",))
    with pytest.raises(ValueError, match="g must have shape"):
        ops.dactivation(jnp.ones((2, 5)), x, ("gelu", "linear"))
    with pytest.raises(TypeError, match="share a dtype"):
        ops.dactivation(jnp.ones((2, 4), jnp.bfloat16), x, ("gelu", "linear"))
    with pytest.raises(ValueError, match="scale must hold"):
        ops.activation_cast_transpose(x, jnp.ones(2), E4M3, ("gelu", "linear"))


# ------------------------------------------------------------------ the conformance sample
# This op's entries in the conformance suite's table (tests/ops/_samples.py, tests/ops/
# test_conformance.py, tests/distributed/test_ops_conformance.py).

_SAMPLE_ACTS = {"gelu": ("gelu",), "swiglu": ("silu", "linear"), "reglu": ("relu", "linear")}


def _sample_x(r, acts, dtype):
    return normal(r, (M, len(acts), N), dtype, 3)


def _sample_activation(key):
    r = np.random.default_rng(key)
    out = {}
    for (name, acts), dt in zip(_SAMPLE_ACTS.items(), (F32, BF16, F16), strict=True):
        close = None if name == "reglu" else ACT_CLOSE
        out[name] = Sample(ops.activation, (_sample_x(r, acts, dt), acts), close=close)
    return out


def _sample_dactivation(key):
    r = np.random.default_rng(key)
    out = {}
    for (name, acts), dt in zip(_SAMPLE_ACTS.items(), (F32, BF16, F16), strict=True):
        close = None if name == "reglu" else ACT_CLOSE
        x, g = _sample_x(r, acts, dt), normal(r, (M, N), dt)
        out[name] = Sample(ops.dactivation, (g, x, acts), close=close)
    return out


def _sample_activation_cast_transpose(key):
    r = np.random.default_rng(key)
    return {
        "gelu-e4m3": Sample(
            ops.activation_cast_transpose,
            (_sample_x(r, ("gelu",), F32), scale_of(16.0), E4M3, ("gelu",)),
            close=ACT_CLOSE,
        ),
        "swiglu-e5m2": Sample(
            ops.activation_cast_transpose,
            (
                _sample_x(r, _SAMPLE_ACTS["swiglu"], BF16),
                scale_of(1.0, (1,)),
                E5M2,
                _SAMPLE_ACTS["swiglu"],
            ),
            close=ACT_CLOSE,
        ),
    }


def _sample_dactivation_cast_transpose_dbias(key):
    r = np.random.default_rng(key)
    out = {}
    for name, dt, fp8 in (("reglu", F32, E4M3), ("swiglu", BF16, E5M2)):
        acts = _SAMPLE_ACTS[name]
        x = dyadic(r, (M, len(acts), N), dt)
        g = dyadic(r, (M, N), dt)
        close = None if name == "reglu" else ACT_CLOSE  # relu on dyadic values: exact sums
        out[name] = Sample(
            ops.dactivation_cast_transpose_dbias,
            (g, x, scale_of(2.0), fp8, acts),
            close=close,
            sums=(4,),
        )
    return out


SAMPLES = {
    "activation": _sample_activation,
    "dactivation": _sample_dactivation,
    "activation_cast_transpose": _sample_activation_cast_transpose,
    "dactivation_cast_transpose_dbias": _sample_dactivation_cast_transpose_dbias,
}
