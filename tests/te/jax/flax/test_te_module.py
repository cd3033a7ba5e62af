"""A MaxText-like Linen module on fp8jax.te: it subclasses TransformerEngineBase, asks
generate_quantizer_set for its GEMM's quantizers in the ``_overwrite_with_gradient``
collection (MaxText's call, word for word) and runs TE's dense. Trained with MaxText's step
(``jax.value_and_grad`` over params and that collection, the collection's gradient taken as its
next value), it trains as fp8jax's own DenseGeneral does with fp8jax's step: the same losses
and the same FP8 state, step by step."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _shared import rand

import fp8jax
from fp8jax.flax import DenseGeneral, update_fp8_variables
from fp8jax.te.common import recipe as te_recipe
from fp8jax.te.jax.dense import dense
from fp8jax.te.jax.flax.module import TransformerEngineBase

OWG = "_overwrite_with_gradient"
RECIPES = [
    te_recipe.DelayedScaling(amax_history_len=4),
    te_recipe.Float8CurrentScaling(),
    te_recipe.MXFP8BlockScaling(),
]
HIDDEN, STEPS = 128, 3
TX = optax.sgd(0.05)


class TEDense(TransformerEngineBase):
    """MaxText's TE dot_general wrapper, in small: a kernel param and one TE dense."""

    features: int
    recipe: Any

    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (x.shape[-1], self.features))
        qs = self.generate_quantizer_set(
            postfix="",
            variable_collection=OWG,
            quantization_checkpoint_name="quantization",
            fp8_recipe=self.recipe,
            n_groups=None,
        )
        return dense(x, kernel, contracting_dims=((x.ndim - 1,), (0,)), quantizer_set=qs)


class TEModel(nn.Module):
    recipe: Any

    @nn.compact
    def __call__(self, x):
        x = nn.gelu(TEDense(HIDDEN, self.recipe)(x))
        return TEDense(HIDDEN, self.recipe)(x)


class TwinModel(nn.Module):
    """The same model from fp8jax's own DenseGeneral."""

    @nn.compact
    def __call__(self, x):
        x = nn.gelu(DenseGeneral(HIDDEN, use_bias=False)(x))
        return DenseGeneral(HIDDEN, use_bias=False)(x)


def _data():
    x = rand((2, 64, HIDDEN), 0)
    return x, jnp.tanh(x @ rand((HIDDEN, HIDDEN), 1, 0.1))


def _maxtext_train(recipe, steps=STEPS):
    """MaxText's step: differentiate params and the state collection; the state's gradient
    is its next value."""
    model = TEModel(recipe)
    x, y = _data()
    variables = model.init(jax.random.key(0), x)
    opt = TX.init(variables["params"])

    @jax.jit
    def step(variables, opt):
        def loss_fn(v):
            return jnp.mean((model.apply(v, x) - y) ** 2)

        loss, grads = jax.value_and_grad(loss_fn)(variables)
        updates, opt = TX.update(grads["params"], opt)
        params = optax.apply_updates(variables["params"], updates)
        new = {"params": params}
        if OWG in grads:
            new[OWG] = grads[OWG]
        return new, opt, loss

    losses, history = [], [variables]
    for _ in range(steps):
        variables, opt, loss = step(variables, opt)
        losses.append(float(loss))
        history.append(variables)
    return losses, history


def _twin_train(recipe, params, steps=STEPS):
    """fp8jax's own step on the twin, from the same params."""
    model = TwinModel()
    x, y = _data()
    with fp8jax.autocast(enabled=True, recipe=recipe):
        variables = model.init(jax.random.key(0), x)
    variables = {**variables, "params": params}
    opt = TX.init(params)

    @jax.jit
    def step(variables, opt):
        def loss_fn(params, probes):
            with fp8jax.autocast(enabled=True, recipe=recipe):
                out = model.apply({**variables, "params": params, "fp8_probe": probes}, x)
            return jnp.mean((out - y) ** 2)

        probes = variables.get("fp8_probe", {})
        loss, (g, pg) = jax.value_and_grad(loss_fn, argnums=(0, 1))(variables["params"], probes)
        updates, opt = TX.update(g, opt)
        new = {**variables, "params": optax.apply_updates(variables["params"], updates)}
        if "fp8_meta" in variables:
            new["fp8_meta"] = update_fp8_variables(variables["fp8_meta"], pg, recipe)
        return new, opt, loss

    losses, history = [], [variables]
    for _ in range(steps):
        variables, opt, loss = step(variables, opt)
        losses.append(float(loss))
        history.append(variables)
    return losses, history


