"""The FP8 train step is hard to misuse: the state updates or the user is told why not, the recipe
is stated once, a bad batch leaves no trace, remat saves what it says, and calibration works.

Each test names the behaviour it proves (issue 8's items).
"""

from __future__ import annotations

import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _shared import rand
from flax.training import train_state

import fp8jax
from fp8jax import DelayedScaling, Float8CurrentScaling, Format
from fp8jax.flax import DenseGeneral, Fp8TrainState, all_finite, calibrate, update_fp8_variables

RECIPE = DelayedScaling(amax_history_len=4)


class MLP(nn.Module):
    """Two FP8 dense layers with a gelu between them."""

    @nn.compact
    def __call__(self, x):
        return DenseGeneral(features=8)(nn.gelu(DenseGeneral(features=32)(x)))


def _state(model=None, x=None, recipe=RECIPE, tx=None):
    model = model or MLP()
    x = rand((16, 8), 0) if x is None else x
    return Fp8TrainState.from_model(
        model, jax.random.key(0), x, tx=tx or optax.adam(1e-2), recipe=recipe
    )


def _train_step(skip=False):
    @jax.jit
    def step(state, x, y):
        def loss_fn(params, probes):
            out = state.apply(state.variables(params, probes), x)
            return jnp.mean((out - y) ** 2)

        loss, (grads, probe_grads) = jax.value_and_grad(loss_fn, argnums=(0, 1))(
            state.params, state.fp8_probe
        )
        return state.apply_gradients(
            grads=grads, probe_grads=probe_grads, skip_if_nonfinite=skip
        ), loss

    return step


def _assert_same_state(a, b):
    jax.tree.map(np.testing.assert_array_equal, (a.step, a.params, a.opt_state, a.fp8_meta),
                 (b.step, b.params, b.opt_state, b.fp8_meta))  # fmt: skip


# ------------------------------------------------------ 1. the state updates, or an error says why


def test_apply_with_mutable_fp8_meta_is_an_error():
    """Threading fp8_meta like batch_stats (mutable in apply) would leave the scales at 1."""
    state = _state()
    variables = {"params": state.params, "fp8_meta": state.fp8_meta}
    x = rand((16, 8), 1)
    for mutable in (["fp8_meta"], True):
        with fp8jax.autocast(enabled=True, recipe=RECIPE):
            with pytest.raises(ValueError, match=r"mutable.*output-gradient amax.*fp8_probe"):
                MLP().apply(variables, x, mutable=mutable)


def test_plain_train_state_without_probe_gradients_is_an_error():
    """A plain TrainState step (grads of params only) would never update the FP8 state."""
    model, x, y = MLP(), rand((16, 8), 2), rand((16, 8), 3)
    state = _state(model, x)
    plain = train_state.TrainState.create(
        apply_fn=model.apply, params=state.params, tx=optax.sgd(0.1)
    )

    def loss(params, probes):
        variables = {"params": params, "fp8_meta": state.fp8_meta}
        if probes is not None:
            variables["fp8_probe"] = probes
        with fp8jax.autocast(enabled=True, recipe=RECIPE):
            return jnp.mean((plain.apply_fn(variables, x) - y) ** 2)

    # no probes at all, and probes given but not differentiated: both lose the observations
    for probes in (None, state.fp8_probe):
        with pytest.raises(ValueError, match=r"DenseGeneral at 'DenseGeneral_\d'.*probe"):
            jax.grad(loss)(plain.params, probes)
    # evaluation (no gradient) needs no probes, and neither does current scaling
    with fp8jax.autocast(enabled=True, recipe=RECIPE):
        model.apply({"params": state.params, "fp8_meta": state.fp8_meta}, x)
    with fp8jax.autocast(enabled=True, recipe=Float8CurrentScaling()):
        jax.grad(lambda p: jnp.sum(model.apply({"params": p}, x)))(state.params)


def test_functional_dense_gradient_without_probe_is_an_error():
    x, w = rand((8, 16), 4), rand((16, 4), 5)
    meta = fp8jax.init_fp8_meta(RECIPE)
    with pytest.raises(ValueError, match=r"fp8jax.dense: differentiated .* probe"):
        jax.grad(lambda x: jnp.sum(fp8jax.dense(x, w, None, meta, RECIPE)))(x)
    g, obs = jax.grad(
        lambda x, p: jnp.sum(fp8jax.dense(x, w, None, meta, RECIPE, probe=p)), argnums=(0, 1)
    )(x, jnp.zeros(3))
    assert bool(jnp.all(obs > 0)) and g.shape == x.shape


class _Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        return DenseGeneral(features=8)(x), None


