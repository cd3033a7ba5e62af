"""fp8jax.layernorm_mlp and fp8jax.layernorm_dense: exactness where it is exact, accuracy bounds
against float32 where it is not, the observations of every role, and bad input.

Every test runs under both implementations of the fused ops (``"kernel"`` and ``"xla"``;
``FP8JAX_TEST_IMPLEMENTATIONS`` narrows them, as for the op tests).
"""

from __future__ import annotations

import contextlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _accuracy import (
    LIPSCHITZ,
    LIPSCHITZ_DERIVATIVE,
    Bound,
    assert_within,
    cast,
    gemm,
    tensor_cores,
)
from _implementations import IMPLEMENTATIONS
from _shared import rand

import fp8jax
from fp8jax import DelayedScaling, Float8CurrentScaling, ops
from fp8jax.functional.mlp import layernorm_mlp_observed

pytestmark = pytest.mark.usefixtures("float32_matmuls")

RECIPE = DelayedScaling(amax_history_len=4)
CURRENT = Float8CurrentScaling()
H, INTER = 32, 48


@pytest.fixture(params=IMPLEMENTATIONS, autouse=True)
def implementation(request):
    with ops.implementation(request.param):
        yield request.param


def _mlp_args(acts=("gelu",), bias=True, norm="layernorm", lead=(3, 5), seed=0):
    k = len(acts)
    x = rand((*lead, H), seed, 2.0) + 0.5
    gamma = 1.0 + rand((H,), seed + 1, 0.1) if norm else None
    beta = rand((H,), seed + 2, 0.1) if norm == "layernorm" else None
    w1 = rand((H, k, INTER), seed + 3, H**-0.5)
    w2 = rand((INTER, H), seed + 4, INTER**-0.5)
    b1 = rand((k, INTER), seed + 5, 0.1) if bias else None
    b2 = rand((H,), seed + 6, 0.1) if bias else None
    return x, gamma, beta, w1, w2, b1, b2


def _grads(f, args, n_probe):
    """Gradients of ``sum(f(*args, probe) * c)`` w.r.t. every array argument and the probe."""
    idx = tuple(i for i, a in enumerate(args) if a is not None)

    def loss(*xs):
        full = list(args)
        for i, v in zip(idx, xs[:-1], strict=True):
            full[i] = v
        y = f(*full, xs[-1])
        return jnp.sum(y * jnp.cos(jnp.arange(y.size, dtype=y.dtype).reshape(y.shape)))

    out = jax.jit(jax.grad(loss, argnums=tuple(range(len(idx) + 1))))(
        *(args[i] for i in idx), jnp.zeros((n_probe,), jnp.float32)
    )
    return out[:-1], out[-1]


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _mlp(recipe, **kw):
    meta = fp8jax.init_fp8_meta(recipe, n_roles=6) if isinstance(recipe, DelayedScaling) else None

    def f(x, gamma, beta, w1, w2, b1, b2, probe=None):
        return fp8jax.layernorm_mlp(x, gamma, beta, w1, w2, b1, b2, meta, recipe, probe=probe, **kw)

    return f


