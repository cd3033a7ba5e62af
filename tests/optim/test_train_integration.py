"""fp8jax.optim.adamw in fp8jax's train steps: Linen's ``Fp8TrainState`` and NNX's
``nnx.Optimizer`` with ``fp8jax.nnx.apply_gradients``. With FP8 moments off both train bit
for bit as with ``optax.adamw``; with them on the state holds E4M3 codes, the loss goes down
like float32 Adam's, and a non-finite step leaves the codes and scales as they were."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from _shared import rand
from flax import nnx

import fp8jax
from fp8jax import flax as fflax
from fp8jax import nnx as fnnx
from fp8jax.nnx.variables import pure

RECIPE = fp8jax.DelayedScaling(amax_history_len=4)
X, Y = rand((8, 128), seed=1), rand((8, 256), seed=2)


def _linen(tx):
    state = fflax.Fp8TrainState.from_model(
        fflax.DenseGeneral(features=256), jax.random.key(0), X, tx=tx, recipe=RECIPE
    )

    @jax.jit
    def step(state, x, y):
        def f(params, probes):
            return jnp.mean((state.apply(state.variables(params, probes), x) - y) ** 2)

        loss, (g, pg) = jax.value_and_grad(f, argnums=(0, 1))(state.params, state.fp8_probe)
        return state.apply_gradients(grads=g, probe_grads=pg, skip_if_nonfinite=True), loss

    return state, step


def _nnx(tx):
    with fp8jax.autocast(enabled=True, recipe=RECIPE):
        model = fnnx.DenseGeneral(128, 256, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

    @nnx.jit
    def step(model, optimizer, x, y):
        with fp8jax.autocast(enabled=True, recipe=RECIPE):
            loss, grads = nnx.value_and_grad(
                lambda m: jnp.mean((m(x) - y) ** 2), argnums=fnnx.diff_state()
            )(model)
        fnnx.apply_gradients(model, optimizer, grads, skip_if_nonfinite=True)
        return loss

    return model, optimizer, step


def _equal(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def test_linen_fp8_off_trains_as_optax_adamw_and_fp8_on_tracks_it():
    ours, step = _linen(fp8jax.optim.adamw(1e-2, fp8_moments=False))
    ref, _ = _linen(optax.adamw(1e-2))
    fp8, _ = _linen(fp8jax.optim.adamw(1e-2))
    losses = {"ref": [], "fp8": []}
    for _ in range(4):
        ours, _ = step(ours, X, Y)
        ref, loss = step(ref, X, Y)
        fp8, loss8 = step(fp8, X, Y)
        losses["ref"].append(float(loss))
        losses["fp8"].append(float(loss8))
    _equal(ours.params, ref.params)
    _equal(ours.fp8_meta, ref.fp8_meta)
    assert losses["fp8"][-1] < losses["fp8"][0]
    np.testing.assert_allclose(losses["fp8"], losses["ref"], rtol=0.02)
    adam = fp8.opt_state[0]
    assert adam.mu.codes["kernel"].dtype == jnp.float8_e4m3fn and int(adam.count) == 4


def test_linen_non_finite_step_leaves_the_fp8_moments():
    state, step = _linen(fp8jax.optim.adamw(1e-2))
    state, _ = step(state, X, Y)
    again, loss = step(state, X.at[0, 0].set(jnp.nan), Y)
    assert not np.isfinite(float(loss))
    _equal(again.opt_state, state.opt_state)
    _equal(again.params, state.params)


def test_nnx_fp8_off_trains_as_optax_adamw_and_fp8_on_tracks_it():
    model, optimizer, step = _nnx(fp8jax.optim.adamw(1e-2, fp8_moments=False))
    ref_model, ref_optimizer, _ = _nnx(optax.adamw(1e-2))
    fp8_model, fp8_optimizer, _ = _nnx(fp8jax.optim.adamw(1e-2))
    ref_losses, fp8_losses = [], []
    for _ in range(4):
        step(model, optimizer, X, Y)
        ref_losses.append(float(step(ref_model, ref_optimizer, X, Y)))
        fp8_losses.append(float(step(fp8_model, fp8_optimizer, X, Y)))
    _equal(pure(model, nnx.Param), pure(ref_model, nnx.Param))
    assert fp8_losses[-1] < fp8_losses[0]
    np.testing.assert_allclose(fp8_losses, ref_losses, rtol=0.02)
    adam = fp8_optimizer.opt_state[0]
    codes = adam.mu.codes["kernel"]
    assert isinstance(codes, nnx.OptVariable) and codes[...].dtype == jnp.float8_e4m3fn
    assert adam.nu.scale_inv["kernel"][...].shape == (128, 2)
    # a non-finite step changes nothing
    before = pure(fp8_optimizer)
    step(fp8_model, fp8_optimizer, X.at[0, 0].set(jnp.inf), Y)
    _equal(pure(fp8_optimizer), before)


def test_nnx_bfloat16_params_train_with_stochastic_rounding():
    model, optimizer, step = _nnx(fp8jax.optim.adamw(1e-2))
    params = nnx.state(model, nnx.Param)
    nnx.update(model, jax.tree.map(lambda p: p.astype(jnp.bfloat16), params))
    optimizer = nnx.Optimizer(model, fp8jax.optim.adamw(1e-2), wrt=nnx.Param)
    losses = [float(step(model, optimizer, X, Y)) for _ in range(4)]
    assert model.kernel[...].dtype == jnp.bfloat16 and losses[-1] < losses[0]


def test_nnx_optimizer_gives_codes_and_scales_the_params_sharding():
    """nnx.Optimizer copies a param's metadata to its optimizer state: the codes and the scale
    grid (of the param's rank) take its sharding names, as optax's moments do."""
    # a 1 x 1 mesh: the test reads the sharding names, which need no second device
    mesh = jax.make_mesh((1, 1), ("a", "b"))
    with jax.set_mesh(mesh):
        model = nnx.Linear(128, 256, use_bias=False, rngs=nnx.Rngs(0))
        model.kernel = nnx.Param(model.kernel[...], out_sharding=("a", "b"))
        optimizer = nnx.Optimizer(model, fp8jax.optim.adamw(1e-3), wrt=nnx.Param)
        adam = optimizer.opt_state[0]
        for part in (adam.mu.codes, adam.mu.scale_inv, adam.nu.codes, adam.nu.scale_inv):
            assert part["kernel"].get_metadata()["out_sharding"] == ("a", "b")
            assert part["kernel"][...].sharding.spec == jax.sharding.PartitionSpec("a", "b")
