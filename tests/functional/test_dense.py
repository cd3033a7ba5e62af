"""fp8jax.dense: forward, gradients and amax observations vs float32 references."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from _accuracy import EPS32, Bound, assert_within, gemm, tensor_cores
from _shared import rand

import fp8jax
from fp8jax import DelayedScaling, Float8CurrentScaling, Format, ops

pytestmark = pytest.mark.usefixtures("float32_matmuls")

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
# Unit roundoff of each format: a quantized value is within u * |x| of x (normal range).
U_E4M3 = float(ml_dtypes.finfo(ml_dtypes.float8_e4m3fn).eps) / 2  # 2**-4
U_E5M2 = float(ml_dtypes.finfo(ml_dtypes.float8_e5m2).eps) / 2  # 2**-3
RECIPE = DelayedScaling(amax_history_len=4)


def _tensor_cores() -> bool:
    """Whether the FP8 GEMMs run on tensor cores here (see tests/_accuracy.py)."""
    return tensor_cores(ops.get_implementation("gemm"))


def _ref(x, w, b=None):
    y = jnp.dot(x, w, precision=jax.lax.Precision.HIGHEST)
    return y if b is None else y + b


def _fp8(x, w, b=None, recipe=RECIPE, **kw):
    meta = fp8jax.init_fp8_meta(recipe) if isinstance(recipe, DelayedScaling) else None
    return fp8jax.dense(x, w, b, meta, recipe, enabled=True, **kw)


def _grad(loss, argnums):
    """Gradient of ``loss(*args, probe)`` w.r.t. ``argnums``. The probe is differentiated too
    (delayed scaling insists, or the observation would be lost) and its gradient dropped."""

    def grad(*args):
        g = jax.grad(loss, argnums=(*argnums, len(args)))(*args, jnp.zeros(3, jnp.float32))
        return g[:-1]

    return grad


def test_disabled_is_plain_dense():
    x, w, b = rand((5, 7, 16), 0), rand((16, 12), 1), rand((12,), 2)
    y = fp8jax.dense(x, w, b, enabled=False)
    if jax.default_backend() == "cpu":
        np.testing.assert_allclose(np.asarray(y), np.asarray(_ref(x, w, b)), rtol=1e-6, atol=1e-6)
    else:  # the GPU may sum the 2-D and the 3-D dot in other orders: each float32 sum of K
        # products and a bias is within (K + 1) * 2**-24 * sum(|terms|) of the exact one
        p = np.abs(np.asarray(x, np.float64)) @ np.abs(np.asarray(w, np.float64)) + np.abs(b)
        err = np.abs(np.asarray(y, np.float64) - np.asarray(_ref(x, w, b), np.float64))
        assert (err <= (x.shape[-1] + 2) * EPS32 * p).all(), err.max()
    # outside any autocast, FP8 is off by default
    np.testing.assert_array_equal(np.asarray(fp8jax.dense(x, w, b)), np.asarray(y))


def test_representable_inputs_forward_is_exact_to_accumulation_order():
    x = fp8jax.cast_to_representable(rand((64, 48), 3, 4.0), E4M3)
    w = fp8jax.cast_to_representable(rand((48, 32), 4, 0.5), E4M3)
    y = _fp8(x, w)
    ref = _ref(x, w)
    if not _tensor_cores():
        # FP8 products are exact in float32: only the summation order differs (~1e-6 relative).
        np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=1e-4, atol=1e-4)
        return
    # On tensor cores: the accumulation bound of each element (tests/_accuracy.py), and, as in
    # tests/ops/test_gemm.py, the whole matrix within "fast" accumulation's allowance of
    # max(2**-9, 2**-13 * K / 32) of its norm (2**-9 here, K = 48).
    assert_within(y, gemm(Bound.exact(x), Bound.exact(w), ref), rtol=0.0, atol=0.0)
    rel = float(jnp.linalg.norm(y - ref) / jnp.linalg.norm(ref))
    assert rel <= EPS32 + max(2.0**-9, 2.0**-13 * x.shape[1] / 32), rel


def test_representable_gradients_are_tight():
    x = fp8jax.cast_to_representable(rand((32, 48), 5, 2.0), E4M3)
    w = fp8jax.cast_to_representable(rand((48, 16), 6, 0.5), E4M3)
    b = rand((16,), 7)
    c = fp8jax.cast_to_representable(rand((32, 16), 8), E5M2)  # dL/dy = c, E5M2-exact

    g = _grad(lambda x, w, b, p: jnp.sum(_fp8(x, w, b, probe=p) * c), (0, 1, 2))(x, w, b)
    gr = jax.grad(lambda x, w, b: jnp.sum(_ref(x, w, b) * c), argnums=(0, 1, 2))(x, w, b)
    if not _tensor_cores():
        for got, want in zip(g, gr, strict=True):
            np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-4, atol=1e-4)
        return
    # On tensor cores, dgrad c @ w^T (K = 16) and wgrad x^T @ c (K = 32) within their GEMMs'
    # accumulation bound (tests/_accuracy.py) and, whole, within "split" accumulation's
    # allowance of 2**-9 (tests/ops/test_gemm.py); dbias is c's column sum in float32, as on CPU.
    xb, wb, cb = Bound.exact(x), Bound.exact(w), Bound.exact(c)
    for name, got, want in (
        ("dx", g[0], gemm(cb, wb.T, gr[0])),
        ("dw", g[1], gemm(xb.T, cb, gr[1])),
    ):
        assert_within(got, want, rtol=0.0, atol=0.0, what=name)
        rel = float(np.linalg.norm(np.asarray(got, np.float64) - want.value))
        assert rel <= (EPS32 + 2.0**-9) * float(np.linalg.norm(want.value)), (name, rel)
    np.testing.assert_allclose(np.asarray(g[2]), np.asarray(gr[2]), rtol=1e-4, atol=1e-4)


def _normwise_bound(x, w, u):
    """|fl(x) fl(w) - x w| <= (2u + u^2) |x| |w| elementwise; compare Frobenius norms."""
    return (2 * u + u * u) * float(jnp.linalg.norm(jnp.abs(x) @ jnp.abs(w)))


def test_random_inputs_within_fp8_tolerance_forward_and_grads():
    x, w = rand((128, 64), 9, 3.0), rand((64, 96), 10, 0.2)
    y = _fp8(x, w)
    err = float(jnp.linalg.norm(y - _ref(x, w)))
    assert err <= _normwise_bound(x, w, U_E4M3)
    c = rand((128, 96), 11)
    dx, dw = _grad(lambda x, w, p: jnp.sum(_fp8(x, w, probe=p) * c), (0, 1))(x, w)
    # dgrad = fl5(c) fl4(w)^T, wgrad = fl4(x)^T fl5(c): one E4M3 and one E5M2 rounding each.
    u = U_E4M3 + U_E5M2
    assert float(jnp.linalg.norm(dx - c @ w.T)) <= _normwise_bound(c, w.T, u)
    assert float(jnp.linalg.norm(dw - x.T @ c)) <= _normwise_bound(x.T, c, u)


def test_probe_cotangent_is_the_observed_amax():
    x, w = rand((16, 8), 12, 5.0), rand((8, 4), 13)
    c = rand((16, 4), 14, 3.0)
    meta = fp8jax.init_fp8_meta(RECIPE)

    def loss(x, w, probe):
        return jnp.sum(fp8jax.dense(x, w, None, meta, RECIPE, probe=probe, enabled=True) * c)

    obs = jax.grad(loss, argnums=2)(x, w, jnp.zeros(3))
    np.testing.assert_array_equal(
        np.asarray(obs), [jnp.max(jnp.abs(x)), jnp.max(jnp.abs(w)), jnp.max(jnp.abs(c))]
    )


def test_three_step_functional_loop_matches_hand_computation():
    r = DelayedScaling(amax_history_len=2, fp8_format=Format.HYBRID)
    meta = fp8jax.init_fp8_meta(r)
    w = rand((8, 4), 15)
    hist = np.zeros((3, 2), np.float32)
    for step in range(3):
        x = rand((16, 8), 20 + step, 1.0 + step)
        c = rand((16, 4), 30 + step, 0.1 * (step + 1))

        def loss(x, w, probe, meta=meta, c=c):
            return jnp.sum(fp8jax.dense(x, w, None, meta, r, probe=probe, enabled=True) * c)

        obs = jax.grad(loss, argnums=2)(x, w, jnp.zeros(3))
        meta = fp8jax.update_fp8_meta(meta, obs, r)
        seen = np.array([np.abs(x).max(), np.abs(w).max(), np.abs(c).max()], np.float32)
        hist = np.concatenate([seen[:, None], hist[:, :1]], axis=1)
        fmax = np.array([448, 448, 57344], np.float32)
        np.testing.assert_array_equal(np.asarray(meta.amax_history), hist)
        np.testing.assert_array_equal(np.asarray(meta.scale), fmax / hist.max(axis=1))


def test_current_scaling_needs_no_state():
    x, w = rand((32, 16), 16, 100.0), rand((16, 8), 17, 0.01)
    y = fp8jax.dense(x, w, None, None, Float8CurrentScaling(), enabled=True)
    assert float(jnp.linalg.norm(y - _ref(x, w))) <= _normwise_bound(x, w, U_E4M3)
    dx = jax.grad(
        lambda x: jnp.sum(fp8jax.dense(x, w, None, None, Float8CurrentScaling(), enabled=True) ** 2)
    )(x)
    assert dx.shape == x.shape and bool(jnp.all(jnp.isfinite(dx)))


@pytest.mark.parametrize(
    ("x_shape", "axis", "k_shape"),
    [((2, 3, 8), -1, (8, 5)), ((2, 3, 8), (1, 2), (3, 8, 4, 2)), ((4, 6, 3), 1, (6, 7))],
)
def test_dense_general_axes_match_einsum(x_shape, axis, k_shape):
    x = fp8jax.cast_to_representable(rand(x_shape, 18), E4M3)
    k = fp8jax.cast_to_representable(rand(k_shape, 19, 0.5), E4M3)
    y = _fp8(x, k, axis=axis)
    axes = (axis,) if isinstance(axis, int) else axis
    axes = [a % x.ndim for a in axes]
    letters = "abcdefgh"
    xs = [letters[i] for i in range(x.ndim)]
    ks = [xs[a] for a in axes] + [letters[x.ndim + i] for i in range(k.ndim - len(axes))]
    out = [c for i, c in enumerate(xs) if i not in axes] + ks[len(axes) :]
    ref = jnp.einsum(
        f"{''.join(xs)},{''.join(ks)}->{''.join(out)}", x, k, precision=jax.lax.Precision.HIGHEST
    )
    assert y.shape == ref.shape
    np.testing.assert_allclose(np.asarray(y), np.asarray(ref), rtol=1e-4, atol=1e-4)


def test_bf16_compute_dtype_and_jit():
    x, w, b = rand((64, 32), 21).astype(jnp.bfloat16), rand((32, 16), 22), rand((16,), 23)
    f = jax.jit(lambda x, w, b: _fp8(x, w, b, dtype=jnp.bfloat16))
    y = f(x, w, b)
    assert y.dtype == jnp.bfloat16
    hlo = f.lower(x, w, b).as_text()
    assert "fp8jax_cast_transpose" in hlo


def test_bias_gradient_reads_g_once():
    """With a bias, the compiled backward takes dbias from the cast of g: one fp8jax cast custom
    call on g (cast_transpose_dbias, none plain) and no separate column reduction of g."""
    m, k, n = 64, 32, 48
    x, w, b = rand((m, k), 40), rand((k, n), 41), rand((n,), 42)
    loss = lambda x, w, b, p: jnp.sum(_fp8(x, w, b, probe=p) ** 2)
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2, 3)))
    hlo = grad.lower(x, w, b, jnp.zeros(3)).compile().as_text()
    calls = re.findall(r'custom_call_target="(fp8jax_cast_transpose\w*)"', hlo)
    g_casts = [c for c in calls if c == "fp8jax_cast_transpose_dbias"]
    assert len(g_casts) == 1 and calls.count("fp8jax_cast_transpose") == 2, calls  # x, w, g
    column_sums = re.findall(rf"= \w+\[{n}\]\S* reduce\(", hlo)  # what XLA's dbias would be
    assert not column_sums, column_sums
    # and the value: dbias is the column sum of g = 2 y
    db = grad(x, w, b, jnp.zeros(3))[2]
    y = _fp8(x, w, b)
    np.testing.assert_allclose(np.asarray(db), np.asarray(2 * y).sum(0), rtol=1e-5, atol=1e-4)


def test_checkpoint_names_reach_the_jaxpr():
    x, w = rand((8, 8), 24), rand((8, 8), 25)
    loss = lambda x, p: jnp.sum(_fp8(x, w, probe=p) ** 2)
    jaxpr = str(jax.make_jaxpr(_grad(loss, (0,)))(x))
    for name in fp8jax.CHECKPOINT_NAMES:
        assert name in jaxpr
    g1 = _grad(jax.checkpoint(loss, policy=fp8jax.save_fp8_operands), (0,))(x)
    g2 = _grad(loss, (0,))(x)
    jax.tree.map(np.testing.assert_array_equal, g1, g2)


def test_bad_input():
    x, w = rand((4, 8), 26), rand((8, 3), 27)
    meta = fp8jax.init_fp8_meta(RECIPE)
    with pytest.raises(ValueError, match="kernel shape"):
        fp8jax.dense(x, rand((7, 3), 0), None, meta, RECIPE, enabled=True)
    with pytest.raises(TypeError, match="x must be a floating-point"):
        fp8jax.dense(jnp.ones((4, 8), jnp.int32), w, None, meta, RECIPE, enabled=True)
    with pytest.raises(ValueError, match="axis 5 is out of range"):
        fp8jax.dense(x, w, None, meta, RECIPE, axis=5, enabled=True)
    with pytest.raises(ValueError, match="bias must have shape"):
        fp8jax.dense(x, w, jnp.ones(4), meta, RECIPE, enabled=True)
    with pytest.raises(TypeError, match="needs fp8_meta"):
        fp8jax.dense(x, w, None, None, RECIPE, enabled=True)
    with pytest.raises(ValueError, match="E5M2 cannot run GEMMs"):
        fp8jax.dense(x, w, None, None, Float8CurrentScaling(fp8_format=Format.E5M2), enabled=True)
    with pytest.raises(ValueError, match="probe must be float32"):
        fp8jax.dense(x, w, None, meta, RECIPE, probe=jnp.zeros(2), enabled=True)


def test_casts_read_float32_params_directly():
    """bfloat16 compute with float32 params: the kernel is cast to FP8 straight from float32
    (no convert pass over the weight to bfloat16 first) and wgrad comes out in float32 (no
    convert back); dgrad comes out in the input's dtype."""
    k, n = 48, 80
    x = rand((32, k), 30).astype(jnp.bfloat16)
    w = rand((k, n), 31)

    def loss(x, w, p):
        y = fp8jax.dense(x, w, None, fp8jax.init_fp8_meta(RECIPE), RECIPE, probe=p,
                         dtype=jnp.bfloat16)  # fmt: skip
        return jnp.sum(y.astype(jnp.float32) ** 2)

    grad = jax.grad(loss, argnums=(0, 1, 2))
    text = jax.jit(grad).lower(x, w, jnp.zeros(3)).as_text()
    to_bf16 = re.findall(rf"tensor<{k}x{n}xf32>\) -> tensor<{k}x{n}xbf16>", text)
    to_f32 = re.findall(rf"tensor<{k}x{n}xbf16>\) -> tensor<{k}x{n}xf32>", text)
    assert not to_bf16 and not to_f32
    dx, dw, _ = grad(x, w, jnp.zeros(3))
    assert dx.dtype == jnp.bfloat16 and dw.dtype == jnp.float32
    # one rounding of the float32 weight to E4M3 (not float32 -> bfloat16 -> E4M3)
    y = fp8jax.dense(x, w, None, fp8jax.init_fp8_meta(RECIPE), RECIPE, dtype=jnp.bfloat16)
    w_q = w.astype(jnp.float8_e4m3fn).astype(jnp.float32)
    x_q = x.astype(jnp.float8_e4m3fn).astype(jnp.float32)
    want = (x_q @ w_q).astype(jnp.bfloat16)
    if jax.default_backend() == "cpu":  # exact float32 sums on CPU; a GPU sums in another order
        np.testing.assert_array_equal(y, want)
    else:
        np.testing.assert_allclose(np.asarray(y, np.float32), np.asarray(want, np.float32),
                                   rtol=2e-2, atol=1e-2)  # fmt: skip