@pytest.mark.parametrize("acts", [("gelu",), ("relu",), ("silu", "linear"), ("gelu", "linear")])
@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
def test_mlp_forward_and_gradients_within_fp8_bounds(acts, norm):
    """Current scaling (each tensor at its own amax) against the float32 block, in the
    Frobenius norm: forward within 10% (two GEMMs with both inputs rounded to E4M3: about 3.5%
    RMS per GEMM; measured 5-7%), every gradient within 20% (E5M2 gradients, twice E4M3's
    rounding; measured 6-13%); the last bias gradient is a plain sum (no FP8), exact."""
    args = _mlp_args(acts, norm=norm)
    fp8 = _mlp(CURRENT, activations=acts, layernorm_type=norm)
    ref = _mlp(CURRENT, activations=acts, layernorm_type=norm, enabled=False)
    assert _rel(fp8(*args), ref(*args)) < 0.1
    grads_fp8, _ = _grads(fp8, args, 6)
    gr, _ = _grads(lambda *a: ref(*a[:-1]), args, 6)
    for got, want in zip(grads_fp8, gr, strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert _rel(got, want) < 0.2
    np.testing.assert_allclose(np.asarray(grads_fp8[-1]), np.asarray(gr[-1]), rtol=1e-5, atol=1e-5)


def _qdq(v, scale, dtype):
    q, scale_inv, _ = fp8jax.ops.quantize_reference(v, jnp.float32(scale), dtype)
    return q.astype(jnp.float32) * scale_inv


@pytest.mark.parametrize("acts", [("gelu",), ("silu", "linear")])
def test_mlp_forward_is_an_emulation_of_its_casts(acts, implementation):
    """Delayed scaling with given scales: the forward equals the float32 block with each GEMM
    operand rounded to E4M3 at its scale (norm output and activation output as the layer rounds
    them), to float32 summation order.

    With the kernel GEMM on a GPU (tensor cores, which accumulate in ~14 bits), that holds with
    XLA's float32 GEMM in the layer instead (every other kernel as is); with the tensor-core GEMM,
    the layer is within the worst-case bound of tests/_accuracy.py: GEMM1's, carried through the
    activation and the E4M3 rounding of its output (which may go to the neighbouring value), then
    GEMM2's. Each GEMM's own accuracy is tests/ops/test_gemm.py's."""
    x, gamma, beta, w1, w2, b1, b2 = args = _mlp_args(acts)
    scale = jnp.array([64.0, 512.0, 1.0, 128.0, 256.0, 1.0])
    meta = fp8jax.init_fp8_meta(RECIPE, n_roles=6)._replace(scale=scale)
    gpu = tensor_cores(implementation)
    with ops.implementation(gemm="xla") if gpu else contextlib.nullcontext():
        y = fp8jax.layernorm_mlp(*args, meta, RECIPE, activations=acts)
    e4 = jnp.float8_e4m3fn
    ln = fp8jax.ops.norm_forward(x.reshape(-1, H), gamma, beta, norm_type="layernorm",
                                 epsilon=1e-6)[0]  # fmt: skip
    lnq, w1q = _qdq(ln, 64.0, e4), _qdq(w1, 512.0, e4).reshape(H, -1)
    h = lnq @ w1q + b1.reshape(-1)
    a = fp8jax.ops.activation(h.reshape(-1, len(acts), INTER), acts)
    aq, w2q = _qdq(a, 128.0, e4), _qdq(w2, 256.0, e4)
    want = aq @ w2q + b2
    np.testing.assert_allclose(np.asarray(y).reshape(-1, H), np.asarray(want), rtol=2e-5,
                               atol=2e-5)  # fmt: skip
    if gpu:
        y = fp8jax.layernorm_mlp(*args, meta, RECIPE, activations=acts)
        h_b = gemm(Bound.exact(lnq), Bound.exact(w1q), h, bias=b1.reshape(-1))
        a_b = _activation_bound(h_b.reshape(-1, len(acts), INTER), h, acts, a)
        want_b = gemm(cast(a_b, e4, aq, scale=128.0), Bound.exact(w2q), want, bias=b2)
        assert_within(y, want_b, rtol=2e-5, atol=2e-5, what="forward, tensor-core GEMMs")


def test_mlp_delayed_scaling_observations_are_the_tensors_amaxes():
    x, gamma, beta, w1, w2, b1, b2 = args = _mlp_args(("gelu",))
    f = _mlp(RECIPE, activations=("gelu",))
    c = rand((3, 5, H), 9)

    def loss(x, probe):
        return jnp.sum(f(x, gamma, beta, w1, w2, b1, b2, probe) * c)

    seen = jax.grad(loss, argnums=1)(x, jnp.zeros(6))
    ln = fp8jax.ops.norm_forward(
        x.reshape(-1, H), gamma, beta, norm_type="layernorm", epsilon=1e-6
    )[0]
    h = ln @ w1.reshape(H, INTER) + b1.reshape(-1)
    a = jax.nn.gelu(h, approximate=True)
    dh = (c.reshape(-1, H) @ w2.T) * jax.grad(lambda v: jnp.sum(jax.nn.gelu(v)))(h)
    seen = np.asarray(seen)
    # the tensors the layer quantizes exactly as given: exact amaxes
    np.testing.assert_array_equal(seen[[1, 4, 5]], [jnp.max(jnp.abs(w1)), jnp.max(jnp.abs(w2)),
                                                    jnp.max(jnp.abs(c))])  # fmt: skip
    np.testing.assert_allclose(seen[0], jnp.max(jnp.abs(ln)), rtol=1e-6)
    # computed from FP8 GEMMs (scale 1 at the first step): within FP8 accuracy
    np.testing.assert_allclose(seen[3], jnp.max(jnp.abs(a)), rtol=0.1)
    np.testing.assert_allclose(seen[2], jnp.max(jnp.abs(dh)), rtol=0.25)
    # the forward observations, taken without differentiating
    _, _, fwd = layernorm_mlp_observed(
        *args, fp8jax.init_fp8_meta(RECIPE, n_roles=6), RECIPE, probe=None,
        layernorm_type="layernorm", epsilon=1e-6, zero_centered_gamma=False,
        activations=("gelu",), dropout_mask=None, return_layernorm_output=False, dtype=None,
        enabled=True,
    )  # fmt: skip
    np.testing.assert_array_equal(np.asarray(fwd)[[0, 1, 3, 4]], seen[[0, 1, 3, 4]])
    assert np.isnan(np.asarray(fwd)[[2, 5]]).all()


def test_mlp_without_norm_equals_two_dense_layers_with_relu():
    """No norm, relu: the block is ``dense(relu(dense(x)))`` with the same FP8 state, value for
    value (the same casts of the same tensors, relu exact), gradients to summation order."""
    x, _, _, w1, w2, b1, b2 = _mlp_args(("relu",), norm=None)
    meta = fp8jax.init_fp8_meta(RECIPE, n_roles=6)
    meta = meta._replace(scale=jnp.array([2.0, 8.0, 4096.0, 4.0, 16.0, 1024.0]))
    m1 = fp8jax.Fp8Meta(meta.amax_history[:3], meta.scale[:3])
    m2 = fp8jax.Fp8Meta(meta.amax_history[3:], meta.scale[3:])

    def block(x, w1, w2, b1, b2, p):
        return fp8jax.layernorm_mlp(x, None, None, w1, w2, b1, b2, meta, RECIPE, probe=p,
                                    layernorm_type=None, activations=("relu",))  # fmt: skip

    def chain(x, w1, w2, b1, b2, p):
        h = fp8jax.dense(x, w1[:, 0], b1[0], m1, RECIPE, probe=p[:3])
        return fp8jax.dense(jax.nn.relu(h), w2, b2, m2, RECIPE, probe=p[3:])

    args = (x, w1, w2, b1, b2, jnp.zeros(6))
    np.testing.assert_array_equal(np.asarray(block(*args)), np.asarray(chain(*args)))
    c = rand((3, 5, H), 11)
    gb = jax.grad(lambda *a: jnp.sum(block(*a) * c), argnums=tuple(range(6)))(*args)
    gc = jax.grad(lambda *a: jnp.sum(chain(*a) * c), argnums=tuple(range(6)))(*args)
    for got, want in zip(gb, gc, strict=True):
        np.testing.assert_allclose(
            np.asarray(got).reshape(-1), np.asarray(want).reshape(-1), rtol=1e-5, atol=1e-5
        )


def test_layernorm_dense_without_norm_is_dense():
    x, w, b = rand((4, 6, H), 1), rand((H, 8), 2, 0.2), rand((8,), 3)
    meta = fp8jax.init_fp8_meta(RECIPE)._replace(scale=jnp.array([4.0, 16.0, 2048.0]))
    p = jnp.zeros(3)
    y = fp8jax.layernorm_dense(x, None, None, w, b, meta, RECIPE, probe=p, layernorm_type=None)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(fp8jax.dense(x, w, b, meta, RECIPE)))
    c = rand((4, 6, 8), 4)

    def lnd(x, w, b, p):
        return jnp.sum(fp8jax.layernorm_dense(x, None, None, w, b, meta, RECIPE, probe=p,
                                              layernorm_type=None) * c)  # fmt: skip

    def dense(x, w, b, p):
        return jnp.sum(fp8jax.dense(x, w, b, meta, RECIPE, probe=p) * c)

    g1 = jax.grad(lnd, argnums=(0, 1, 2, 3))(x, w, b, p)
    g2 = jax.grad(dense, argnums=(0, 1, 2, 3))(x, w, b, p)
    for got, want in zip(g1, g2, strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("norm", ["layernorm", "rmsnorm"])
@pytest.mark.parametrize("zero_centered", [False, True])
def test_layernorm_dense_within_fp8_bounds_and_returns_the_norm(norm, zero_centered):
    x = rand((4, 6, H), 1, 3.0) - 1.0
    gamma = rand((H,), 2, 0.1) + (0.0 if zero_centered else 1.0)
    beta = rand((H,), 3, 0.1) if norm == "layernorm" else None
    w, b = rand((H, 2, 8), 4, 0.2), rand((2, 8), 5)
    kw = dict(layernorm_type=norm, zero_centered_gamma=zero_centered, epsilon=1e-5,
              return_layernorm_output=True)  # fmt: skip
    c, d = rand((4, 6, 2, 8), 6), rand((4, 6, H), 7)

    def loss(x, gamma, w, b, enabled):
        y, ln = fp8jax.layernorm_dense(x, gamma, beta, w, b, recipe=CURRENT, enabled=enabled,
                                       **kw)  # fmt: skip
        return jnp.sum(y * c) + jnp.sum(ln * d), (y, ln)

    (_, (y8, ln8)), grads_fp8 = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(
        x, gamma, w, b, True
    )
    (_, (yr, lnr)), gr = jax.value_and_grad(loss, argnums=(0, 1, 2, 3), has_aux=True)(
        x, gamma, w, b, False
    )
    np.testing.assert_allclose(np.asarray(ln8), np.asarray(lnr), rtol=1e-5, atol=1e-5)
    assert _rel(y8, yr) < 0.06
    for got, want in zip(grads_fp8, gr, strict=True):
        assert _rel(got, want) < 0.15


def test_dtypes_follow_the_inputs():
    x, gamma, beta, w1, w2, b1, b2 = _mlp_args(("silu", "linear"))
    xb = x.astype(jnp.bfloat16)
    f = _mlp(CURRENT, activations=("silu", "linear"))
    y = f(xb, gamma, beta, w1, w2, b1, b2)
    assert y.dtype == jnp.float32  # promoted with the float32 kernels, as Flax would
    y16 = fp8jax.layernorm_mlp(xb, gamma, beta, w1, w2, b1, b2, recipe=CURRENT,
                               activations=("silu", "linear"), dtype=jnp.bfloat16)  # fmt: skip
    assert y16.dtype == jnp.bfloat16
    g, _ = _grads(f, (xb, gamma, beta, w1, w2, b1, b2), 6)
    assert [v.dtype for v in g] == [jnp.bfloat16] + [jnp.float32] * 6


def test_dropout_mask():
    args = _mlp_args(("gelu",))
    f = _mlp(RECIPE, activations=("gelu",))
    ones = _mlp(RECIPE, activations=("gelu",), dropout_mask=jnp.ones((INTER,)))
    # a mask of ones takes the unfused path (activation, then cast): the same values
    np.testing.assert_array_equal(np.asarray(f(*args)), np.asarray(ones(*args)))
    keep = jnp.asarray(np.random.default_rng(0).random((3, 1, INTER)) < 0.5, jnp.float32) * 2.0
    masked = _mlp(CURRENT, activations=("gelu",), dropout_mask=keep)
    plain = _mlp(CURRENT, activations=("gelu",), dropout_mask=keep, enabled=False)
    assert _rel(masked(*args), plain(*args)) < 0.1
    grads_fp8, _ = _grads(masked, args, 6)
    gr, _ = _grads(lambda *a: plain(*a[:-1]), args, 6)
    for got, want in zip(grads_fp8, gr, strict=True):
        assert _rel(got, want) < 0.2


def test_differentiating_without_the_probe_is_an_error():
    args = _mlp_args()
    f = _mlp(RECIPE)
    with pytest.raises(ValueError, match="probe"):
        jax.grad(lambda x: jnp.sum(f(x, *args[1:])))(args[0])
    # evaluation, and current scaling, need no probe
    f(*args)
    jax.grad(lambda x: jnp.sum(_mlp(CURRENT)(x, *args[1:])))(args[0])


def test_bad_input_names_the_argument():
    x, gamma, beta, w1, w2, b1, b2 = _mlp_args()
    f = fp8jax.layernorm_mlp
    cases = [
        (ValueError, "activations", dict(activations=("tanh",))),
        (ValueError, "activations", dict(activations=("linear", "gelu"))),
        (ValueError, "layernorm_type", dict(layernorm_type="batchnorm")),
        (ValueError, "epsilon", dict(epsilon=0.0)),
    ]
    for err, word, kw in cases:
        with pytest.raises(err, match=word):
            f(x, gamma, beta, w1, w2, b1, b2, recipe=CURRENT, **kw)
    with pytest.raises(ValueError, match=re.escape("kernel_1 must have shape (hidden=16")):
        f(x[..., :16], gamma[:16], beta[:16], w1, w2, recipe=CURRENT)
    with pytest.raises(ValueError, match="len\\(activations\\)=2"):
        f(x, gamma, beta, w1, w2, recipe=CURRENT, activations=("gelu", "linear"))
    with pytest.raises(ValueError, match="kernel_2"):
        f(x, gamma, beta, w1, w2[:5], recipe=CURRENT)
    with pytest.raises(ValueError, match="bias_1"):
        f(x, gamma, beta, w1, w2, b1[:, :3], b2, recipe=CURRENT)
    with pytest.raises(ValueError, match="beta"):
        f(x, gamma, beta, w1, w2, layernorm_type="rmsnorm", recipe=CURRENT)
    with pytest.raises(ValueError, match="gamma"):
        f(x, gamma[:4], beta, w1, w2, recipe=CURRENT)
    with pytest.raises(TypeError, match="x must be a floating-point"):
        f(x.astype(jnp.int32), gamma, beta, w1, w2, recipe=CURRENT)
    with pytest.raises(ValueError, match="6 roles"):
        f(x, gamma, beta, w1, w2, fp8_meta=fp8jax.init_fp8_meta(RECIPE), recipe=RECIPE)
    with pytest.raises(ValueError, match="no gamma"):
        fp8jax.layernorm_dense(x, gamma, None, w2.T, layernorm_type=None, recipe=CURRENT)
    with pytest.raises(ValueError, match=re.escape("hidden = x.shape")):
        fp8jax.layernorm_dense(x, gamma, beta, w2, recipe=CURRENT)


def _cur(v, fmt):
    """Current scaling's quantize-dequantize of ``v`` (scale from its own amax)."""
    amax = jnp.max(jnp.abs(v.astype(jnp.float32)))
    return _qdq(v, jnp.float32(float(jnp.finfo(fmt).max)) / amax, fmt)


@pytest.mark.parametrize(
    ("acts", "norm"), [(("relu",), "rmsnorm"), (("silu", "linear"), "layernorm")]
)
def test_mlp_gradients_are_an_emulation_of_their_casts(acts, norm, implementation):
    """Current scaling: every gradient equals the float32 backward with each GEMM operand
    rounded as the layer rounds it (E4M3 forward tensors, E5M2 gradients), to summation order:
    the gap to the float32 block in the bound test above is FP8 rounding, nothing else.

    With the kernel GEMM on a GPU, as in the forward test: exactly that with XLA's float32 GEMM
    in the layer, and with the tensor-core GEMMs within the worst-case bound of
    tests/_accuracy.py carried through every step of the backward (amaxes, hence current
    scales, included). That bound is loose where sums cancel (the norm's backward, dgamma)."""
    x, gamma, beta, w1, w2, b1, _ = args = _mlp_args(acts, norm=norm)
    e4, e5 = jnp.float8_e4m3fn, jnp.float8_e5m2
    mlp = _mlp(CURRENT, activations=acts, layernorm_type=norm)
    gpu = tensor_cores(implementation)
    with ops.implementation(gemm="xla") if gpu else contextlib.nullcontext():
        (grads_fp8, _) = _grads(mlp, args, 6)
    c = jnp.cos(jnp.arange(x.size, dtype=jnp.float32)).reshape(-1, H)
    x2 = x.reshape(-1, H)
    ln, mu, rsigma = fp8jax.ops.norm_forward(x2, gamma, beta, norm_type=norm, epsilon=1e-6)
    lnq, w1q, w2q = _cur(ln, e4), _cur(w1.reshape(H, -1), e4), _cur(w2, e4)
    h = (lnq @ w1q + b1.reshape(-1)).reshape(-1, len(acts), INTER)
    a = fp8jax.ops.activation(h, acts)
    aq, dyq = _cur(a, e4), _cur(c, e5)
    da = dyq @ w2q.T
    dw2 = aq.T @ dyq
    dh = fp8jax.ops.dactivation(da, h, acts).reshape(-1, len(acts) * INTER)
    dhq = _cur(dh, e5)
    dln = dhq @ w1q.T
    dw1 = lnq.T @ dhq
    dx, dgamma, dbeta = fp8jax.ops.norm_backward(dln, x2, mu, rsigma, gamma, norm_type=norm)
    want = [dx.reshape(x.shape), dgamma] + ([dbeta] if beta is not None else [])
    want += [dw1.reshape(w1.shape), dw2, jnp.sum(dh, 0).reshape(b1.shape), jnp.sum(c, 0)]
    for got, w in zip(grads_fp8, want, strict=True):
        np.testing.assert_allclose(np.asarray(got), np.asarray(w), rtol=1e-4, atol=1e-4)
    if not gpu:
        return
    (grads_fp8, _) = _grads(mlp, args, 6)
    k = len(acts)
    lnq_b, w1q_b, w2q_b, dyq_b = (Bound.exact(v) for v in (lnq, w1q, w2q, dyq))
    h_b = gemm(lnq_b, w1q_b, h.reshape(-1, k * INTER), bias=b1.reshape(-1))
    h_b = h_b.reshape(-1, k, INTER)
    aq_b = cast(_activation_bound(h_b, h, acts, a), e4, aq)
    da_b = gemm(dyq_b, w2q_b.T, da)
    dh_b = _dactivation_bound(da_b, h_b, h, acts, dh).reshape(-1, k * INTER)
    dhq_b = cast(dh_b, e5, dhq)
    radii = list(_norm_backward_radii(gemm(dhq_b, w1q_b.T, dln).radius, x2, mu, rsigma, gamma,
                                      norm))  # fmt: skip
    radii = radii if beta is not None else radii[:2]
    radii += [gemm(lnq_b.T, dhq_b, dw1).radius, gemm(aq_b.T, dyq_b, dw2).radius,
              dh_b.sum_rows(jnp.sum(dh, 0)).radius, np.zeros(H)]  # fmt: skip
    names = ["dx", "dgamma", "dbeta", "dkernel_1", "dkernel_2", "dbias_1", "dbias_2"]
    names = names if beta is not None else names[:2] + names[3:]
    for got, w, r, name in zip(grads_fp8, want, radii, names, strict=True):
        w = np.asarray(w, np.float64)
        assert_within(got, Bound(w, r.reshape(w.shape)), rtol=1e-4, atol=1e-4, what=name)


def _activation_bound(h: Bound, h_value, acts, out) -> Bound:
    """The bound of ``activation(h, acts)`` [M, I], emulated as ``out``, from ``h``'s [M, k, I]
    (``h_value``: the emulated ``h``)."""
    lip = LIPSCHITZ[acts[0]]
    if len(acts) == 1:
        return h[:, 0].apply(lip, out)
    act = fp8jax.ops.activation(h_value.reshape(h.value.shape)[:, :1], acts[:1])
    return h[:, 0].apply(lip, act).times(h[:, 1], out)


def _dactivation_bound(da: Bound, h: Bound, h_value, acts, out) -> Bound:
    """The bound of ``dactivation(da, h, acts)`` [M, k, I], emulated as ``out``, from those of
    ``da`` [M, I] and ``h`` [M, k, I]: ``da * act'(h0)`` (gated: times ``h1``, and
    ``da * act(h0)``). ``act'`` moves by at most ``max |act''|`` times ``h0``'s radius; relu's
    jumps from 0 to 1 where ``h0``'s interval holds 0."""
    h3 = jnp.reshape(h_value, h.value.shape)[:, :1]
    d = fp8jax.ops.dactivation(jnp.ones_like(h3[:, 0]), h3, acts[:1])[:, 0]  # act'(h0)
    h0 = h[:, 0]
    if acts[0] == "relu":
        d = Bound(np.asarray(d, np.float64), (np.abs(h0.value) <= h0.radius).astype(np.float64))
    else:
        d = h0.apply(LIPSCHITZ_DERIVATIVE[acts[0]], d)
    out = np.asarray(out, np.float64).reshape(h.value.shape)
    if len(acts) == 1:
        return da.times(d, out[:, 0]).reshape(out.shape)
    act = h0.apply(LIPSCHITZ[acts[0]], fp8jax.ops.activation(h3, acts[:1]))
    dh0 = da.times(d, da.value * d.value).times(h[:, 1], out[:, 0])
    dh1 = da.times(act, out[:, 1])
    return Bound(np.stack([dh0.value, dh1.value], 1), np.stack([dh0.radius, dh1.radius], 1))


def _norm_backward_radii(r_dln, x2, mu, rsigma, gamma, norm):
    """Radii of the norm's ``(dx, dgamma, dbeta)`` from ``dln``'s: the backward is linear in
    ``dln`` (ops.norm_backward_reference: ``dx = rsigma * (dz - mean(dz) - xhat * mean(dz *
    xhat))``, ``dz = dln * gamma``; ``dgamma``, ``dbeta`` column sums of ``dln * xhat``,
    ``dln``), so the triangle inequality bounds each output by the same map in absolute values."""
    x, rs = np.asarray(x2, np.float64), np.asarray(rsigma, np.float64)[:, None]
    xhat = (x - np.asarray(mu, np.float64)[:, None]) * rs if norm == "layernorm" else x * rs
    xhat = np.abs(xhat)
    r_dz = r_dln * np.abs(np.asarray(gamma, np.float64))
    r_dx = r_dz + xhat * np.mean(r_dz * xhat, axis=-1, keepdims=True)
    if norm == "layernorm":
        r_dx = r_dx + np.mean(r_dz, axis=-1, keepdims=True)
    return rs * r_dx, np.sum(r_dln * xhat, axis=0), np.sum(r_dln, axis=0)
