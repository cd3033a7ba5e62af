"""fp8jax.grouped_dense (the MoE experts' GEMM) under Float8RowwiseScaling (issue 49, the
reference path): forward and its three gradients against a float64 emulation written with numpy
(tests/ops/_rowwise_numpy.py): each token row its own scale along K, each expert's kernel per
output column along K (per input row along N for the dgrad), the wgrad's operands per group per
column over the group's tokens, requantized from the row-wise FP8 values; bit for bit the
composition of the row-wise ops group by group; outlier rows closer than per-tensor current
scaling; the high-precision wgrad; the MoE block trains under it in Linen and NNX, alone and in
a TransformerLayer."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _rowwise_numpy import numpy_rowwise_values
from _shared import rand

import fp8jax
from fp8jax import Float8CurrentScaling, Float8RowwiseScaling, Format, ops
from fp8jax.functional.grouped_rowwise import group_column_quantize
from fp8jax.layers import MoEBlockConfig

pytestmark = pytest.mark.usefixtures("float32_matmuls")

RECIPES = {
    "pow2-e4m3": Float8RowwiseScaling(),
    "f32-hybrid-eps": Float8RowwiseScaling(
        power_2_scale=False, fp8_format=Format.HYBRID, amax_epsilon=1e-3
    ),
    "hp-wgrad": Float8RowwiseScaling(wgrad_high_precision=True),
}
T, K, N, G = 40, 48, 24, 4
SIZES = np.array([9, 0, 17, 6])  # an empty expert, 8 rows past the sum


def _spread_rows(shape, seed, spread=1.5):
    """Normal values, each row times 2**round(spread * N(0, 1))."""
    x = rand(shape, seed)
    return x * jnp.exp2(jnp.round(rand((shape[0], 1), seed + 1) * spread))


def _inputs():
    x = _spread_rows((T, K), 1)
    w = rand((G, K, N), 3) * 0.1
    b = rand((G, N), 4)
    g = _spread_rows((T, N), 5)
    return x, w, b, g


def _emulated(recipe, x, w, b, g):
    """grouped_dense's outputs in float64 from the numpy row-wise casts, with the magnitudes
    (sums of |products|) that bound float32 summation."""
    q = recipe.qparams("x")
    fwd, bwd = recipe.fwd_dtype, recipe.bwd_dtype
    x, w, b, g = (np.asarray(a, np.float64) for a in (x, w, b, g))

    def v(a, dt):
        return numpy_rowwise_values(a.astype(np.float32), dt, q.power_2_scale, q.amax_epsilon)

    xv, gv = v(x, fwd), v(g, bwd)
    out = {k: np.zeros(s) for k, s in (("y", (T, N)), ("dx", (T, K)), ("dw", (G, K, N)))}
    mag = {k: np.zeros_like(a) for k, a in out.items()}
    ends = np.cumsum(SIZES)
    for e, (lo, hi) in enumerate(zip(ends - SIZES, ends, strict=True)):
        if lo == hi:  # an empty expert: no rows, no kernel gradient
            continue
        pairs = {
            "y": (xv[lo:hi], v(w[e].T, fwd).T),
            "dx": (gv[lo:hi], v(w[e], fwd).T),
            # per group per column over the group's tokens, from the row-wise FP8 values
            "dw": (v(xv[lo:hi].T, fwd), v(gv[lo:hi].T, bwd).T),
        }
        if recipe.wgrad_high_precision:
            pairs["dw"] = (x[lo:hi].T, g[lo:hi])
        for k, (a, c) in pairs.items():
            sl = e if k == "dw" else slice(lo, hi)
            out[k][sl], mag[k][sl] = a @ c, np.abs(a) @ np.abs(c)
        out["y"][lo:hi] += b[e]
        mag["y"][lo:hi] += np.abs(b[e])
    db = np.stack([g[lo:hi].sum(0) for lo, hi in zip(ends - SIZES, ends, strict=True)])
    out["db"], mag["db"] = db, np.abs(db)
    return out, mag


def _ours(recipe, x, w, b, g):
    sizes = jnp.asarray(SIZES, jnp.int32)

    @jax.jit
    def run(x, w, b, g):
        f = lambda x, w, b: fp8jax.grouped_dense(x, w, sizes, b, recipe=recipe)
        y, vjp = jax.vjp(f, x, w, b)
        return dict(zip(("y", "dx", "dw", "db"), (y, *vjp(g)), strict=True))

    return run(x, w, b, g)


@pytest.mark.parametrize("name", list(RECIPES))
def test_grouped_dense_equals_the_float64_emulation(name):
    """Every FP8 value and power-of-two scale is exact, so only float32 summation differs (at
    most 2**-16 of the products' magnitudes for K <= 256); float32 scales add the rounding of
    the scale products."""
    recipe = RECIPES[name]
    got = _ours(recipe, *_inputs())
    want, mag = _emulated(recipe, *_inputs())
    for key in ("y", "dx", "dw", "db"):
        err = np.abs(np.asarray(got[key], np.float64) - want[key])
        bound = 2.0**-16 * mag[key] + 1e-6 * (key == "db") + 1e-30
        assert np.all(err <= bound), (key, float(np.max(err / bound)))
    assert not np.any(np.asarray(got["y"])[SIZES.sum() :])  # rows past the sum: 0
    assert not np.any(np.asarray(got["dw"])[1])  # the empty expert: no gradient


def test_grouped_dense_is_the_row_wise_ops_group_by_group_bit_for_bit():
    """The forward and the dgrad are, per expert, rowwise_quantize then
    rowwise_scaled_matmul of its rows (the tokens') and its kernel; the wgrad the same GEMM of
    the group's columns requantized from the row-wise values. On small-integer inputs (every
    FP8 value and every float32 sum exact), so that the GEMMs' summation orders (a masked
    ragged dot, a plain dot) cannot differ."""
    recipe = RECIPES["pow2-e4m3"]
    x, w, b, g = (
        jnp.clip(jnp.round(c * a), -8, 8) for c, a in zip((3, 30, 3, 3), _inputs(), strict=True)
    )
    got = _ours(recipe, x, w, b, g)
    fwd = recipe.fwd_dtype
    xq, xs = ops.rowwise_quantize(x, fwd)
    gq, gs = ops.rowwise_quantize(g, fwd)
    xv, gv = (q.astype(jnp.float32) * s for q, s in ((xq, xs), (gq, gs)))
    ends = np.cumsum(SIZES)
    for e, (lo, hi) in enumerate(zip(ends - SIZES, ends, strict=True)):
        if lo == hi:
            continue
        wq_t, ws_t = ops.rowwise_quantize(w[e].T, fwd)
        y = ops.rowwise_scaled_matmul(xq[lo:hi], xs[lo:hi], wq_t, ws_t) + b[e]
        wq, ws = ops.rowwise_quantize(w[e], fwd)
        dx = ops.rowwise_scaled_matmul(gq[lo:hi], gs[lo:hi], wq, ws)
        xc, xcs = ops.rowwise_quantize(xv[lo:hi].T, fwd)
        gc, gcs = ops.rowwise_quantize(gv[lo:hi].T, fwd)
        dw = ops.rowwise_scaled_matmul(xc, xcs, gc, gcs)
        for key, want in (("y", y), ("dx", dx), ("dw", dw)):
            part = got[key][e] if key == "dw" else got[key][lo:hi]
            np.testing.assert_array_equal(np.asarray(part), np.asarray(want), err_msg=key)


def test_group_column_quantize_scales_each_group_apart():
    """A column's scale comes from its group's rows only: a huge value in group 0 leaves group
    1's codes as the row-wise cast of its own rows gives them; rows past the sum get scale 1."""
    v = rand((10, 4), 9).at[0, 0].set(1e4)
    sizes = jnp.asarray([3, 5], jnp.int32)
    q, sinv = group_column_quantize(v, sizes, jnp.float8_e4m3fn, True, 0.0)
    assert sinv.shape == (2, 4)
    want_q, want_s = ops.rowwise_quantize(v[3:8].T, jnp.float8_e4m3fn)
    np.testing.assert_array_equal(np.asarray(q[3:8].T), np.asarray(want_q))
    np.testing.assert_array_equal(np.asarray(sinv[1]), np.asarray(want_s[:, 0]))
    np.testing.assert_array_equal(np.asarray(q[8:], np.float32), np.asarray(v[8:], np.float32)
                                  .astype(jnp.float8_e4m3fn).astype(np.float32))  # fmt: skip


