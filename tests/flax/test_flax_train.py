"""fp8jax.flax.train: the FP8 state outside the optimizer, merged by max, and a hand oracle.

Each "merge by max" test also computes what summing the observations (what autodiff does when
one probe, or one FP8 state input, is shared by several uses: the Flax fp8_ops / TE behaviour)
would give, and checks that it is a different value.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _shared import rand
from flax.training import train_state

import fp8jax
from fp8jax import DelayedScaling, Float8CurrentScaling
from fp8jax.flax import (
    DenseGeneral,
    Fp8TrainState,
    accumulate_gradients,
    update_fp8_variables,
    zero_probes,
)

pytestmark = pytest.mark.usefixtures("float32_matmuls")

RECIPE = DelayedScaling(amax_history_len=4)
E4M3_MAX, E5M2_MAX = 448.0, 57344.0


def _init(model, *args, recipe=RECIPE):
    with fp8jax.autocast(enabled=True, recipe=recipe):
        return model.init(jax.random.key(0), *args)


def _loss_fn(model, recipe=RECIPE):
    """loss(params, probes, fp8_meta, x, y) = mean((model(x) - y)**2)."""

    def loss(params, probes, fp8_meta, x, y):
        variables = {"params": params, "fp8_meta": fp8_meta, "fp8_probe": probes}
        with fp8jax.autocast(enabled=True, recipe=recipe):
            out = model.apply(variables, x)
        return jnp.mean((out - y) ** 2)

    return loss


def _the(tree):
    (leaf,) = jax.tree.leaves(tree)
    return leaf


# ------------------------------------------------------------------------ state vs optimizer


def test_fp8_state_is_outside_params_and_optimizer():
    model = DenseGeneral(features=4)
    x, y = rand((8, 16), 0, 0.5), rand((8, 4), 1)
    variables = _init(model, x)
    assert set(variables["params"]) == {"kernel", "bias"}
    tx = optax.chain(optax.clip_by_global_norm(0.01), optax.adam(1e-2))
    state = Fp8TrainState.from_variables(
        apply_fn=model.apply, variables=variables, tx=tx, recipe=RECIPE
    )
    plain = train_state.TrainState.create(apply_fn=model.apply, params=variables["params"], tx=tx)
    # Adam's state has exactly the params' structure: no entry for fp8_meta / fp8_probe
    assert jax.tree.structure(state.opt_state) == jax.tree.structure(plain.opt_state)
    mu = state.opt_state[1][0].mu
    assert jax.tree.structure(mu) == jax.tree.structure(variables["params"])

    loss = _loss_fn(model)
    grads, probe_grads = jax.grad(loss, argnums=(0, 1))(
        state.params, state.fp8_probe, state.fp8_meta, x, y
    )
    # a global norm that saw the probe gradients (the amaxes) would be another norm
    with_probes = optax.tree.norm((grads, probe_grads))
    assert float(with_probes) > 1.01 * float(optax.tree.norm(grads))
    new = state.apply_gradients(grads=grads, probe_grads=probe_grads, recipe=RECIPE)
    ref = plain.apply_gradients(grads=grads)  # clipping and Adam on params alone
    jax.tree.map(np.testing.assert_array_equal, new.params, ref.params)
    jax.tree.map(np.testing.assert_array_equal, new.opt_state, ref.opt_state)
    assert int(new.step) == 1
    assert float(new.fp8_meta["amax_history"][0, 0]) == float(jnp.max(jnp.abs(x)))
    jax.tree.map(np.testing.assert_array_equal, new.fp8_probe, zero_probes(new.fp8_probe))
    with pytest.raises(ValueError, match="gradient of the params only"):
        state.apply_gradients(grads={"params": grads, "fp8_probe": probe_grads},
                              probe_grads=probe_grads, recipe=RECIPE)  # fmt: skip


def test_one_state_update_launch_for_the_whole_model():
    class MLP(nn.Module):
        @nn.compact
        def __call__(self, x):
            for width in (32, 16, 8):
                x = DenseGeneral(features=width)(x)
            return x

    model = MLP()
    x, y = rand((8, 16), 2), rand((8, 8), 3)
    variables = _init(model, x)
    state = Fp8TrainState.from_variables(
        apply_fn=model.apply, variables=variables, tx=optax.sgd(0.1), recipe=RECIPE
    )

    def step(state, x, y):
        loss = _loss_fn(model)
        grads, probe_grads = jax.grad(loss, argnums=(0, 1))(
            state.params, state.fp8_probe, state.fp8_meta, x, y
        )
        return state.apply_gradients(grads=grads, probe_grads=probe_grads, recipe=RECIPE)

    hlo = jax.jit(step).lower(state, x, y).as_text()
    assert hlo.count("fp8jax_update_fp8_state") == 1


# ------------------------------------------------------------------------ merge by max


def test_layer_applied_twice_merges_by_max():
    class Twice(nn.Module):
        @nn.compact
        def __call__(self, x):
            layer = DenseGeneral(features=16)
            return layer(layer(x) * 4.0)  # the second call sees a different input

    model = Twice()
    x, y = rand((8, 16), 4), rand((8, 16), 5)
    variables = _init(model, x)
    loss = _loss_fn(model)
    probe_grads = jax.grad(loss, argnums=1)(
        variables["params"], variables["fp8_probe"], variables["fp8_meta"], x, y
    )
    new = update_fp8_variables(variables["fp8_meta"], probe_grads, RECIPE)
    first = probe_grads["DenseGeneral_0"]["call_0"]
    second = probe_grads["DenseGeneral_0"]["call_1"]
    # the hand values of each call: input amax, kernel amax (same both times)
    kernel_amax = jnp.max(jnp.abs(variables["params"]["DenseGeneral_0"]["kernel"]))
    np.testing.assert_array_equal(first[0], jnp.max(jnp.abs(x)))
    np.testing.assert_array_equal(first[1], kernel_amax)
    np.testing.assert_array_equal(second[1], kernel_amax)
    newest = new["DenseGeneral_0"]["amax_history"][:, 0]
    np.testing.assert_array_equal(newest, jnp.maximum(first, second))
    summed = first + second  # what one probe shared by both calls would report
    assert bool(jnp.all(newest < summed))
    np.testing.assert_array_equal(newest[1], kernel_amax)  # not 2 * kernel_amax


def test_scan_over_layers_keeps_one_state_per_layer():
    class Layer(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            return DenseGeneral(features=16)(x) * 3.0, x  # ys: each layer's input

    class Stack(nn.Module):
        @nn.compact
        def __call__(self, x):
            scanned = nn.scan(
                Layer,
                variable_axes={"params": 0, "fp8_meta": 0, "fp8_probe": 0},
                split_rngs={"params": True},
                length=3,
            )
            return scanned(name="layers")(x, None)

    model = Stack()
    x, target = rand((8, 16), 6), rand((8, 16), 7)
    variables = _init(model, x)

    def loss(probes):
        v = {**variables, "fp8_probe": probes}
        with fp8jax.autocast(enabled=True, recipe=RECIPE):
            out, inputs = model.apply(v, x)
        return jnp.mean((out - target) ** 2), inputs

    probe_grads, inputs = jax.grad(loss, has_aux=True)(variables["fp8_probe"])
    new = update_fp8_variables(variables["fp8_meta"], probe_grads, RECIPE)
    hist = new["layers"]["DenseGeneral_0"]["amax_history"]
    per_layer_input = jnp.max(jnp.abs(inputs), axis=(1, 2))
    per_layer_kernel = jnp.max(
        jnp.abs(variables["params"]["layers"]["DenseGeneral_0"]["kernel"]), axis=(1, 2)
    )
    np.testing.assert_array_equal(hist[:, 0, 0], per_layer_input)
    np.testing.assert_array_equal(hist[:, 1, 0], per_layer_kernel)
    assert bool(jnp.all(hist[:, 2, 0] > 0))
    # a state shared over the scan (broadcast) would see the sum over layers: a wrong value
    assert bool(jnp.all(jnp.sum(per_layer_input) > hist[:, 0, 0]))
    assert bool(jnp.all(hist[1:, 0, 0] != hist[:-1, 0, 0]))  # really per layer


def test_scan_with_broadcast_state_reduces_the_step_axis():
    """One layer (broadcast params and state) applied at every step of a scan, like an RNN."""

    class Step(nn.Module):
        @nn.compact
        def __call__(self, h, _):
            h = DenseGeneral(features=16)(h) * 2.0
            return h, h

    class Rnn(nn.Module):
        @nn.compact
        def __call__(self, h):
            scanned = nn.scan(
                Step,
                variable_broadcast=["params", "fp8_meta"],
                variable_axes={"fp8_probe": 0},
                split_rngs={"params": False},
                length=3,
            )
            return scanned(name="rnn")(h, None)

    model = Rnn()
    h = rand((4, 16), 8)
    variables = _init(model, h)
    assert _the(variables["fp8_probe"]).shape == (3, 3)  # one probe per step
    assert variables["fp8_meta"]["rnn"]["DenseGeneral_0"]["scale"].shape == (3,)

    def loss(probes):
        with fp8jax.autocast(enabled=True, recipe=RECIPE):
            out, hs = model.apply({**variables, "fp8_probe": probes}, h)
        return jnp.sum(out), hs

    probe_grads, hs = jax.grad(loss, has_aux=True)(variables["fp8_probe"])
    per_step = _the(probe_grads)
    new = update_fp8_variables(variables["fp8_meta"], probe_grads, RECIPE)
    newest = new["rnn"]["DenseGeneral_0"]["amax_history"][:, 0]
    np.testing.assert_array_equal(newest, jnp.max(per_step, axis=0))
    inputs = jnp.concatenate([h[None], hs[:-1]])
    np.testing.assert_array_equal(newest[0], jnp.max(jnp.abs(inputs)))
    assert float(jnp.sum(per_step[:, 0])) > float(newest[0])  # the sum would be wrong


def test_scan_with_broadcast_probes_says_to_give_them_an_axis():
    """Probes broadcast over nn.scan would be shared by every step (their observations summed):
    refused at apply with what to write instead."""

    class Shared(nn.Module):
        @nn.compact
        def __call__(self, h):
            body = nn.scan(
                lambda mdl, c, _: (DenseGeneral(features=16, parent=mdl)(c), None),
                variable_broadcast=["params", "fp8_meta", "fp8_probe"],
                split_rngs={"params": False},
                length=3,
            )
            return body(self, h, None)[0]

    model, h = Shared(), rand((4, 16), 8)
    variables = _init(model, h)
    with (
        fp8jax.autocast(enabled=True, recipe=RECIPE),
        pytest.raises(ValueError, match=r"'fp8_probe' is broadcast.*variable_axes=\{'fp8_probe'"),
    ):
        model.apply(variables, h)


def test_gradient_accumulation_merges_micro_batches_by_max():
    model = DenseGeneral(features=4)
    xs = jnp.stack([rand((8, 16), 9, 1.0), rand((8, 16), 10, 7.0)])
    ys = jnp.stack([rand((8, 4), 11), rand((8, 4), 12)])
    variables = _init(model, xs[0])
    params, probes, meta = variables["params"], variables["fp8_probe"], variables["fp8_meta"]
    loss = _loss_fn(model)

    def grad_fn(params, probes, batch):
        x, y = batch
        return jax.value_and_grad(loss, argnums=(0, 1))(params, probes, meta, x, y)

    total, (grads, probe_grads) = jax.jit(lambda p, q, b: accumulate_gradients(grad_fn, p, q, b))(
        params, probes, (xs, ys)
    )
    parts = [grad_fn(params, probes, (xs[i], ys[i])) for i in range(2)]
    np.testing.assert_allclose(total, (parts[0][0] + parts[1][0]) / 2, rtol=1e-6)
    mean_grads = jax.tree.map(lambda a, b: (a + b) / 2, parts[0][1][0], parts[1][1][0])
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), grads, mean_grads)
    obs = [p[1][1]["call_0"] for p in parts]
    np.testing.assert_array_equal(probe_grads["call_0"], jnp.maximum(obs[0], obs[1]))
    np.testing.assert_array_equal(probe_grads["call_0"][0], jnp.max(jnp.abs(xs)))
    # differentiating the summed loss of both micro-batches adds the observations: wrong
    naive = jax.grad(
        lambda q: loss(params, q, meta, xs[0], ys[0]) + loss(params, q, meta, xs[1], ys[1])
    )(probes)
    np.testing.assert_allclose(naive["call_0"], obs[0] + obs[1], rtol=1e-6)
    assert bool(jnp.all(naive["call_0"] > probe_grads["call_0"]))
    summed = accumulate_gradients(grad_fn, params, probes, (xs, ys), reduce="sum")
    np.testing.assert_allclose(summed[0], parts[0][0] + parts[1][0], rtol=1e-6)
    with pytest.raises(ValueError, match="reduce must be"):
        accumulate_gradients(grad_fn, params, probes, (xs, ys), reduce="max")
    with pytest.raises(ValueError, match="same leading"):
        accumulate_gradients(grad_fn, params, probes, (xs, ys[:1]))


# ------------------------------------------------------------------------ 5-step oracle


def _oracle_update(hist, scale, amax, fp8_max):
    """numpy: roll amax in at index 0, reduce by max, scale = fp8_max / max (kept if 0)."""
    hist = np.concatenate([np.float32([amax]), hist[:-1]]).astype(np.float32)
    red = np.float32(hist.max())
    new_scale = np.float32(np.float32(fp8_max) / red) if red > 0 else scale
    return hist, np.float32(new_scale)


def test_five_jitted_steps_match_a_hand_oracle():
    model = DenseGeneral(features=8)
    recipe = DelayedScaling(amax_history_len=4)
    batches = [(rand((16, 32), 20 + i, s), rand((16, 8), 40 + i)) for i, s in
               enumerate((1.0, 4.0, 0.5, 2.0, 0.25))]  # fmt: skip
    variables = _init(model, batches[0][0], recipe=recipe)
    state = Fp8TrainState.from_variables(
        apply_fn=model.apply, variables=variables, tx=optax.sgd(0.05), recipe=recipe
    )
    loss = _loss_fn(model, recipe)

    @jax.jit
    def train_step(state, x, y):
        value, (grads, probe_grads) = jax.value_and_grad(loss, argnums=(0, 1))(
            state.params, state.fp8_probe, state.fp8_meta, x, y
        )
        return state.apply_gradients(grads=grads, probe_grads=probe_grads, recipe=recipe), value

    hist = np.zeros((3, 4), np.float32)
    scale = np.ones(3, np.float32)
    maxes = (E4M3_MAX, E4M3_MAX, E5M2_MAX)
    for x, y in batches:
        # the actual tensors of this step: its input, the kernel it uses, its output gradient
        with fp8jax.autocast(enabled=True, recipe=recipe):
            out = model.apply(state.variables(), x)
        g = jax.grad(lambda o, y: jnp.mean((o - y) ** 2))(out, y)
        amaxes = [np.max(np.abs(x)), np.max(np.abs(state.params["kernel"])), np.max(np.abs(g))]
        for r in range(3):
            hist[r], scale[r] = _oracle_update(hist[r], scale[r], amaxes[r], maxes[r])
        state, _ = train_step(state, x, y)
    np.testing.assert_array_equal(state.fp8_meta["amax_history"], hist)
    np.testing.assert_array_equal(state.fp8_meta["scale"], scale)
    assert int(state.step) == 5
    # the input row saw 4.0-scaled data in step 2: still in the 4-long history after step 5
    assert hist[0].max() == np.max(np.abs(batches[1][0]))


# ------------------------------------------------------------------------ jit and recipes


def test_jitted_step_retraces_when_the_recipe_changes():
    model = DenseGeneral(features=4)
    x, y = rand((8, 16), 13), rand((8, 4), 14)
    variables = _init(model, x)
    state = Fp8TrainState.from_variables(
        apply_fn=model.apply, variables=variables, tx=optax.sgd(0.1), recipe=RECIPE
    )
    traces = []

    @jax.jit
    def step(state, x, y):
        traces.append(1)
        recipe = fp8jax.get_recipe()  # read while tracing: autocast is in jit's cache key
        loss = _loss_fn(model, recipe)
        _, probe_grads = jax.grad(loss, argnums=(0, 1))(
            state.params, state.fp8_probe, state.fp8_meta, x, y
        )
        return state.replace(fp8_meta=update_fp8_variables(state.fp8_meta, probe_grads, recipe))

    r0, r1 = DelayedScaling(amax_history_len=4), DelayedScaling(amax_history_len=4, margin=1)
    with fp8jax.autocast(enabled=True, recipe=r0):
        s0 = step(state, x, y)
        step(state, x, y)
    assert len(traces) == 1
    with fp8jax.autocast(enabled=True, recipe=r1):
        s1 = step(state, x, y)
    assert len(traces) == 2
    np.testing.assert_array_equal(s1.fp8_meta["scale"], s0.fp8_meta["scale"] / 2)
    with fp8jax.autocast(enabled=True, recipe=r0):
        step(state, x, y)
    assert len(traces) == 2  # the first trace is reused


# ------------------------------------------------------------------------ helpers and errors


def test_current_scaling_has_no_state_to_update():
    model = DenseGeneral(features=4)
    x, y = rand((8, 16), 15), rand((8, 4), 16)
    recipe = Float8CurrentScaling()
    variables = _init(model, x, recipe=recipe)
    state = Fp8TrainState.from_variables(
        apply_fn=model.apply, variables=variables, tx=optax.sgd(0.1), recipe=recipe
    )
    assert state.fp8_meta == {} and state.fp8_probe == {}
    loss = _loss_fn(model, recipe)
    grads, probe_grads = jax.grad(loss, argnums=(0, 1))(
        state.params, state.fp8_probe, state.fp8_meta, x, y
    )
    new = state.apply_gradients(grads=grads, probe_grads=probe_grads, recipe=recipe)
    assert new.fp8_meta == {} and int(new.step) == 1


def test_helpers_and_errors():
    model = DenseGeneral(features=4)
    x = rand((8, 16), 17)
    variables = _init(model, x)
    probes = jax.tree.map(lambda p: p + 1.0, variables["fp8_probe"])
    zeros = zero_probes(probes)
    assert jax.tree.structure(zeros) == jax.tree.structure(probes)
    assert all(float(jnp.max(jnp.abs(z))) == 0 for z in jax.tree.leaves(zeros))
    meta = variables["fp8_meta"]
    with pytest.raises(ValueError, match="no probe gradients"):
        update_fp8_variables(meta, {}, RECIPE)
    with pytest.raises(TypeError, match="must be a DelayedScaling"):
        update_fp8_variables(meta, variables["fp8_probe"], Float8CurrentScaling())
    with pytest.raises(ValueError, match="have shape"):
        update_fp8_variables(meta, {"call_0": jnp.zeros(4)}, RECIPE)
    with pytest.raises(ValueError, match="unexpected collections"):
        Fp8TrainState.from_variables(
            apply_fn=model.apply, variables={**variables, "batch_stats": {}}, tx=optax.sgd(0.1),
            recipe=RECIPE,
        )  # fmt: skip
    with pytest.raises(ValueError, match="must hold 'params'"):
        Fp8TrainState.from_variables(
            apply_fn=model.apply, variables={}, tx=optax.sgd(0.1), recipe=RECIPE
        )
