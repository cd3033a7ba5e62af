"""fp8jax.nnx.train: the NNX train step trains bit for bit as the Linen one, observations merge
by max (a module called twice, stacked layers, micro-batches), one update launch per step,
non-finite steps skipped whole, calibration as Linen's; errors."""

from __future__ import annotations

import collections
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _nnx import RECIPE, TRANSFORMER, assert_trees_equal, float32_matmuls  # noqa: F401
from _shared import rand
from flax import nnx

import fp8jax
from fp8jax import DelayedScaling
from fp8jax import flax as fflax
from fp8jax import nnx as fnnx
from fp8jax.nnx.variables import pure


def _build(make):
    with fp8jax.autocast(enabled=True, recipe=RECIPE):
        return make()


def _nnx_step(loss_of, *, skip=False):
    @nnx.jit
    def step(model, optimizer, x, y):
        with fp8jax.autocast(enabled=True, recipe=RECIPE):
            loss, grads = nnx.value_and_grad(lambda m: loss_of(m, x, y), argnums=fnnx.diff_state())(
                model
            )
        fnnx.apply_gradients(model, optimizer, grads, skip_if_nonfinite=skip)
        return loss

    return step


def _mse(model, x, y, **kw):
    return jnp.mean((model(x, **kw) - y) ** 2)


# fp8_dpa: FP8 attention (its state in the attention's "attention" child), no relative bias
FP8_DPA = dict(fp8_dpa=True, enable_relative_embedding=False)


@pytest.mark.parametrize("extra", [{}, FP8_DPA], ids=["", "fp8_dpa"])
def test_five_steps_bit_identical_to_linen(extra):
    cfg = dict(TRANSFORMER, **extra)
    model = _build(lambda: fnnx.TransformerLayer(**cfg, rngs=nnx.Rngs(0)))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    x, y = rand((2, 4, 16), 1), rand((2, 4, 16), 2)
    state = fflax.Fp8TrainState.from_model(
        fflax.TransformerLayer(**cfg), nnx.Rngs(0).params(), x, tx=optax.adam(1e-2),
        recipe=RECIPE, deterministic=True,
    )  # fmt: skip
    if extra:  # the attention's 15 FP8 roles, where Linen keeps them
        assert state.fp8_meta["attention"]["attention"]["scale"].shape == (15,)

    @jax.jit
    def linen_step(state, x, y):
        def f(params, probes):
            out = state.apply(state.variables(params, probes), x, deterministic=True)
            return jnp.mean((out - y) ** 2)

        loss, (g, pg) = jax.value_and_grad(f, argnums=(0, 1))(state.params, state.fp8_probe)
        return state.apply_gradients(grads=g, probe_grads=pg), loss

    step = _nnx_step(lambda m, x, y: _mse(m, x, y, deterministic=True))
    for _ in range(5):
        loss = step(model, optimizer, x, y)
        state, want = linen_step(state, x, y)
        assert float(loss) == float(want)
    variables = model.linen_variables()
    assert_trees_equal(variables["params"], state.params)
    assert_trees_equal(variables["fp8_meta"], state.fp8_meta)
    assert int(optimizer.step[...]) == 5
    # the optimizer holds moments of the params only
    n_params = len(jax.tree.leaves(pure(model, nnx.Param)))
    assert len(jax.tree.leaves(pure(optimizer))) == 2 * n_params + 2  # mu, nu, count, step


