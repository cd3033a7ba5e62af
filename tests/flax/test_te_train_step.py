"""TransformerEngine's train step: the gradient of ``fp8_meta`` is the next FP8 state.

TE's examples differentiate the whole variable dict and keep the non-``params`` gradients as the
next FP8 state (``var_collect, grads = flax.core.pop(grads, "params")``). fp8jax hands that
state out exactly where it can (one call per state) and refuses at trace time where autodiff
would add states up; these tests compare it bit for bit with fp8jax's own step.
"""

from __future__ import annotations

import flax
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _shared import rand
from flax.training import train_state

import fp8jax
from fp8jax import DelayedScaling
from fp8jax.flax import DenseGeneral, Fp8TrainState, LayerNormMLP, TransformerLayer

RECIPE = DelayedScaling(amax_history_len=4)


class _Net(nn.Module):
    """TE's encoder example in small: a TransformerLayer, a remat'd MLP, two dense layers."""

    @nn.compact
    def __call__(self, x):
        x = TransformerLayer(
            hidden_size=16, mlp_hidden_size=32, num_attention_heads=2, hidden_dropout=0.0,
            attention_dropout=0.0, enable_relative_embedding=False,
        )(x, deterministic=True)  # fmt: skip
        x, _ = nn.remat(LayerNormMLP, static_argnums=(2,))(intermediate_dim=24)(x, True)
        x = DenseGeneral(features=8)(x.reshape(x.shape[0], -1))
        return DenseGeneral(features=2)(x)


class _Scanned(nn.Module):
    """Three DenseGeneral layers under nn.scan, each with its own FP8 state (variable axes)."""

    @nn.compact
    def __call__(self, x):
        body = nn.scan(
            lambda mdl, c, _: (DenseGeneral(features=16, parent=mdl)(c), None),
            variable_axes={"params": 0, "fp8_meta": 0, "fp8_probe": 0},
            split_rngs={"params": True},
            length=3,
        )
        return body(self, x, None)[0]


def _loss(apply_fn, variables, x, y):
    with fp8jax.autocast(enabled=True, recipe=RECIPE):
        out = apply_fn(variables, x)
    return jnp.mean((out - y) ** 2)


@jax.jit
def _te_step(state, var_collect, x, y):
    """TE's train step, as its examples write it."""
    var_collect = {**var_collect, "params": state.params}
    loss, grads = jax.value_and_grad(lambda v: _loss(state.apply_fn, v, x, y))(var_collect)
    var_collect, grads = flax.core.pop(grads, "params")
    return state.apply_gradients(grads=grads), loss, var_collect


@jax.jit
def _fp8jax_step(state, x, y):
    def loss_fn(params, probes):
        return _loss(state.apply_fn, state.variables(params, probes), x, y)

    loss, (grads, probe_grads) = jax.value_and_grad(loss_fn, argnums=(0, 1))(
        state.params, state.fp8_probe
    )
    return state.apply_gradients(grads=grads, probe_grads=probe_grads), loss


def _init(model, x):
    with fp8jax.autocast(enabled=True, recipe=RECIPE):
        return model.init(jax.random.key(0), x)


@pytest.mark.parametrize("model_cls", [_Net, _Scanned], ids=["net", "scanned"])
def test_te_train_step_equals_fp8jax_train_step(model_cls):
    model = model_cls()
    x0 = rand((4, 5, 16), 0) if model_cls is _Net else rand((4, 16), 0)
    variables = _init(model, x0)
    tx = optax.adam(1e-2)
    te_state = train_state.TrainState.create(
        apply_fn=model.apply, params=variables["params"], tx=tx
    )
    var_collect = {k: v for k, v in variables.items() if k != "params"}
    ours = Fp8TrainState.from_variables(
        apply_fn=model.apply, variables=variables, tx=tx, recipe=RECIPE
    )
    for step in range(3):
        x = rand(x0.shape, 10 + step, 2.0**step)
        y = rand((x0.shape[0], 2 if model_cls is _Net else 16), 20 + step)
        te_state, te_loss, var_collect = _te_step(te_state, var_collect, x, y)
        ours, loss = _fp8jax_step(ours, x, y)
        assert float(te_loss) == float(loss)
        jax.tree.map(np.testing.assert_array_equal, var_collect["fp8_meta"], ours.fp8_meta)
        jax.tree.map(np.testing.assert_array_equal, te_state.params, ours.params)
    # The state is live: histories hold this run's amaxes and the scales moved off 1.
    scales = jax.tree.leaves(var_collect["fp8_meta"])
    assert all(np.all(np.asarray(s) != 1.0) for s in scales if np.ndim(s) == 1)


