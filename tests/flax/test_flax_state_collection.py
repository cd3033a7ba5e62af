"""fp8jax.flax.fp8_state_collection: fp8jax's Linen modules (and Fp8DotGeneral) keep their
delayed-scaling state in the collection it names, and a TE-style train step that
differentiates only params and that collection (MaxText's ``_overwrite_with_gradient``)
trains them as fp8jax's own step does: the same losses and states, step by step."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _shared import rand

import fp8jax
from fp8jax.flax import (
    DenseGeneral,
    Fp8DotGeneral,
    LayerNormMLP,
    fp8_state_collection,
    update_fp8_variables,
)

OWG = "_overwrite_with_gradient"
RECIPE = fp8jax.DelayedScaling(amax_history_len=4)
TX = optax.sgd(0.05)


class Net(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Dense(64, dot_general_cls=Fp8DotGeneral)(x)
        x = LayerNormMLP(intermediate_dim=128)(x, deterministic=True)
        x = x[0] if isinstance(x, tuple) else x
        return DenseGeneral(32)(nn.gelu(x))


def _data():
    x = rand((4, 16, 64), 0)
    return x, jnp.tanh(x[..., :32])


def _init(collection):
    x, _ = _data()
    with fp8jax.autocast(enabled=True, recipe=RECIPE):
        if collection is None:
            return Net().init(jax.random.key(0), x)
        with fp8_state_collection(collection):
            return Net().init(jax.random.key(0), x)


def _te_steps(steps=3):
    """MaxText's step: differentiate params and the state collection; the collection's
    gradient is its next value (the probes are passed along, not differentiated)."""
    x, y = _data()
    variables = _init(OWG)
    probes = variables["fp8_probe"]
    opt = TX.init(variables["params"])

    @jax.jit
    def step(diff, opt):
        def loss_fn(diff):
            with fp8jax.autocast(enabled=True, recipe=RECIPE), fp8_state_collection(OWG):
                out = Net().apply({**diff, "fp8_probe": probes}, x)
            return jnp.mean((out - y) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(diff)
        updates, opt = TX.update(grads["params"], opt)
        return {"params": optax.apply_updates(diff["params"], updates), OWG: grads[OWG]}, opt, loss

    diff = {"params": variables["params"], OWG: variables[OWG]}
    out = []
    for _ in range(steps):
        diff, opt, loss = step(diff, opt)
        out.append((float(loss), diff[OWG]))
    return out


def _fp8jax_steps(steps=3):
    x, y = _data()
    variables = _init(None)
    opt = TX.init(variables["params"])

    @jax.jit
    def step(variables, opt):
        def loss_fn(params, probes):
            with fp8jax.autocast(enabled=True, recipe=RECIPE):
                out = Net().apply({**variables, "params": params, "fp8_probe": probes}, x)
            return jnp.mean((out - y) ** 2)

        loss, (g, pg) = jax.value_and_grad(loss_fn, argnums=(0, 1))(
            variables["params"], variables["fp8_probe"]
        )
        updates, opt = TX.update(g, opt)
        new = {
            **variables,
            "params": optax.apply_updates(variables["params"], updates),
            "fp8_meta": update_fp8_variables(variables["fp8_meta"], pg, RECIPE),
        }
        return new, opt, loss

    out = []
    for _ in range(steps):
        variables, opt, loss = step(variables, opt)
        out.append((float(loss), variables["fp8_meta"]))
    return out


def test_init_puts_the_state_in_the_named_collection():
    default, named = _init(None), _init(OWG)
    assert set(default) == {"params", "fp8_meta", "fp8_probe"}
    assert set(named) == {"params", OWG, "fp8_probe"}
    assert jax.tree.structure(default["fp8_meta"]) == jax.tree.structure(named[OWG])
    assert set(named[OWG]) == {"Dense_0", "LayerNormMLP_0", "DenseGeneral_0"}


def test_te_style_step_trains_as_fp8jax_step():
    te, own = _te_steps(), _fp8jax_steps()
    assert te[-1][0] < te[0][0]  # the loss falls
    for (loss, state), (loss_ref, meta) in zip(te, own, strict=True):
        assert loss == loss_ref
        jax.tree.map(np.testing.assert_array_equal, state, meta)
    scale = te[-1][1]["DenseGeneral_0"]["scale"]
    assert not np.array_equal(scale, np.ones(3))  # the state moved


def test_default_is_unchanged_outside_the_block():
    with fp8_state_collection(OWG):
        pass
    assert set(_init(None)) == {"params", "fp8_meta", "fp8_probe"}


def test_missing_state_names_the_collection():
    x, _ = _data()
    variables = _init(None)
    with fp8jax.autocast(enabled=True, recipe=RECIPE), fp8_state_collection(OWG):
        with pytest.raises(ValueError, match=f"the '{OWG}' variables .* are missing"):
            DenseGeneral(32).apply({"params": variables["params"]["DenseGeneral_0"]}, x)


@pytest.mark.parametrize("bad", ["", "params", "fp8_probe", 3])
def test_bad_name(bad):
    with pytest.raises(ValueError, match="fp8_state_collection: name must be a collection name"):
        with fp8_state_collection(bad):
            pass