def test_compiled_step_has_the_linen_steps_kernels():
    """The NNX step runs the same FP8 kernels as the Linen one (the probe forks are
    identities: no extra launch); per custom-call target, in the compiled CPU program."""
    model = _build(lambda: fnnx.TransformerLayer(**TRANSFORMER, rngs=nnx.Rngs(0)))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    graphdef, nnx_state = nnx.split((model, optimizer))
    x, y = rand((2, 4, 16), 24), rand((2, 4, 16), 25)

    def nnx_step(state, x, y):
        model, optimizer = nnx.merge(graphdef, state)
        with fp8jax.autocast(enabled=True, recipe=RECIPE):
            grads = nnx.grad(
                lambda m: _mse(m, x, y, deterministic=True), argnums=fnnx.diff_state()
            )(model)
        fnnx.apply_gradients(model, optimizer, grads)
        return nnx.state((model, optimizer))

    linen_state = fflax.Fp8TrainState.from_variables(
        apply_fn=fflax.linen_twin(model).apply, variables=model.linen_variables(),
        tx=optax.sgd(0.1), recipe=RECIPE,
    )  # fmt: skip

    def linen_step(state, x, y):
        def f(params, probes):
            out = state.apply(state.variables(params, probes), x, deterministic=True)
            return jnp.mean((out - y) ** 2)

        g, pg = jax.grad(f, argnums=(0, 1))(state.params, state.fp8_probe)
        return state.apply_gradients(grads=g, probe_grads=pg)

    def kernels(step, state):
        hlo = jax.jit(step).lower(state, x, y).compile().as_text()
        targets = re.findall(r'custom_call_target="(fp8jax_\w+)"', hlo)
        return collections.Counter(targets)

    want = kernels(linen_step, linen_state)
    assert want["fp8jax_update_fp8_state"] == 1 and len(want) > 3
    assert kernels(nnx_step, nnx_state) == want, want


def test_module_called_twice_merges_by_max_as_linen():
    class Twice(nnx.Module):
        def __init__(self, rngs):
            self.layer = fnnx.DenseGeneral(16, 16, rngs=rngs)

        def __call__(self, x):
            return self.layer(self.layer(x) * 4.0)

    class LinenTwice(nn.Module):
        @nn.compact
        def __call__(self, x):
            layer = fflax.DenseGeneral(features=16, name="layer")
            return layer(layer(x) * 4.0)

    model = _build(lambda: Twice(nnx.Rngs(0)))
    x, y = rand((8, 16), 3), rand((8, 16), 4)
    with fp8jax.autocast(enabled=True, recipe=RECIPE):
        grads = nnx.grad(lambda m: _mse(m, x, y), argnums=fnnx.diff_state())(model)
    observed = grads["layer"]["fp8_probe"]["call_0"][...]
    kernel_amax = jnp.max(jnp.abs(model.layer.kernel[...]))
    with fp8jax.autocast(enabled=True, recipe=RECIPE):
        first_out = jnp.max(jnp.abs(model.layer(x) * 4.0))  # the second call's input
    np.testing.assert_array_equal(observed[0], jnp.maximum(jnp.max(jnp.abs(x)), first_out))
    np.testing.assert_array_equal(observed[1], kernel_amax)  # not 2 * kernel_amax
    fnnx.update_fp8_variables(model, grads)

    state = fflax.Fp8TrainState.from_variables(
        apply_fn=LinenTwice().apply,
        variables={"params": {"layer": nn.unbox(model.layer.linen_variables()["params"])},
                   **_init_linen(LinenTwice(), x)},
        tx=optax.sgd(0.1), recipe=RECIPE,
    )  # fmt: skip

    def f(probes):
        return jnp.mean((state.apply(state.variables(None, probes), x) - y) ** 2)

    pg = jax.grad(f)(state.fp8_probe)
    want = fflax.update_fp8_variables(state.fp8_meta, pg, RECIPE)
    assert_trees_equal(model.layer.linen_variables()["fp8_meta"], want["layer"])


def _init_linen(model, x):
    with fp8jax.autocast(enabled=True, recipe=RECIPE):
        variables = model.init(jax.random.key(0), x)
    return {k: v for k, v in variables.items() if k != "params"}


class _Stack(nnx.Module):
    """3 DenseGeneral layers made by nnx.vmap and applied by nnx.scan."""

    def __init__(self, rngs):
        @nnx.split_rngs(splits=3)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return fnnx.DenseGeneral(16, 16, rngs=rngs)

        self.layers = make(rngs)

    def __call__(self, x):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0))
        def body(x, layer):
            return layer(x) * 3.0, x

        return body(x, self.layers)