def test_te_train_step_skips_a_non_finite_observation():
    """fp8jax's rule holds on this path too: a NaN amax is never written into the history."""
    model = DenseGeneral(features=4)
    x = rand((8, 16), 0)
    variables = _init(model, x)
    te_state = train_state.TrainState.create(
        apply_fn=model.apply, params=variables["params"], tx=optax.sgd(0.0)
    )
    var_collect = {k: v for k, v in variables.items() if k != "params"}
    _, _, var_collect = _te_step(te_state, var_collect, x, rand((8, 4), 1))
    before = var_collect["fp8_meta"]
    _, loss, var_collect = _te_step(te_state, var_collect, x.at[0, 0].set(jnp.nan), x[:, :4])
    assert not np.isfinite(float(loss))
    hist = np.asarray(var_collect["fp8_meta"]["amax_history"])
    assert np.all(np.isfinite(hist)) and np.all(np.isfinite(var_collect["fp8_meta"]["scale"]))
    # the input row (NaN seen) kept its state; the kernel row recorded its amax as usual
    np.testing.assert_array_equal(hist[0], np.asarray(before["amax_history"])[0])
    assert hist[1, 0] == float(jnp.max(jnp.abs(variables["params"]["kernel"])))


def _grad_all(model, variables, x):
    def loss(v):
        return _loss(model.apply, v, x, 0.0)

    return jax.grad(loss)(variables)


def test_module_called_twice_is_refused_naming_fp8_meta():
    class Twice(nn.Module):
        @nn.compact
        def __call__(self, x):
            layer = DenseGeneral(features=16)
            return layer(layer(x))

    model, x = Twice(), rand((4, 16), 0)
    variables = _init(model, x)
    with pytest.raises(ValueError, match=r"fp8_meta.*called 2 times.*Fp8TrainState"):
        _grad_all(model, variables, x)


def test_state_without_probes_is_refused():
    model, x = DenseGeneral(features=4), rand((4, 16), 0)
    variables = _init(model, x)
    del variables["fp8_probe"]
    with pytest.raises(ValueError, match=r"fp8_meta.*no 'fp8_probe' variable"):
        _grad_all(model, variables, x)


def test_state_broadcast_over_scan_is_refused():
    """One layer at every scan step (params and fp8_meta broadcast, probes scanned): each step
    would add its next state to the others."""

    class Shared(nn.Module):
        @nn.compact
        def __call__(self, x):
            body = nn.scan(
                lambda mdl, c, _: (DenseGeneral(features=16, parent=mdl)(c), None),
                variable_broadcast=["params", "fp8_meta"],
                variable_axes={"fp8_probe": 0},
                split_rngs={"params": False},
                length=3,
            )
            return body(self, x, None)[0]

    model, x = Shared(), rand((4, 16), 0)
    variables = _init(model, x)
    with pytest.raises(ValueError, match=r"fp8_meta.*broadcast"):
        _grad_all(model, variables, x)
    # fp8jax's own step is unaffected: it never differentiates fp8_meta
    grads = jax.grad(
        lambda p, q: _loss(model.apply, {**variables, "params": p, "fp8_probe": q}, x, 0.0),
        argnums=(0, 1),
    )(variables["params"], variables["fp8_probe"])
    assert jax.tree.leaves(grads[1])[0].shape == (3, 3)


def test_fp8jax_step_traces_no_per_module_update():
    """When fp8_meta is not differentiated the link adds nothing: one update launch per step."""
    model, x = _Net(), rand((4, 5, 16), 0)
    variables = _init(model, x)
    ours = Fp8TrainState.from_variables(
        apply_fn=model.apply, variables=variables, tx=optax.sgd(0.1), recipe=RECIPE
    )
    hlo = _fp8jax_step.lower(ours, x, rand((4, 2), 1)).as_text()
    assert hlo.count("fp8jax_update_fp8_state") == 1