def _scanned(axes):
    class Stack(nn.Module):
        @nn.compact
        def __call__(self, x):
            layers = nn.scan(_Block, variable_axes=axes, split_rngs={"params": True}, length=2)
            return layers()(x, None)[0]

    return Stack()


@pytest.mark.parametrize(
    "axes, missing",
    [({"params": 0}, "fp8_meta"), ({"params": 0, "fp8_probe": 0}, "fp8_meta"),
     ({"params": 0, "fp8_meta": 0}, "fp8_probe")],
)  # fmt: skip
def test_scan_without_fp8_variable_axes_names_variable_axes(axes, missing):
    x = rand((4, 8), 6)
    with fp8jax.autocast(enabled=True, recipe=RECIPE):
        match = rf"'{missing}' collection does not reach.*variable_axes"
        with pytest.raises(ValueError, match=match):
            _scanned(axes).init(jax.random.key(0), x)


def test_scan_apply_without_fp8_variable_axes_names_variable_axes():
    """A model initialised right but applied through a scan that drops the FP8 collections."""
    x = rand((4, 8), 7)
    good = {"params": 0, "fp8_meta": 0, "fp8_probe": 0}
    with fp8jax.autocast(enabled=True, recipe=RECIPE):
        variables = _scanned(good).init(jax.random.key(0), x)
        with pytest.raises(ValueError, match="'fp8_meta' collection does not reach"):
            _scanned({"params": 0}).apply(variables, x)
        with pytest.raises(ValueError, match="'fp8_probe' collection does not reach"):
            _scanned({"params": 0, "fp8_meta": 0}).apply(variables, x)


# ------------------------------------------------------------------ 2. the recipe is stated once


def test_the_state_runs_and_updates_under_its_own_recipe():
    e4m3 = DelayedScaling(fp8_format=Format.E4M3, amax_history_len=4)
    hybrid = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=4)
    state = _state(recipe=e4m3)
    x, y = rand((16, 8), 8), rand((16, 8), 9)
    new, _ = _train_step()(state, x, y)
    # the gradient role's scale is computed for E4M3's 448, the format the backward used
    g_amax = float(new.fp8_meta["DenseGeneral_1"]["amax_history"][2, 0])
    assert float(new.fp8_meta["DenseGeneral_1"]["scale"][2]) == pytest.approx(448.0 / g_amax)
    with pytest.raises(ValueError, match="differs from the state's"):
        state.apply_gradients(grads=state.params, probe_grads=state.fp8_probe, recipe=hybrid)
    with fp8jax.autocast(enabled=True, recipe=hybrid):
        with pytest.raises(ValueError, match=r"inside fp8jax.autocast.*state's recipe"):
            state.apply(state.variables(), x)
    with fp8jax.autocast(enabled=False):
        with pytest.raises(ValueError, match=r"inside fp8jax.autocast"):
            state.apply(state.variables(), x)
    with fp8jax.autocast(enabled=True, recipe=e4m3):  # the same recipe is fine
        state.apply(state.variables(), x)


def test_state_from_variables_of_another_recipe_is_an_error():
    model, x = MLP(), rand((16, 8), 10)
    with fp8jax.autocast(enabled=True, recipe=RECIPE):
        variables = model.init(jax.random.key(0), x)
    kw = dict(apply_fn=model.apply, variables=variables, tx=optax.sgd(0.1))
    with pytest.raises(ValueError, match=r"history of length 4.*amax_history_len=16"):
        Fp8TrainState.from_variables(**kw, recipe=DelayedScaling(amax_history_len=16))
    with pytest.raises(ValueError, match=r"holds? delayed-scaling state"):
        Fp8TrainState.from_variables(**kw, recipe=Float8CurrentScaling())
    with pytest.raises(TypeError, match="recipe must be"):
        Fp8TrainState.from_variables(**kw, recipe="hybrid")
    with pytest.raises(ValueError, match="has no recipe"):
        Fp8TrainState.create(apply_fn=model.apply, params=variables["params"],
                             tx=optax.sgd(0.1)).apply(variables, x)  # fmt: skip


def test_explicit_recipe_turns_fp8_on_outside_autocast():
    x, w = rand((8, 16), 11, 3.0), rand((16, 4), 12)
    meta = fp8jax.init_fp8_meta(RECIPE)
    high = fp8jax.dense(x, w)  # no recipe, no autocast: high precision
    given = fp8jax.dense(x, w, None, meta, RECIPE)  # recipe given: FP8
    forced = fp8jax.dense(x, w, None, meta, RECIPE, enabled=True)
    off = fp8jax.dense(x, w, None, meta, RECIPE, enabled=False)
    np.testing.assert_array_equal(given, forced)
    np.testing.assert_array_equal(off, high)
    assert not np.array_equal(given, high)