def test_stacked_layers_keep_one_state_row_per_layer():
    model = _build(lambda: _Stack(nnx.Rngs(0)))
    assert model.layers.fp8_meta.amax_history.shape == (3, 3, 4)
    x, y = rand((8, 16), 5), rand((8, 16), 6)

    def loss(m):
        out, inputs = m(x)
        return jnp.mean((out - y) ** 2), inputs

    with fp8jax.autocast(enabled=True, recipe=RECIPE):
        (_, inputs), grads = nnx.value_and_grad(loss, argnums=fnnx.diff_state(), has_aux=True)(
            model
        )
    fnnx.update_fp8_variables(model, grads)
    hist = model.layers.fp8_meta.amax_history[...]
    per_layer_input = jnp.max(jnp.abs(inputs), axis=(1, 2))
    per_layer_kernel = jnp.max(jnp.abs(model.layers.kernel[...]), axis=(1, 2))
    np.testing.assert_array_equal(hist[:, 0, 0], per_layer_input)
    np.testing.assert_array_equal(hist[:, 1, 0], per_layer_kernel)
    assert bool(jnp.all(hist[:, 2, 0] > 0))
    assert bool(jnp.all(hist[1:, 0, 0] != hist[:-1, 0, 0]))  # really per layer


def test_one_module_at_every_scan_step_carries_its_probes():
    """A module broadcast over an nnx.scan (the same weights at every step) must carry its
    probes (StateAxes {Fp8Probe: Carry}); then its observation is the max over the steps, as
    the unrolled loop's. Broadcast probes are summed by autodiff (shown here), which no
    trace-time signal reveals: the update turns that module's state non-finite instead."""
    x = rand((4, 8), 23)

    def step(axes):
        """(probe gradient, scale after update_fp8_variables) of one train step."""
        layer = _build(lambda: fnnx.DenseGeneral(8, 8, rngs=nnx.Rngs(0)))

        def loss(m):
            if axes is None:  # unrolled
                h = x
                for _ in range(3):
                    h = m(h) * 2.0
            else:
                h = nnx.scan(lambda h, m: m(h) * 2.0, in_axes=(nnx.Carry, axes),
                             out_axes=nnx.Carry, length=3)(x, m)  # fmt: skip
            return jnp.mean(h**2)

        with fp8jax.autocast(enabled=True, recipe=RECIPE):
            grads = nnx.grad(loss, argnums=fnnx.diff_state())(layer)
        observed = np.asarray(grads["fp8_probe"]["call_0"][...])
        fnnx.update_fp8_variables(layer, grads)
        assert not np.any(np.asarray(layer.fp8_probe.call_0[...]))  # counts reset
        return observed, np.asarray(layer.fp8_meta.scale[...])

    unrolled, unrolled_scale = step(None)
    carried, carried_scale = step(nnx.StateAxes({fnnx.Fp8Probe: nnx.Carry, ...: None}))
    np.testing.assert_array_equal(carried, unrolled)
    np.testing.assert_array_equal(carried_scale, unrolled_scale)
    assert np.all(np.isfinite(unrolled_scale)) and np.all(unrolled_scale != 1.0)
    summed, summed_scale = step(nnx.StateAxes({...: None}))
    np.testing.assert_allclose(summed[1], 3 * unrolled[1], rtol=1e-6)  # the pitfall
    assert np.all(np.isnan(summed_scale))  # ... is not trained on silently


def test_remat_with_saved_fp8_operands_gives_the_same_gradients():
    model = _build(lambda: fnnx.TransformerLayer(**TRANSFORMER, rngs=nnx.Rngs(0)))
    x = rand((2, 4, 16), 22)

    def grads(remat):
        def loss(m):
            f = lambda m, x: m(x, deterministic=True)
            if remat:
                f = nnx.remat(f, policy=fp8jax.save_fp8_operands)
            return jnp.mean(f(m, x) ** 2)

        with fp8jax.autocast(enabled=True, recipe=RECIPE):
            return nnx.to_pure_dict(
                nnx.jit(lambda m: nnx.grad(loss, argnums=fnnx.diff_state())(m))(model)
            )

    assert_trees_equal(grads(True), grads(False))


