"""The block-scaled recipes through the training machinery a per-tensor recipe uses:
``Fp8TrainState`` steps of a ``TransformerLayer`` (stateless: no ``fp8_meta``, no probe),
``Fp8DotGeneral``/``Fp8Einsum`` injected into plain Flax layers, and ``nn.scan`` over layers."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _shared import rand

import fp8jax
from fp8jax.flax import DenseGeneral, Fp8DotGeneral, Fp8Einsum, Fp8TrainState, TransformerLayer

RECIPES = {"block": fp8jax.Float8BlockScaling(), "mxfp8": fp8jax.MXFP8BlockScaling()}


def _bits(a):
    return np.asarray(a, np.float32)


@pytest.mark.parametrize("name", list(RECIPES))
def test_transformer_layer_trains_with_fp8_train_state(name):
    recipe = RECIPES[name]
    model = TransformerLayer(
        hidden_size=128, mlp_hidden_size=256, num_attention_heads=4, hidden_dropout=0.0,
        attention_dropout=0.0, intermediate_dropout=0.0, enable_relative_embedding=False,
    )  # fmt: skip
    x = rand((2, 16, 128), 3)
    y = rand((2, 16, 128), 4) * 0.5
    state = Fp8TrainState.from_model(model, jax.random.key(0), x, tx=optax.adam(3e-3),
                                     recipe=recipe)  # fmt: skip
    assert state.fp8_meta == {} and state.fp8_probe == {}

    @jax.jit
    def step(state):
        def loss_fn(params, probes):
            out = state.apply(state.variables(params, probes), x, deterministic=True)
            return jnp.mean((out.astype(jnp.float32) - y) ** 2)

        loss, (g, pg) = jax.value_and_grad(loss_fn, argnums=(0, 1))(state.params, state.fp8_probe)
        return state.apply_gradients(grads=g, probe_grads=pg), loss

    losses = []
    for _ in range(4):
        state, loss = step(state)
        losses.append(float(loss))
    assert all(np.isfinite(losses)) and losses[-1] < losses[0], losses
    assert state.fp8_meta == {} and int(state.step) == 4


class _Injected(nn.Module):
    """A Dense with Fp8DotGeneral, and an einsum with Fp8Einsum, over the same weight shape."""

    einsum: bool

    @nn.compact
    def __call__(self, x):
        if self.einsum:
            w = self.param("w", nn.initializers.normal(0.1), (256, 128))
            return Fp8Einsum()("btd,dh->bth", x, w)
        return nn.Dense(128, use_bias=False, dot_general_cls=Fp8DotGeneral, name="d")(x)


@pytest.mark.parametrize("einsum", [False, True], ids=["Fp8DotGeneral", "Fp8Einsum"])
@pytest.mark.parametrize("name", list(RECIPES))
def test_injected_dot_general_and_einsum_equal_functional_dense(name, einsum):
    recipe = RECIPES[name]
    x = rand((2, 64, 256), 5)
    model = _Injected(einsum)
    with fp8jax.autocast(enabled=True, recipe=recipe):
        params = model.init(jax.random.key(1), x)["params"]
        got = model.apply({"params": params}, x)
        w = params["w"] if einsum else params["d"]["kernel"]
        want = fp8jax.dense(x, w)
    np.testing.assert_array_equal(_bits(got), _bits(want))


@pytest.mark.parametrize("name", list(RECIPES))
def test_scan_over_layers_equals_the_layers_applied_in_turn(name):
    recipe = RECIPES[name]

    class Layer(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            return DenseGeneral(features=128, name="dense")(x), None

    scanned = nn.scan(Layer, variable_axes={"params": 0}, split_rngs={"params": True}, length=3)

    class Stack(nn.Module):
        @nn.compact
        def __call__(self, x):
            return scanned(name="layers")(x, None)[0]

    x = rand((32, 128), 6)
    with fp8jax.autocast(enabled=True, recipe=recipe):
        variables = Stack().init(jax.random.key(2), x)
        assert set(variables) == {"params"}
        got = jax.jit(Stack().apply)(variables, x)
        h = x
        stacked = variables["params"]["layers"]["dense"]
        for i in range(3):
            p = jax.tree.map(lambda v, i=i: v[i], stacked)
            h = DenseGeneral(features=128).apply({"params": p}, h)
    np.testing.assert_array_equal(_bits(got), _bits(h))
