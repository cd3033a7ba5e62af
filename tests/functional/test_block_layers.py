"""The layers under the block-scaled recipes (Float8BlockScaling, MXFP8BlockScaling): the dense
layer's forward and its three gradients equal, bit for bit (on a GPU, within cuBLASLt's
accumulation), the same computation composed by hand from fp8jax.ops.block.block_scaling; the norm
and MLP layers, the Flax modules and a train step stay within FP8 bounds of their
high-precision results; remat with the FP8 policy changes nothing; stateless (no FP8
variables, no probe needed)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _shared import rand

import fp8jax
from fp8jax import ops
from fp8jax.ops.block import block_scaling as bs

RECIPES = {
    "block": fp8jax.Float8BlockScaling(),
    "block-f32-hybrid": fp8jax.Float8BlockScaling(
        use_f32_scales=True, fp8_format=fp8jax.Format.HYBRID
    ),
    "mxfp8": fp8jax.MXFP8BlockScaling(),
    "mxfp8-2d": fp8jax.MXFP8BlockScaling(enable_2d_quantization=True),
}


def _quant(recipe, x, dtype, role):
    block = recipe.block(role)
    if isinstance(recipe, fp8jax.MXFP8BlockScaling):
        return bs.mxfp8_quantize(x, dtype, block)
    q = {"x": recipe.fp8_quant_fwd_inp, "w": recipe.fp8_quant_fwd_weight,
         "grad": recipe.fp8_quant_bwd_grad}[role]  # fmt: skip
    return bs.block_quantize(x, dtype, block, power_2_scale=q.power_2_scale)


def _by_hand(recipe, x, w, b, g):
    """dense's forward and gradients composed from the block ops: TN GEMMs on K-major
    copies, the 1-row-block tensors' transposed copies quantized again from high precision,
    the square-block weight's transposed as bytes."""
    fwd, bwd = recipe.fwd_dtype, recipe.bwd_dtype
    bx, bw, bg = recipe.block("x"), recipe.block("w"), recipe.block("grad")
    x_q, x_s = _quant(recipe, x, fwd, "x")
    x_tq, x_ts = _quant(recipe, x.T, fwd, "x")
    if bw[0] == bw[1]:
        w_q, w_s = _quant(recipe, w, fwd, "w")
        w_tq, w_ts = w_q.T, w_s.T
    else:
        w_q, w_s = _quant(recipe, w, fwd, "w")
        w_tq, w_ts = _quant(recipe, w.T, fwd, "w")
    y = bs.block_scaled_matmul(x_q, x_s, bx, w_tq, w_ts, bw) + b
    g_q, g_s = _quant(recipe, g, bwd, "grad")
    g_tq, g_ts = _quant(recipe, g.T, bwd, "grad")
    dx = bs.block_scaled_matmul(g_q, g_s, bg, w_q, w_s, bw)
    dw = bs.block_scaled_matmul(x_tq, x_ts, bx, g_tq, g_ts, bg)
    # dbias: the per-tensor op's column sums (the same fixed order as the fused block op's)
    return y, dx, dw, ops.cast_transpose_dbias(g, jnp.float32(1), bwd)[4]


@pytest.mark.parametrize("name", list(RECIPES))
def test_dense_equals_the_block_ops_composed_by_hand(name):
    recipe = RECIPES[name]
    x = rand((256, 384), 1) * jnp.exp(rand((256, 1), 2) * 2)  # rows of different magnitudes
    w, b = rand((384, 200), 3) * 0.05, rand((200,), 4)
    g = rand((256, 200), 5)

    @jax.jit
    def ours(x, w, b, g):
        y, vjp = jax.vjp(lambda x, w, b: fp8jax.dense(x, w, b, recipe=recipe), x, w, b)
        return (y, *vjp(g))

    got = ours(x, w, b, g)
    want = jax.jit(lambda *a: _by_hand(recipe, *a))(x, w, b, g)
    # On a GPU the layer's GEMMs are cuBLASLt's (where it takes the recipe's blocks), which sum the
    # FP8 products in their own order and, on Hopper, keep about 14 bits between the float32
    # promotions of each 128-wide K chunk: each output within 2**-8 of the sum of its products'
    # magnitudes (a scale in the wrong place or block is off by far more).
    x_, w_, g_ = (np.abs(np.asarray(v, np.float64)) for v in (x, w, g))
    magnitudes = (x_ @ w_, g_ @ w_.T, x_.T @ g_, None)
    for name_, a, c, mag in zip(("y", "dx", "dw", "dbias"), got, want, magnitudes, strict=True):
        if jax.default_backend() == "cpu" or mag is None:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(c), err_msg=name_)
        else:
            err = np.abs(np.asarray(a, np.float64) - np.asarray(c, np.float64))
            assert np.all(err <= 2.0**-8 * mag), (name_, float(np.max(err / mag)))