def test_one_update_launch_for_the_whole_model():
    model = _build(lambda: _Stack(nnx.Rngs(0)))
    optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    graphdef, state = nnx.split((model, optimizer))
    x, y = rand((8, 16), 7), rand((8, 16), 8)

    def step(state, x, y):
        model, optimizer = nnx.merge(graphdef, state)
        with fp8jax.autocast(enabled=True, recipe=RECIPE):
            grads = nnx.grad(lambda m: jnp.mean((m(x)[0] - y) ** 2), argnums=fnnx.diff_state())(
                model
            )
        fnnx.apply_gradients(model, optimizer, grads)
        return nnx.state((model, optimizer))

    hlo = jax.jit(step).lower(state, x, y).as_text()
    assert hlo.count("fp8jax_update_fp8_state") == 1


def test_gradient_accumulation_merges_micro_batches_by_max():
    model = _build(lambda: fnnx.DenseGeneral(16, 8, rngs=nnx.Rngs(0)))
    xs = jnp.stack([rand((4, 16), 9, 1.0), rand((4, 16), 10, 5.0), rand((4, 16), 11, 2.0)])
    ys = jnp.stack([rand((4, 8), 12), rand((4, 8), 13), rand((4, 8), 14)])

    def grad_fn(m, batch):
        x, y = batch
        with fp8jax.autocast(enabled=True, recipe=RECIPE):
            return nnx.value_and_grad(lambda m: _mse(m, x, y), argnums=fnnx.diff_state())(m)

    loss, grads = nnx.jit(lambda m, b: fnnx.accumulate_gradients(grad_fn, m, b))(model, (xs, ys))
    singles = [grad_fn(model, (xs[i], ys[i])) for i in range(3)]
    np.testing.assert_allclose(loss, np.mean([float(s[0]) for s in singles]), rtol=1e-6)
    np.testing.assert_allclose(
        grads["kernel"][...], np.mean([s[1]["kernel"][...] for s in singles], axis=0),
        rtol=1e-5, atol=1e-6,
    )  # fmt: skip
    probes = [s[1]["fp8_probe"]["call_0"][...] for s in singles]
    np.testing.assert_array_equal(grads["fp8_probe"]["call_0"][...], np.max(probes, axis=0))
    assert float(grads["fp8_probe"]["call_0"][0]) == float(jnp.max(jnp.abs(xs)))
    _, summed = fnnx.accumulate_gradients(grad_fn, model, (xs, ys), reduce="sum")
    np.testing.assert_allclose(
        summed["kernel"][...], 3 * grads["kernel"][...], rtol=1e-5, atol=1e-6
    )
    with pytest.raises(ValueError, match="reduce must be 'mean' or 'sum'"):
        fnnx.accumulate_gradients(grad_fn, model, (xs, ys), reduce="max")
    with pytest.raises(ValueError, match="same leading"):
        fnnx.accumulate_gradients(grad_fn, model, (xs, ys[:2]))


def test_nonfinite_step_is_skipped_whole():
    model = _build(lambda: fnnx.DenseGeneral(16, 8, rngs=nnx.Rngs(0)))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    step = _nnx_step(_mse, skip=True)
    x, y = rand((4, 16), 15), rand((4, 8), 16)
    step(model, optimizer, x, y)
    before = (pure(model), pure(optimizer))
    loss = step(model, optimizer, x.at[0, 0].set(jnp.nan), y)
    assert not np.isfinite(float(loss))
    assert_trees_equal((pure(model), pure(optimizer)), before)
    step(model, optimizer, x, y)
    assert int(optimizer.step[...]) == 2
    assert not np.array_equal(model.kernel[...], before[0]["kernel"])
    with pytest.raises(TypeError, match="skip_if_nonfinite must be a bool"):
        fnnx.apply_gradients(model, optimizer, nnx.State({}), skip_if_nonfinite=1)


def test_eval_step_changes_nothing():
    model = _build(lambda: fnnx.TransformerLayer(**TRANSFORMER, rngs=nnx.Rngs(0)))
    model.eval()
    arrays = nnx.Any(nnx.Param, fnnx.Fp8MetaVariable, fnnx.Fp8Probe)  # (not the RNG keys)
    before = pure(model, arrays)

    @nnx.jit
    def evaluate(model, x):
        with fp8jax.autocast(enabled=True, recipe=RECIPE):
            return model(x)

    x = rand((2, 4, 16), 21)
    with fp8jax.autocast(enabled=True, recipe=RECIPE):
        want = model(x)
    assert_trees_equal(evaluate(model, x), want)
    assert_trees_equal(pure(model, arrays), before)