# ----------------------------------------------------------------- 3. a bad batch leaves no trace


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "+inf", "-inf"])
@pytest.mark.parametrize("where", ["input", "target"])
def test_skipped_bad_step_leaves_no_trace(where, bad):
    """clean, bad (skipped), clean == clean, clean: params, optimizer, step and FP8 state."""
    state = _state()
    batches = [(rand((16, 8), 20 + i, 2.0), rand((16, 8), 30 + i)) for i in range(3)]
    x_bad, y_bad = (np.array(v) for v in batches[1])
    (x_bad if where == "input" else y_bad)[3, 5] = bad
    step = _train_step(skip=True)
    s = state
    for x, y in (batches[0], (jnp.asarray(x_bad), jnp.asarray(y_bad)), batches[2]):
        s, _ = step(s, x, y)
    # the bad step's loss is non-finite (an inf input is not saturated away)
    _, bad_loss = step(step(state, *batches[0])[0], jnp.asarray(x_bad), jnp.asarray(y_bad))
    assert not np.isfinite(float(bad_loss))
    ref = state
    for x, y in (batches[0], batches[2]):
        ref, _ = step(ref, x, y)
    _assert_same_state(s, ref)
    assert int(s.step) == 2


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf], ids=["nan", "+inf", "-inf"])
@pytest.mark.parametrize("role", ["input", "kernel", "grad_output"])
def test_nonfinite_observation_is_never_recorded(role, bad):
    """Without skipping, a non-finite tensor leaves its role's history and scale as they were,
    and stays non-finite through the FP8 path (its gradient or output is not finite)."""
    x, w, c = rand((8, 16), 40, 2.0), rand((16, 4), 41), rand((8, 4), 42)
    x, w, c = np.array(x), np.array(w), np.array(c)
    {"input": x, "kernel": w, "grad_output": c}[role][1, 2] = bad
    meta = fp8jax.init_fp8_meta(RECIPE)
    meta = fp8jax.update_fp8_meta(meta, jnp.array([4.0, 2.0, 8.0]), RECIPE)  # a history

    def loss(x, w, p):
        return jnp.sum(fp8jax.dense(x, w, None, meta, RECIPE, probe=p) * c)

    value, (dx, obs) = jax.value_and_grad(loss, argnums=(0, 2))(x, w, jnp.zeros(3))
    assert not np.isfinite(float(value)) or not bool(jnp.all(jnp.isfinite(dx)))
    i = ("input", "kernel", "grad_output").index(role)
    assert not np.isfinite(float(obs[i]))
    new = fp8jax.update_fp8_meta(meta, obs, RECIPE)
    np.testing.assert_array_equal(new.amax_history[i], meta.amax_history[i])
    np.testing.assert_array_equal(new.scale[i], meta.scale[i])
    for j in {0, 1, 2} - {i}:  # the finite roles are recorded as usual
        assert float(new.amax_history[j, 0]) == float(obs[j])


def test_all_finite():
    assert bool(all_finite({"a": jnp.ones(3)}, [jnp.zeros(2, jnp.int32)]))
    assert not bool(all_finite({"a": jnp.array([1.0, jnp.inf])}))
    assert bool(all_finite({}))
    with pytest.raises(TypeError, match="skip_if_nonfinite must be a bool"):
        s = _state()
        s.apply_gradients(grads=s.params, probe_grads=s.fp8_probe, skip_if_nonfinite="yes")


# ---------------------------------------------------------------- 4. remat that saves what it says


def _count_fp8_ops(model, x, y):
    """(cast_transpose, GEMM) calls in the lowered train step (CPU: the GEMM is a dot)."""
    state = _state(model, x)
    text = _train_step().lower(state, x, y).as_text()
    gemm = "dot_general" if jax.default_backend() == "cpu" else "fp8jax_gemm"
    return len(re.findall(r"fp8jax_cast_transpose", text)), len(re.findall(gemm, text))


def test_remat_policy_save_fp8_operands_recomputes_no_cast():
    x, y = rand((16, 8), 50), rand((16, 8), 51)
    plain = _count_fp8_ops(MLP(), x, y)
    saved = _count_fp8_ops(nn.remat(MLP, policy=fp8jax.save_fp8_operands)(), x, y)
    nothing = _count_fp8_ops(nn.remat(MLP, policy=jax.checkpoint_policies.nothing_saveable)(), x, y)
    # 2 layers: 2 casts each forward (input, kernel) + 1 backward (grad); 2 forward GEMMs,
    # 2 wgrad + 1 dgrad (the first layer's input needs no gradient)
    assert plain == (6, 5)
    # no cast is recomputed; only the first GEMM, whose output the gelu backward needs
    assert saved == (6, 6)
    assert nothing == (10, 6)  # without the names every forward cast runs again
    # and after XLA's optimisations too: the compiled step casts no more than without remat
    state = _state(nn.remat(MLP, policy=fp8jax.save_fp8_operands)(), x)
    compiled = _train_step().lower(state, x, y).compile().as_text()
    # (the backward casts of a layer with bias are cast_transpose_dbias: g read once)
    assert len(re.findall(r'custom_call_target="fp8jax_cast_transpose(_dbias)?"', compiled)) == 6


