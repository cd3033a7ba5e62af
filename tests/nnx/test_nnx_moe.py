"""fp8jax.nnx.MoEBlock (and TransformerLayer(mlp="moe")): the same params from the same key as the
Linen twin, the same outputs under FP8 and with FP8 off, the FP8 state layout, the losses sown
as ``nnx.Intermediate``."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _nnx import RECIPE, TRANSFORMER, assert_trees_equal
from _shared import rand
from flax import nnx

import fp8jax
from fp8jax import flax as fflax
from fp8jax import nnx as fnnx
from fp8jax.layers import MoEBlockConfig

CONFIG = dict(
    num_experts=4,
    num_experts_per_tok=2,
    intermediate_size=8,
    shared_expert_intermediate_size=6,
    aux_loss_coeff=0.01,
)
X = rand((2, 6, 16), 0)


def test_same_params_and_outputs_as_the_linen_twin():
    with fp8jax.autocast(enabled=True, recipe=RECIPE):
        model = fnnx.MoEBlock(16, **CONFIG, rngs=nnx.Rngs(0))
        twin = fflax.MoEBlock(**CONFIG)
        variables = twin.init(nnx.Rngs(0).params(), X)
    assert_trees_equal(model.linen_variables()["params"], nn.unbox(variables["params"]))
    assert model.fp8_meta.scale.shape == (24,)
    assert model.shared_experts.wi_kernel.shape == (16, 2, 6)
    for recipe in (None, fp8jax.Float8CurrentScaling(), fp8jax.Float8RowwiseScaling(), RECIPE):
        with fp8jax.autocast(enabled=recipe is not None, recipe=recipe):
            out, aux = model(X)
            want, want_aux = twin.apply(variables, X)
        np.testing.assert_array_equal(out, want)
        np.testing.assert_array_equal(aux, want_aux)


def test_losses_are_sown_as_intermediates():
    model = fnnx.MoEBlock(16, **CONFIG, z_loss_coeff=1e-3, rngs=nnx.Rngs(1))
    if hasattr(nnx, "capture"):
        (_, aux), sown = nnx.capture(model, nnx.Intermediate)(X)
    else:  # older Flax: the sown values are attributes
        _, aux = model(X)
        sown = nnx.pop(model, nnx.Intermediate)
    np.testing.assert_allclose(aux, sown["aux_loss"][0] + sown["z_loss"][0], rtol=1e-6)


def test_transformer_layer_with_an_moe_mlp():
    moe = MoEBlockConfig(num_experts=4, num_experts_per_tok=2, intermediate_size=8)
    with fp8jax.autocast(enabled=True, recipe=RECIPE):
        layer = fnnx.TransformerLayer(**TRANSFORMER, mlp="moe", moe=moe, rngs=nnx.Rngs(0))
        twin = fflax.TransformerLayer(**TRANSFORMER, mlp="moe", moe=moe)
        variables = twin.init(nnx.Rngs(0).params(), X, deterministic=True)
        y = layer(X, deterministic=True)
        want = twin.apply(variables, X, deterministic=True)
    assert type(layer.mlp).__name__ == "MoEBlock"
    assert_trees_equal(layer.linen_variables()["params"], nn.unbox(variables["params"]))
    np.testing.assert_array_equal(y, want)
    assert jnp.shape(layer.mlp.fp8_meta.scale) == (24,)


def test_moe_layer_trains_five_steps_bit_identical_to_linen():
    """An MoE TransformerLayer trains in NNX as in Linen, bit for bit: the loss with the sown
    load-balancing loss, the params, and the per-expert FP8 state after each step."""
    moe = MoEBlockConfig(
        num_experts=4, num_experts_per_tok=2, intermediate_size=8, aux_loss_coeff=0.01
    )
    kw = dict(**TRANSFORMER, mlp="moe", moe=moe)
    with fp8jax.autocast(enabled=True, recipe=RECIPE):
        model = fnnx.TransformerLayer(**kw, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    x, y = rand((2, 6, 16), 7), rand((2, 6, 16), 8)
    state = fflax.Fp8TrainState.from_variables(
        apply_fn=fflax.TransformerLayer(**kw).apply, variables=model.linen_variables(),
        tx=optax.adam(1e-2), recipe=RECIPE,
    )  # fmt: skip

    def nnx_loss(m):
        if hasattr(nnx, "capture"):
            out, sown = nnx.capture(m, nnx.Intermediate)(x, deterministic=True)
        else:  # older Flax: the sown values are attributes
            out = m(x, deterministic=True)
            sown = nnx.pop(m, nnx.Intermediate)
        return jnp.mean((out - y) ** 2) + sum(jnp.sum(v) for v in jax.tree.leaves(sown))

    @nnx.jit
    def nnx_step(model, optimizer):
        with fp8jax.autocast(enabled=True, recipe=RECIPE):
            loss, grads = nnx.value_and_grad(nnx_loss, argnums=fnnx.diff_state())(model)
        fnnx.apply_gradients(model, optimizer, grads)
        return loss

    @jax.jit
    def linen_step(state):
        def f(params, probes):
            out, sown = state.apply(state.variables(params, probes), x, deterministic=True,
                                    mutable=["intermediates"])  # fmt: skip
            aux = sum(jnp.sum(v) for v in jax.tree.leaves(sown["intermediates"]))
            return jnp.mean((out - y) ** 2) + aux

        loss, (g, pg) = jax.value_and_grad(f, argnums=(0, 1))(state.params, state.fp8_probe)
        return state.apply_gradients(grads=g, probe_grads=pg), loss

    for _ in range(5):
        loss = nnx_step(model, optimizer)
        state, want = linen_step(state)
        assert float(loss) == float(want)
    variables = model.linen_variables()
    assert_trees_equal(variables["params"], state.params)
    assert_trees_equal(variables["fp8_meta"], state.fp8_meta)
    scale = variables["fp8_meta"]["mlp"]["scale"]
    assert np.all(np.asarray(scale) != 1.0)  # every per-expert scale trained


def test_linen_twin_of_the_moe_block():
    """Was: "linen_twin: MoEBlock is not an fp8jax.nnx layer"."""
    model = fnnx.MoEBlock(16, **CONFIG, rngs=nnx.Rngs(0))
    twin = fflax.linen_twin(model)
    assert isinstance(twin, fflax.MoEBlock) and twin.num_experts == CONFIG["num_experts"]
    out, aux = twin.apply(model.linen_variables(), X)
    want, want_aux = model(X)
    np.testing.assert_array_equal(out, want)
    np.testing.assert_array_equal(aux, want_aux)


def test_an_input_of_the_wrong_width_is_named():
    """Was JAX's ``dot_general`` TypeError; now fp8jax's error, as the other layers give."""
    model = fnnx.MoEBlock(16, **CONFIG, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"MoEBlock: the inputs' last dim is 12, but the params"):
        model(rand((2, 6, 12), 1))