def test_calibrate_matches_linen():
    model = _build(lambda: fnnx.LayerNormMLP(8, intermediate_dim=16, rngs=nnx.Rngs(0)))
    model.eval()
    batches = [rand((4, 8), 17, 300.0), rand((4, 8), 18, 900.0)]
    variables = model.linen_variables()
    want = fflax.calibrate(
        fflax.linen_twin(model).apply, variables, batches, recipe=RECIPE, deterministic=True
    )
    fnnx.calibrate(model, batches)
    assert_trees_equal(model.linen_variables()["fp8_meta"], want)
    assert not np.any(pure(model, fnnx.Fp8Probe)["fp8_probe"]["call_0"])  # reset to zeros
    assert float(model.fp8_meta.scale[2]) == 1.0  # output-grad role left as it was


def test_errors():
    model = _build(lambda: fnnx.DenseGeneral(16, 8, rngs=nnx.Rngs(0)))
    x, y = rand((4, 16), 19), rand((4, 8), 20)
    with (
        fp8jax.autocast(enabled=True, recipe=RECIPE),
        pytest.raises(ValueError, match=r"fp8jax\.nnx\.diff_state"),
    ):
        nnx.grad(lambda m: _mse(m, x, y))(model)  # params only: observations dropped
    with pytest.raises(ValueError, match="outside FP8 DelayedScaling"):  # autocast forgotten
        nnx.grad(lambda m: _mse(m, x, y), argnums=fnnx.diff_state())(model)
    with fp8jax.autocast(enabled=False), pytest.raises(ValueError, match="would go stale"):
        nnx.grad(lambda m: _mse(m, x, y), argnums=fnnx.diff_state())(model)
    grads = nnx.grad(lambda m: _mse(m, x, y))(model)  # FP32, params only: fine
    assert set(nnx.to_pure_dict(grads)) == {"kernel", "bias"}
    with pytest.raises(TypeError, match=r"must be the nnx\.State"):
        fnnx.update_fp8_variables(model, {"kernel": 1})
    with pytest.raises(ValueError, match="no Fp8Probe entries"):
        fnnx.update_fp8_variables(model, nnx.State({}))
    with fp8jax.autocast(enabled=True, recipe=DelayedScaling(amax_history_len=8)):
        other = fnnx.DenseGeneral(16, 8, rngs=nnx.Rngs(0))

    class Both(nnx.Module):
        def __init__(self):
            self.a, self.b = model, other

    with pytest.raises(ValueError, match="different recipes"):
        fnnx.model_recipe(Both())
    assert fnnx.model_recipe(model) == RECIPE
    assert fnnx.model_recipe(fnnx.DenseGeneral(16, 8, rngs=nnx.Rngs(0))) is None
    with pytest.raises(ValueError, match="has no FP8 state"):
        fnnx.calibrate(fnnx.DenseGeneral(16, 8, rngs=nnx.Rngs(0)), [x])
    with pytest.raises(ValueError, match="batches is empty"):
        fnnx.calibrate(model, [])


def test_differentiating_fp8_meta_is_refused():
    """TE's convention (the state's gradient as the next state) is Linen's only: in NNX each
    call is its own apply, so differentiating Fp8MetaVariable is an error that says what to do."""
    layer = _build(lambda: fnnx.DenseGeneral(8, 4, rngs=nnx.Rngs(0)))
    x = rand((4, 8), 24)
    everything = nnx.DiffState(0, nnx.Any(nnx.Param, fnnx.Fp8Probe, fnnx.Fp8MetaVariable))
    with (
        fp8jax.autocast(enabled=True, recipe=RECIPE),
        pytest.raises(ValueError, match=r"Fp8MetaVariable variables.*diff_state\(\)"),
    ):
        nnx.grad(lambda m: jnp.sum(m(x)), argnums=everything)(layer)