def test_remat_does_not_change_the_numbers_of_a_calibrated_step():
    """Saved FP8 residuals are exact under every policy, also for E4M3 codes >= 256 and
    subnormals (jax.checkpoint's reduce_precision on float residuals would break both)."""
    model, x, y = MLP(), rand((16, 8), 52, 3.0), rand((16, 8), 53)
    ref_state = _state(model, x)
    step = _train_step()
    ref_state, _ = step(ref_state, x, y)  # scales now map each amax to 448
    ref_next, ref_loss = step(ref_state, x, y)
    for policy in (fp8jax.save_fp8_operands, jax.checkpoint_policies.everything_saveable,
                   jax.checkpoint_policies.nothing_saveable):  # fmt: skip
        remat = nn.remat(MLP, policy=policy)()
        state = ref_state.replace(apply_fn=remat.apply)
        nxt, loss = step(state, x, y)
        np.testing.assert_array_equal(loss, ref_loss)
        _assert_same_state(nxt, ref_next)


# ---------------------------------------------------------------------------- 5. calibration


def test_calibration_brings_large_inputs_into_range():
    model = DenseGeneral(features=16, use_bias=False)
    rng = np.random.default_rng(60)
    batches = [jnp.asarray(rng.uniform(-704, 704, (32, 64)), jnp.float32) for _ in range(3)]
    x = batches[0]
    assert float(jnp.max(jnp.abs(x))) > 448
    with fp8jax.autocast(enabled=True, recipe=RECIPE):
        variables = model.init(jax.random.key(1), x)

    def rel_err(meta):
        with fp8jax.autocast(enabled=True, recipe=RECIPE):
            y = model.apply({"params": variables["params"], "fp8_meta": meta}, x)
        y_ref = model.apply({"params": variables["params"]}, x)  # FP8 off: float32
        return float(jnp.linalg.norm(y - y_ref) / jnp.linalg.norm(y_ref))

    meta = calibrate(model.apply, variables, batches, recipe=RECIPE)
    before, after = rel_err(variables["fp8_meta"]), rel_err(meta)
    assert before > 0.1 and after < 0.08 and after < before / 2
    amax = max(float(jnp.max(jnp.abs(b))) for b in batches)
    assert float(meta["amax_history"].max(axis=1)[0]) == amax
    assert float(meta["scale"][0]) == pytest.approx(448.0 / amax)
    # the output-grad role is untouched: history zeros, scale 1
    np.testing.assert_array_equal(meta["amax_history"][2], variables["fp8_meta"]["amax_history"][2])
    assert float(meta["scale"][2]) == 1.0


def test_calibration_of_a_scanned_model_and_errors():
    model, x = _scanned({"params": 0, "fp8_meta": 0, "fp8_probe": 0}), rand((4, 8), 70, 50.0)
    with fp8jax.autocast(enabled=True, recipe=RECIPE):
        variables = model.init(jax.random.key(0), x)
    variables_without_probes = {"params": variables["params"], "fp8_meta": variables["fp8_meta"]}
    meta = calibrate(model.apply, variables_without_probes, [x], recipe=RECIPE)
    (hist,) = [h for h in jax.tree.leaves(meta) if h.ndim == 3]  # [layers, roles, L]
    assert float(hist[0, 0, 0]) == float(jnp.max(jnp.abs(x)))
    assert bool(jnp.all(hist[:, 1, 0] > 0)) and bool(jnp.all(hist[:, 2] == 0))
    with pytest.raises(TypeError, match="must be a DelayedScaling"):
        calibrate(model.apply, variables, [x], recipe=Float8CurrentScaling())
    with pytest.raises(ValueError, match="batches is empty"):
        calibrate(model.apply, variables, [], recipe=RECIPE)
    with pytest.raises(ValueError, match="no 'fp8_meta'"):
        calibrate(model.apply, {"params": variables["params"]}, [x], recipe=RECIPE)
    # the calibrated state is usable by a train step as it is
    assert update_fp8_variables(meta, jax.tree.map(jnp.zeros_like, variables["fp8_probe"]),
                                RECIPE) is not None  # fmt: skip
