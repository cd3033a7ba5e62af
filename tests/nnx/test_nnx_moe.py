"""fp8jax.nnx.MoEBlock (and TransformerLayer(mlp="moe")): the same params from the same key as the
Linen twin, the same outputs under FP8 and with FP8 off, the FP8 state layout, the losses sown
as ``nnx.Intermediate``."""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp
import numpy as np
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
    for recipe in (None, fp8jax.Float8CurrentScaling(), RECIPE):
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
