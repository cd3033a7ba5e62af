"""LayerNorm / RMSNorm: forward and backward vs the references, the FP8 form bit for bit.

Tolerances. The kernels sum each row (and dgamma/dbeta each column) in another order than XLA
does, so float32 results differ from the references by a few float32 ulps of the sums: we allow
``64 * eps(f32)`` relative to the largest magnitude of the output (``_TOL_F32``). A bfloat16 or
float16 result rounds those float32 values once more, and one that sits on a rounding boundary
may land one output ulp away: we also allow ``eps(dtype)`` relative to the value (one ulp).
The FP8 form is compared bit for bit with ``quantize(norm_forward(...))`` of the same
implementation, which is its definition, and a rank-3 or vmapped call with the plain one. Not for
``"xla"`` on a GPU (``reference_bits_promised``), which sums a row in an order that depends on the
shape and the batching and may skip the rounding to bf16/f16 before the FP8 cast: there FP8 codes
may be neighbours and wide values are held to the tolerance above (``assert_same``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _implementations import (  # noqa: F401
    implementation_fixture,
    pytest_generate_tests,
    reference_bits_promised,
)
from _samples import BF16, E4M3, E5M2, F32, NORM_CLOSE, M, N, Sample, scale_of
from _shared import normal
from _values import assert_matches, assert_wide_equal
from jax.test_util import check_grads

from fp8jax import ops

WIDE = [jnp.float32, jnp.bfloat16, jnp.float16]
WIDE_IDS = ["f32", "bf16", "f16"]
HIDDEN = [768, 1000, 4097]
ROWS = [1, 3, 37]
EPS = 1e-5
_TOL_F32 = 64 * float(np.finfo(np.float32).eps)


def _inputs(m, h, dtype, norm_type, seed=0):
    rng = np.random.default_rng(seed + 7 * m + h)
    x, gamma = normal(rng, (m, h), dtype, 3.0, 0.5), normal(rng, h, F32, 0.2, 1.0)
    return x, gamma, normal(rng, h, F32, 0.2) if norm_type == "layernorm" else None


def _tolerance(want, dtype=None) -> dict[str, float]:
    """The tolerance of the module docstring, as ``rtol`` and ``atol``."""
    want = np.asarray(want, np.float32)
    scale = float(np.max(np.abs(want))) if want.size else 0.0
    rtol = float(jnp.finfo(dtype).eps) if dtype is not None else 0.0
    return dict(rtol=rtol, atol=_TOL_F32 * max(scale, 1.0))


def assert_close(got, want, dtype=None):
    """Equal within the tolerance of the module docstring."""
    got = np.asarray(got, np.float32)
    want = np.asarray(want, np.float32)
    assert got.shape == want.shape, (got.shape, want.shape)
    np.testing.assert_allclose(got, want, **_tolerance(want, dtype))


def assert_same(got, want, exact: bool, dtype=None):
    """Bit for bit if ``exact``; else FP8 codes one apart at most, wide values as assert_close."""
    if np.asarray(got).dtype.itemsize == 1:
        assert_matches(got, want, exact, ulps=1)
    else:
        assert_matches(got, want, exact, **_tolerance(want, dtype))


def _fwd_ref(x, gamma, beta, **kw):
    return jax.jit(lambda x, g, b: ops.norm_forward_reference(x, g, b, **kw))(x, gamma, beta)


@pytest.mark.parametrize("h", HIDDEN)
@pytest.mark.parametrize("dtype", WIDE, ids=WIDE_IDS)
@pytest.mark.parametrize("norm_type", ["layernorm", "rmsnorm"])
def test_norm_forward(norm_type, dtype, h):
    zero_centered_gamma = (HIDDEN.index(h) + WIDE.index(dtype)) % 2 == 1  # both, alternating
    kw = dict(norm_type=norm_type, epsilon=EPS, zero_centered_gamma=zero_centered_gamma)
    for m in ROWS:
        x, gamma, beta = _inputs(m, h, dtype, norm_type)
        if zero_centered_gamma:
            gamma = gamma - 1
        y, mu, rs = ops.norm_forward(x, gamma, beta, **kw)
        ry, rmu, rrs = _fwd_ref(x, gamma, beta, **kw)
        assert y.dtype == dtype and y.shape == x.shape
        assert mu.shape == rs.shape == (m,) and mu.dtype == rs.dtype == jnp.float32
        assert_close(y, ry, dtype)
        assert_close(mu, rmu)
        assert_close(rs, rrs)
        if norm_type == "rmsnorm":
            assert not np.any(np.asarray(mu))


@pytest.mark.parametrize("h", HIDDEN)
@pytest.mark.parametrize("dtype", WIDE, ids=WIDE_IDS)
@pytest.mark.parametrize("norm_type", ["layernorm", "rmsnorm"])
def test_norm_forward_fp8_is_quantize_of_forward(norm_type, dtype, h, implementation):
    fp8 = (jnp.float8_e4m3fn, jnp.float8_e5m2)[(HIDDEN.index(h) + WIDE.index(dtype)) % 2]
    exact = reference_bits_promised(implementation)
    for m, zcg in ((1, False), (3, True), (37, False)):
        x, gamma, beta = _inputs(m, h, dtype, norm_type, seed=1)
        kw = dict(norm_type=norm_type, epsilon=EPS, zero_centered_gamma=zcg)
        scale = jnp.float32(40.0)
        q, q_t, s_inv, amax, mu, rs = ops.norm_forward_fp8(x, gamma, beta, scale, fp8, **kw)
        y, wmu, wrs = ops.norm_forward(x, gamma, beta, **kw)
        wq, ws_inv, wamax = ops.quantize(y, scale, fp8)
        assert_same(q, wq, exact)
        assert_same(q_t, np.asarray(wq).T, exact)
        assert_same(amax, wamax, exact, dtype)  # one rounding to dtype skipped: one ulp of it
        assert_same(s_inv, ws_inv, exact)
        assert_same(mu, wmu, exact)
        assert_same(rs, wrs, exact)


def test_norm_forward_fp8_saturates_and_keeps_scale_shape():
    x, gamma, beta = _inputs(5, 64, jnp.bfloat16, "layernorm")
    kw = dict(norm_type="layernorm", epsilon=EPS)
    q, q_t, s_inv, amax, _, _ = ops.norm_forward_fp8(
        x, gamma, beta, jnp.full((1,), 1e4, jnp.float32), jnp.float8_e4m3fn, **kw
    )
    assert s_inv.shape == amax.shape == (1,) and q_t.shape == (64, 5)
    assert float(np.max(np.abs(np.asarray(q, np.float32)))) == 448.0


@pytest.mark.parametrize("h", [768, 1000])
@pytest.mark.parametrize("dtype", WIDE, ids=WIDE_IDS)
@pytest.mark.parametrize("zero_centered_gamma", [False, True], ids=["gamma", "zc"])
@pytest.mark.parametrize("norm_type", ["layernorm", "rmsnorm"])
def test_norm_backward_vs_vjp_of_reference(norm_type, zero_centered_gamma, dtype, h):
    kw = dict(norm_type=norm_type, zero_centered_gamma=zero_centered_gamma)
    for m in ROWS:
        x, gamma, beta = _inputs(m, h, dtype, norm_type, seed=2)
        dy = normal(m, (m, h), dtype)
        _, mu, rs = ops.norm_forward(x, gamma, beta, epsilon=EPS, **kw)
        dx, dgamma, dbeta = ops.norm_backward(dy, x, mu, rs, gamma, **kw)

        def f(x, g, b):
            return ops.norm_forward_reference(x, g, b, epsilon=EPS, **kw)[0]

        _, vjp = jax.vjp(f, x.astype(jnp.float32), gamma, beta)
        want_dx, want_dg, want_db = vjp(dy.astype(jnp.float32))
        assert dx.dtype == dtype and dgamma.dtype == dbeta.dtype == jnp.float32
        # dy rounded to dtype is the only difference from the f32 vjp; dx then rounds once.
        assert_close(dx, want_dx, dtype)
        assert_close(dgamma, want_dg)
        if norm_type == "layernorm":
            assert_close(dbeta, want_db)
        else:
            assert not np.any(np.asarray(dbeta))


@pytest.mark.parametrize("h", [768, 1000, 4097])
def test_norm_backward_vs_its_reference(h):
    x, gamma, beta = _inputs(37, h, jnp.float32, "layernorm", seed=3)
    dy = normal(3, x.shape)
    for norm_type in ("layernorm", "rmsnorm"):
        b = beta if norm_type == "layernorm" else None
        _, mu, rs = ops.norm_forward(x, gamma, b, norm_type=norm_type, epsilon=EPS)
        got = ops.norm_backward(dy, x, mu, rs, gamma, norm_type=norm_type)
        want = jax.jit(ops.norm_backward_reference, static_argnames="norm_type")(
            dy, x, mu, rs, gamma, norm_type=norm_type
        )
        for g, w in zip(got, want, strict=True):
            assert_close(g, w)


@pytest.mark.parametrize(
    ("dy_dtype", "x_dtype"),
    [(jnp.bfloat16, jnp.float32), (jnp.float32, jnp.bfloat16), (jnp.float16, jnp.bfloat16)],
    ids=["bf16-f32", "f32-bf16", "f16-bf16"],
)
def test_norm_backward_mixed_dtypes(dy_dtype, x_dtype):
    x, gamma, beta = _inputs(5, 40, x_dtype, "layernorm", seed=9)
    dy = normal(9, x.shape, dy_dtype)
    _, mu, rs = ops.norm_forward(x, gamma, beta, norm_type="layernorm", epsilon=EPS)
    dx, dgamma, dbeta = ops.norm_backward(dy, x, mu, rs, gamma, norm_type="layernorm")
    want = jax.jit(ops.norm_backward_reference, static_argnames="norm_type")(
        dy, x, mu, rs, gamma, norm_type="layernorm"
    )
    assert dx.dtype == dy_dtype
    assert_close(dx, want[0], dy_dtype)
    assert_close(dgamma, want[1])
    assert_close(dbeta, want[2])


def test_dgamma_is_deterministic():
    x, gamma, beta = _inputs(4099, 1000, jnp.bfloat16, "layernorm", seed=4)
    dy = normal(4, x.shape, jnp.bfloat16)
    _, mu, rs = ops.norm_forward(x, gamma, beta, norm_type="layernorm", epsilon=EPS)
    first = ops.norm_backward(dy, x, mu, rs, gamma, norm_type="layernorm")
    for _ in range(3):
        again = ops.norm_backward(dy, x, mu, rs, gamma, norm_type="layernorm")
        for a, b in zip(first, again, strict=True):
            assert_wide_equal(a, b)


@pytest.mark.parametrize("zero_centered_gamma", [False, True], ids=["gamma", "zc"])
def test_check_grads(zero_centered_gamma):
    x, gamma, beta = _inputs(3, 24, jnp.float32, "layernorm", seed=5)
    if zero_centered_gamma:
        gamma = gamma - 1  # the same scale as without
    kw = dict(epsilon=EPS, zero_centered_gamma=zero_centered_gamma)
    check_grads(lambda x, g, b: ops.layernorm(x, g, b, **kw), (x, gamma, beta), 1, ["rev"])
    check_grads(lambda x, g: ops.rmsnorm(x, g, **kw), (x, gamma), 1, ["rev"])


def test_grads_come_back_in_param_dtypes_and_under_jit():
    x, gamma, beta = _inputs(6, 32, jnp.bfloat16, "layernorm", seed=6)
    gamma, beta = gamma.astype(jnp.bfloat16), beta.astype(jnp.float16)

    def loss(x, g, b):
        y = ops.layernorm(x, g, b, epsilon=EPS) + ops.rmsnorm(x, g, epsilon=EPS)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    grads = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))(x, gamma, beta)
    assert [g.dtype for g in grads] == [jnp.bfloat16, jnp.bfloat16, jnp.float16]
    assert [g.shape for g in grads] == [x.shape, gamma.shape, beta.shape]


def test_rank3_flattens_rows(implementation):
    exact = reference_bits_promised(implementation)
    x, gamma, beta = _inputs(12, 40, jnp.float32, "layernorm", seed=7)
    x3 = x.reshape(3, 4, 40)
    kw = dict(norm_type="layernorm", epsilon=EPS)
    y, mu, rs = ops.norm_forward(x3, gamma, beta, **kw)
    y2, mu2, rs2 = ops.norm_forward(x, gamma, beta, **kw)
    assert y.shape == (3, 4, 40) and mu.shape == rs.shape == (3, 4)
    assert_same(y.reshape(12, 40), y2, exact)
    assert_same(mu.reshape(12), mu2, exact)
    q, q_t, *_ = ops.norm_forward_fp8(x3, gamma, beta, jnp.float32(1), jnp.float8_e4m3fn, **kw)
    assert q.shape == (3, 4, 40) and q_t.shape == (40, 12)
    dx, dg, _ = ops.norm_backward(x3, x3, mu, rs, gamma, norm_type="layernorm")
    dx2, dg2, _ = ops.norm_backward(x, x, mu2, rs2, gamma, norm_type="layernorm")
    assert_same(dx.reshape(12, 40), dx2, exact)
    assert_same(dg, dg2, exact)


def test_grad_of_vmap_and_vmap_of_grad():
    rng = np.random.default_rng(9)
    xs, g = normal(rng, (2, 4, 16)), normal(rng, 16, F32, 0.1, 1.0)

    def loss(x, g):
        return jnp.sum(ops.rmsnorm(x, g, epsilon=EPS) ** 3)

    per = jax.vmap(jax.grad(loss, argnums=(0, 1)), in_axes=(0, None))(xs, g)
    for i in range(2):
        want = jax.grad(loss, argnums=(0, 1))(xs[i], g)
        assert_close(per[0][i], want[0])
        assert_close(per[1][i], want[1])


def test_bad_input():
    x, g, b = jnp.ones((2, 8)), jnp.ones(8), jnp.zeros(8)
    with pytest.raises(ValueError, match="norm_type"):
        ops.norm_forward(x, g, b, norm_type="batchnorm", epsilon=EPS)
    with pytest.raises(ValueError, match="epsilon"):
        ops.norm_forward(x, g, b, norm_type="layernorm", epsilon=0.0)
    with pytest.raises(ValueError, match="beta must be None"):
        ops.norm_forward(x, g, b, norm_type="rmsnorm", epsilon=EPS)
    with pytest.raises(ValueError, match="beta is required"):
        ops.norm_forward(x, g, None, norm_type="layernorm", epsilon=EPS)
    with pytest.raises(ValueError, match="gamma must have shape"):
        ops.norm_forward(x, jnp.ones(7), b, norm_type="layernorm", epsilon=EPS)
    with pytest.raises(ValueError, match="rank >= 2"):
        ops.norm_forward(jnp.ones(8), g, b, norm_type="layernorm", epsilon=EPS)
    with pytest.raises(ValueError, match="dy must have"):
        ops.norm_backward(jnp.ones((3, 8)), x, jnp.ones(2), jnp.ones(2), g, norm_type="layernorm")
    with pytest.raises(ValueError, match="rsigma must be"):
        ops.norm_backward(x, x, jnp.ones(2), jnp.ones(3), g, norm_type="layernorm")
    with pytest.raises(ValueError, match="implementation"):
        ops.layernorm(x, g, b, epsilon=EPS, implementation="cuda")
    with pytest.raises(ValueError, match="beta must have shape"):
        ops.layernorm(x, g, jnp.zeros(3), epsilon=EPS)


# ------------------------------------------------------------------ the conformance sample
# This op's entries in the conformance suite's table (tests/ops/_samples.py, tests/ops/
# test_conformance.py, tests/distributed/test_ops_conformance.py).


def _sample_params(r, h, norm_type):
    gamma = normal(r, (h,), F32, 0.2, 1.0)
    beta = normal(r, (h,), F32, 0.2) if norm_type == "layernorm" else None
    return gamma, beta


def _sample_forward(norm_type):
    def build(key):
        r = np.random.default_rng(key)
        out = {}
        for name, shape, dt, zc in (
            ("f32", (M, N), F32, False),
            ("bf16-zc-rank3", (M, 2, 40), BF16, True),
        ):
            gamma, beta = _sample_params(r, shape[-1], norm_type)
            out[name] = Sample(
                ops.norm_forward,
                (normal(r, shape, dt, 3, 0.5), gamma, beta),
                dict(norm_type=norm_type, epsilon=1e-5, zero_centered_gamma=zc),
                close=NORM_CLOSE,
            )
        return out

    return build


def _sample_forward_fp8(norm_type):
    def build(key):
        r = np.random.default_rng(key)
        out = {}
        for name, shape, dt, fp8, zc in (
            ("f32-e4m3", (M, N), F32, E4M3, False),
            ("bf16-e5m2-zc-rank3", (M, 2, 40), BF16, E5M2, True),
        ):
            gamma, beta = _sample_params(r, shape[-1], norm_type)
            out[name] = Sample(
                ops.norm_forward_fp8,
                (normal(r, shape, dt, 3, 0.5), gamma, beta, scale_of(32.0), fp8),
                dict(norm_type=norm_type, epsilon=1e-5, zero_centered_gamma=zc),
                close=NORM_CLOSE,
            )
        return out

    return build


def _sample_norm_backward(key):
    r = np.random.default_rng(key)
    out = {}
    for norm_type, shape, dt, zc in (
        ("layernorm", (M, N), F32, False),
        ("rmsnorm", (M, 2, 40), BF16, True),
    ):
        x = normal(r, shape, dt, 3, 0.5)
        gamma, beta = _sample_params(r, shape[-1], norm_type)
        _, mu, rsigma = ops.norm_forward_reference(
            x, gamma, beta, norm_type=norm_type, epsilon=1e-5
        )
        out[norm_type] = Sample(
            ops.norm_backward,
            (normal(r, shape, dt), x, mu, rsigma, gamma),
            dict(norm_type=norm_type, zero_centered_gamma=zc),
            close=NORM_CLOSE,
            sums=(1, 2),
        )
    return out


SAMPLES = {
    "layernorm_forward": _sample_forward("layernorm"),
    "rmsnorm_forward": _sample_forward("rmsnorm"),
    "layernorm_forward_fp8": _sample_forward_fp8("layernorm"),
    "rmsnorm_forward_fp8": _sample_forward_fp8("rmsnorm"),
    "norm_backward": _sample_norm_backward,
}