def test_outlier_rows_are_closer_than_per_tensor_current_scaling():
    """Outlier tokens (massive activations, 1e5x) in two experts: per-tensor current scaling
    (one scale per expert) sinks the other tokens of those experts, row-wise scaling does not."""
    sizes = jnp.asarray([32, 32, 32, 32], jnp.int32)
    x = rand((128, 64), 20).at[jnp.array([3, 40])].multiply(1e5)
    w = rand((4, 64, 32), 21) * 0.1
    g = rand((128, 32), 22).at[jnp.array([5, 70])].multiply(1e5)
    ordinary = np.setdiff1d(np.arange(128), [3, 40, 5, 70])
    x64, w64, g64 = (np.asarray(a, np.float64) for a in (x, w, g))
    gid = np.repeat(np.arange(4), 32)
    exact_y = np.einsum("tk,tkn->tn", x64, w64[gid])
    exact_dx = np.einsum("tn,tkn->tk", g64, w64[gid])

    def errors(recipe):
        y, vjp = jax.vjp(lambda x: fp8jax.grouped_dense(x, w, sizes, recipe=recipe), x)
        (dx,) = vjp(g)
        out = []
        for v, e in ((y, exact_y), (dx, exact_dx)):
            d = np.asarray(v, np.float64)[ordinary] - e[ordinary]
            out.append(float(np.mean(np.linalg.norm(d, axis=1) /
                                     np.linalg.norm(e[ordinary], axis=1))))  # fmt: skip
        return out

    row_wise = errors(Float8RowwiseScaling())
    per_tensor = errors(Float8CurrentScaling(fp8_format=Format.E4M3))
    for name, rw, pt in zip(("y", "dx"), row_wise, per_tensor, strict=True):
        assert rw < 0.05 and rw <= 0.5 * pt, (name, rw, pt)