@pytest.mark.parametrize("name", ["block", "mxfp8"])
@pytest.mark.parametrize("acts", [("gelu",), ("silu", "linear")], ids=["gelu", "swiglu"])
def test_norm_and_mlp_layers_are_as_close_as_per_tensor_fp8(name, acts):
    """layernorm_mlp then layernorm_dense, forward and gradients of every input, against FP8
    off: no further from it than per-tensor current scaling in the same format."""
    x = rand((2, 64, 256), 6)
    gamma, beta = 1 + 0.1 * rand((256,), 7), 0.1 * rand((256,), 8)
    w1, w2 = rand((256, len(acts), 512), 9) * 0.06, rand((512, 256), 10) * 0.04
    args = (x, gamma, beta, w1, w2)

    def run(recipe):
        def loss(x, gamma, beta, w1, w2):
            kw = dict(recipe=recipe, enabled=recipe is not None)
            y = fp8jax.layernorm_mlp(x, gamma, beta, w1, w2, activations=acts, **kw)
            z = fp8jax.layernorm_dense(y, gamma, beta, w2.T, **kw)
            return jnp.sum(z * jnp.cos(z)), (y, z)

        (_, outs), grads = jax.jit(jax.value_and_grad(loss, (0, 1, 2, 3, 4), has_aux=True))(*args)
        return (*outs, *grads)

    exact = run(None)
    per_tensor = run(fp8jax.Float8CurrentScaling(fp8_format=fp8jax.Format.E4M3))
    for a, p, c in zip(run(RECIPES[name]), per_tensor, exact, strict=True):
        err, err_pt = (float(jnp.linalg.norm(v - c) / jnp.linalg.norm(c)) for v in (a, p))
        assert err <= max(1.25 * err_pt, 0.02), (err, err_pt)


def test_flax_modules_take_the_block_recipes_without_fp8_state():
    layer = fp8jax.flax.TransformerLayer(
        hidden_size=128, mlp_hidden_size=256, num_attention_heads=4, hidden_dropout=0.0,
        attention_dropout=0.0,
    )  # fmt: skip
    x = rand((2, 32, 128), 11)
    for name in ("block", "mxfp8"):
        with fp8jax.autocast(enabled=True, recipe=RECIPES[name]):
            variables = layer.init(jax.random.key(0), x, deterministic=True)
            assert set(variables) == {"params"}  # stateless: nothing to carry between steps

            def loss(p):
                return jnp.mean(layer.apply({"params": p}, x, deterministic=True) ** 2)

            loss8, g8 = jax.jit(jax.value_and_grad(loss))(variables["params"])
        loss0, g = jax.jit(jax.value_and_grad(loss))(variables["params"])  # FP8 off
        assert abs(float(loss8) - float(loss0)) < 0.05 * abs(float(loss0))
        for a, c in zip(jax.tree.leaves(g8), jax.tree.leaves(g), strict=True):
            assert np.isfinite(np.asarray(a)).all()
            assert float(jnp.linalg.norm(a - c)) <= 0.15 * float(jnp.linalg.norm(c)) + 1e-6


def test_dense_general_equals_functional_dense_under_block_scaling():
    x = rand((4, 16, 256), 12)
    model = fp8jax.flax.DenseGeneral(features=128)
    with fp8jax.autocast(enabled=True, recipe=RECIPES["block"]):
        variables = model.init(jax.random.key(1), x)
        y = model.apply(variables, x)
    p = variables["params"]
    want = fp8jax.dense(x, p["kernel"], p["bias"], recipe=RECIPES["block"])
    np.testing.assert_array_equal(np.asarray(y), np.asarray(want))
    twin = nn.DenseGeneral(features=128).apply(variables, x)
    assert float(jnp.linalg.norm(y - twin) / jnp.linalg.norm(twin)) < 0.06