def _stacked(state: dict[str, Any]) -> tuple[jax.Array, jax.Array]:
    roles = ("x", "kernel", "grad")
    return (
        jnp.stack([state[f"{r}_amax_history"] for r in roles]),
        jnp.concatenate([state[f"{r}_scale"] for r in roles]),
    )


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: type(r).__name__)
def test_maxtext_step_trains_as_fp8jax_own_module(recipe):
    losses, history = _maxtext_train(recipe)
    assert losses[-1] < losses[0]
    first = history[0]
    twin_params = {
        f"DenseGeneral_{i}": {"kernel": first["params"][f"TEDense_{i}"]["kernel"]} for i in (0, 1)
    }
    twin_losses, twin_history = _twin_train(recipe, twin_params)
    np.testing.assert_array_equal(losses, twin_losses)
    if not recipe.keeps_state:
        assert OWG not in first  # a stateless recipe declares nothing
        return
    assert set(first[OWG]["TEDense_0"]) == {
        f"{r}_{v}" for r in ("x", "kernel", "grad") for v in ("scale", "amax_history")
    }
    for mine, twin in zip(history[1:], twin_history[1:], strict=True):
        for i in (0, 1):
            hist, scale = _stacked(mine[OWG][f"TEDense_{i}"])
            meta = twin["fp8_meta"][f"DenseGeneral_{i}"]
            np.testing.assert_array_equal(hist, meta["amax_history"])
            np.testing.assert_array_equal(scale, meta["scale"])
    moved = _stacked(history[-1][OWG]["TEDense_0"])[1]
    assert not np.array_equal(moved, np.ones(3))  # the scales moved off their initial 1


class Scanned(nn.Module):
    """MaxText's scan_layers: the layers under nn.scan, the state collection stacked;
    optionally rematerialised, saving what MaxText's policy names "quantization"."""

    recipe: Any
    remat: bool = False

    @nn.compact
    def __call__(self, x):
        def layer(mdl, c, _):
            return nn.gelu(TEDense(HIDDEN, self.recipe, parent=mdl)(c)), None

        if self.remat:
            policy = jax.checkpoint_policies.save_only_these_names("quantization")
            layer = nn.remat(layer, policy=policy)
        body = nn.scan(
            layer,
            variable_axes={"params": 0, OWG: 0},
            split_rngs={"params": True},
            length=2,
        )
        return body(self, x, None)[0]


@pytest.mark.parametrize("remat", [False, True])
def test_scan_layers_each_layer_has_its_own_state(remat):
    recipe = te_recipe.DelayedScaling(amax_history_len=4)
    model = Scanned(recipe, remat)
    x, y = _data()
    variables = model.init(jax.random.key(0), x)

    def loss_fn(v):
        return jnp.mean((model.apply(v, x) - y) ** 2)

    _, grads = jax.jit(jax.value_and_grad(loss_fn))(variables)
    hists = [
        leaf
        for path, leaf in jax.tree_util.tree_leaves_with_path(grads[OWG])
        if "x_amax_history" in jax.tree_util.keystr(path)
    ]
    assert len(hists) == 1 and hists[0].shape == (2, 4)  # one state per layer, stacked
    hist = hists[0]
    assert hist[0, 0] != hist[1, 0] and np.all(hist[:, 0] > 0)  # each layer saw its own input


def test_no_probe_collection_is_needed():
    variables = TEModel(RECIPES[0]).init(jax.random.key(0), _data()[0])
    assert set(variables) == {"params", OWG}


def test_generate_quantizer_set_defaults_and_errors():
    class Probe(TransformerEngineBase):
        kwargs: Any

        @nn.compact
        def __call__(self):
            return self.generate_quantizer_set(**self.kwargs)

    x_init = jax.random.key(0)
    _, v = Probe({"fp8_recipe": te_recipe.DelayedScaling(amax_history_len=2)}).init_with_output(
        x_init
    )
    assert set(v) == {"fp8_metas"} and v["fp8_metas"]["x_amax_history"].shape == (2,)
    noop, v = Probe({}).init_with_output(x_init)
    assert noop.is_noop and not v
    with fp8jax.autocast(enabled=True, recipe=te_recipe.MXFP8BlockScaling()):
        qs, _ = Probe({}).init_with_output(x_init)
    assert qs.recipe == te_recipe.MXFP8BlockScaling()
    with pytest.raises(NotImplementedError, match="n_groups=4"):
        Probe({"fp8_recipe": RECIPES[0], "n_groups": 4}).init(x_init)
    with pytest.raises(NotImplementedError, match="NVFP4BlockScaling"):
        Probe({"fp8_recipe": te_recipe.NVFP4BlockScaling()}).init(x_init)
    with pytest.raises(TypeError, match="variable_collection must be"):
        Probe({"fp8_recipe": RECIPES[0], "variable_collection": 3}).init(x_init)
    with pytest.raises(TypeError, match="postfix must be a str"):
        Probe({"fp8_recipe": RECIPES[0], "postfix": 1}).init(x_init)
    two = Probe({"fp8_recipe": te_recipe.DelayedScaling(amax_history_len=2)}).init(x_init)
    long = Probe({"fp8_recipe": te_recipe.DelayedScaling(amax_history_len=8)})
    with pytest.raises(ValueError, match=r"amax_history \(2,\).*amax_history_len=8"):
        long.apply(two)