def test_high_precision_wgrad_changes_only_dw_and_is_fp8_offs():
    x, w, b, g = _inputs()
    fp8 = _ours(RECIPES["pow2-e4m3"], x, w, b, g)
    hp = _ours(RECIPES["hp-wgrad"], x, w, b, g)
    sizes = jnp.asarray(SIZES, jnp.int32)
    _, vjp = jax.vjp(lambda w: fp8jax.grouped_dense(x, w, sizes, b, enabled=False), w)
    (dw0,) = vjp(g)
    for key in ("y", "dx", "db"):
        np.testing.assert_array_equal(np.asarray(fp8[key]), np.asarray(hp[key]))
    rel = lambda a, c: float(jnp.linalg.norm(a - c) / jnp.linalg.norm(c))
    assert rel(hp["dw"], dw0) < 1e-6 < 0.01 < rel(fp8["dw"], dw0) < 0.1


def test_no_state_and_nothing_observed():
    x, w, _, _ = _inputs()
    sizes = jnp.asarray(SIZES, jnp.int32)
    recipe = RECIPES["pow2-e4m3"]
    f = lambda pr: jnp.sum(fp8jax.grouped_dense(x, w, sizes, recipe=recipe, probe=pr))
    obs = jax.grad(f)(jnp.zeros(3 * G))
    assert np.isnan(np.asarray(obs)).all()


MOE = dict(num_experts=4, num_experts_per_tok=2, intermediate_size=8)


def _train(loss_fn, params, steps=4):
    tx = optax.adam(1e-2)
    opt = tx.init(params)

    @jax.jit
    def step(params, opt):
        loss, grads = jax.value_and_grad(loss_fn)(params)
        updates, opt = tx.update(grads, opt)
        return optax.apply_updates(params, updates), opt, loss

    losses = []
    for _ in range(steps):
        params, opt, loss = step(params, opt)
        losses.append(float(loss))
    return losses


@pytest.mark.parametrize("mlp", ["moe", "transformer"])
def test_linen_moe_trains_under_the_row_wise_recipe(mlp):
    """Linen MoEBlock and an MoE TransformerLayer: no FP8 state, finite decreasing loss, the
    first loss close to FP8 off's."""
    recipe = RECIPES["pow2-e4m3"]
    x, y = rand((2, 12, 16), 30), rand((2, 12, 16), 31)
    if mlp == "moe":
        layer = fp8jax.flax.MoEBlock(**MOE)
        call = lambda p: layer.apply({"params": p}, x)[0]
    else:
        layer = fp8jax.flax.TransformerLayer(
            hidden_size=16, mlp_hidden_size=32, num_attention_heads=2, hidden_dropout=0.0,
            attention_dropout=0.0, mlp="moe", moe=MoEBlockConfig(**MOE),
        )  # fmt: skip
        call = lambda p: layer.apply({"params": p}, x, deterministic=True)
    with fp8jax.autocast(enabled=True, recipe=recipe):
        variables = (layer.init(jax.random.key(0), x) if mlp == "moe"
                     else layer.init(jax.random.key(0), x, deterministic=True))  # fmt: skip
    assert set(variables) == {"params"}

    def loss(p):
        with fp8jax.autocast(enabled=True, recipe=recipe):
            return jnp.mean((call(p) - y) ** 2)

    losses = _train(loss, variables["params"])
    off = float(jnp.mean((call(variables["params"]) - y) ** 2))
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]
    assert losses[0] != off and abs(losses[0] - off) < 0.05 * off


def test_nnx_moe_trains_and_equals_its_linen_twin():
    from flax import nnx

    import fp8jax.nnx as fnnx

    recipe = RECIPES["hp-wgrad"]
    x, y = rand((2, 6, 16), 32), rand((2, 6, 16), 33)
    model = fnnx.MoEBlock(16, **MOE, rngs=nnx.Rngs(0))
    twin = fp8jax.flax.MoEBlock(**MOE)
    with fp8jax.autocast(enabled=True, recipe=recipe):
        got = model(x)[0]
        want = twin.apply(model.linen_variables(), x)[0]
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer):
        with fp8jax.autocast(enabled=True, recipe=recipe):
            loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x)[0] - y) ** 2))(model)
        fnnx.apply_gradients(model, optimizer, grads)
        return loss

    losses = [float(step(model, optimizer)) for _ in range(4)]
    assert all(np.isfinite(losses)) and losses[-1] < losses[0]