def test_remat_with_the_fp8_policy_keeps_the_numbers():
    recipe = RECIPES["block"]
    x, w = rand((128, 256), 13), rand((256, 128), 14) * 0.05

    def f(x, w):
        return jnp.sum(jnp.tanh(fp8jax.dense(x, w, recipe=recipe)))

    plain = jax.jit(jax.grad(f, (0, 1)))(x, w)
    remat = jax.jit(jax.grad(jax.checkpoint(f, policy=fp8jax.save_fp8_operands), (0, 1)))(x, w)
    for a, c in zip(plain, remat, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(c))


def test_no_probe_needed_and_nothing_is_observed():
    """Block scaling keeps no state: the observations are NaN ("not observed"), so no pass over
    an operand computes an amax nothing reads."""
    x, w = rand((128, 128), 15), rand((128, 64), 16)
    probe = jnp.zeros(3)
    obs = jax.grad(lambda pr: jnp.sum(fp8jax.dense(x, w, recipe=RECIPES["block"], probe=pr)))(probe)
    assert np.isnan(np.asarray(obs)).all()
    jax.grad(lambda w: jnp.sum(fp8jax.dense(x, w, recipe=RECIPES["mxfp8"])))(w)  # no probe: fine


def test_nnx_layers_take_the_block_recipes():
    from flax import nnx

    import fp8jax.nnx as fnnx

    model = fnnx.LayerNormMLP(
        256, intermediate_dim=512, activations=("silu", "linear"), deterministic=True,
        rngs=nnx.Rngs(0),
    )  # fmt: skip
    x = rand((4, 16, 256), 17)
    with fp8jax.autocast(enabled=True, recipe=RECIPES["mxfp8"]):
        y = model(x)[0]  # (output, the norm's output or None), as TE's LayerNormMLP
        grads = nnx.grad(lambda m: jnp.mean(m(x)[0] ** 2))(model)
    y0 = model(x)[0]  # FP8 off
    assert float(jnp.linalg.norm(y - y0) / jnp.linalg.norm(y0)) < 0.08
    assert all(np.isfinite(np.asarray(g)).all() for g in jax.tree.leaves(grads))


@pytest.mark.parametrize("name", ["block", "mxfp8"])
@pytest.mark.parametrize("acts", [("gelu",), ("silu", "linear")], ids=["gelu", "swiglu"])
@pytest.mark.parametrize("inter", [256, 96], ids=["whole-blocks", "ragged"])
def test_mlp_fused_block_casts_equal_the_unfused_chain(name, acts, inter):
    """The MLP's activation and its gradient under block scaling: one fused op each (the
    gradient's only where the intermediate dim holds whole blocks, else dactivation then the
    dbias cast), with the bits of the activation (or its gradient) cast by the plain ops."""
    import importlib

    from fp8jax.functional import _core as core

    lm = importlib.import_module(
        "fp8jax.functional.mlp"
    )  # the module (fp8jax.layernorm_mlp: the function)

    setup, scale, _ = core.resolve("t", RECIPES[name], None, None, None, 6, ("norm", "activation"))
    cfg = lm._Config(setup=setup, norm=None, activations=acts, has_bias=(True, True),
                     keep_ln=False, grouped=False, fused=False, dtype=jnp.dtype(jnp.bfloat16),
                     dtypes=(jnp.bfloat16,) * 7)  # fmt: skip
    m, k = 256, len(acts)
    h = rand((m, k, inter), 20).astype(jnp.bfloat16)
    da = rand((m, inter), 21).astype(jnp.bfloat16)

    def bits(tree):
        return [np.asarray(v).view(np.uint8) if np.asarray(v).dtype.itemsize == 1 else
                np.asarray(v) for v in jax.tree.leaves(tree)]  # fmt: skip

    def same(got, want):
        for g, w in zip(bits(got), bits(want), strict=True):
            np.testing.assert_array_equal(g, w)

    fwd = jax.jit(lambda h: lm._activation_fp8(cfg, h, scale[3], None))
    same(fwd(h), core.cast_t(setup, ops.activation(h, acts), scale[3], setup.fwd_dtype))
    bwd = jax.jit(lambda da, h: lm._dactivation_fp8(cfg, da, h, scale[2]))
    dh = ops.dactivation(da, h, acts).reshape(m, k * inter)
    same(bwd(da, h), core.cast_dbias(setup, dh, scale[2], True))
    hlo = bwd.lower(da, h).as_text()
    fused = "fp8jax_dactivation_block_cast_transpose_dbias" in hlo
    assert fused == (inter % setup.block("grad")[0][1] == 0)
