"""fp8jax.te.convert: TE's per-quantizer FP8 state to fp8jax's Fp8Meta layout and back.

The history orders are checked against TE's own update (DelayedScaleQuantizer.update: write
the amax at index 0, reduce, roll by -1, zero index 0), written out here in numpy, and against
fp8jax's modules trained next to fp8jax.te's."""

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
from fp8jax.te import convert_te_state, to_te_state
from fp8jax.te.common import recipe as te_recipe
from fp8jax.te.jax.dense import dense
from fp8jax.te.jax.flax.module import TransformerEngineBase

L = 4
FP8_MAX = {"x": 448.0, "kernel": 448.0, "grad": 57344.0}  # HYBRID: E4M3 forward, E5M2 grad


def te_update(hist: np.ndarray, scale: np.ndarray, amax: float, fp8_max: float):
    """TransformerEngine's DelayedScaleQuantizer.update (amax_compute_algo "max", margin 0)."""
    hist = hist.copy()
    hist[0] = amax
    reduced = hist.max()
    new_scale = np.float32(fp8_max) / np.float32(reduced) if reduced > 0 else scale[0]
    hist = np.roll(hist, -1)
    hist[0] = 0.0
    return hist, np.array([new_scale], np.float32)


def te_collection(steps: int, lead: tuple[int, ...] = ()) -> dict[str, np.ndarray]:
    """A TE dense layer's state after ``steps`` updates with known amaxes."""
    out = {}
    for i, p in enumerate(("x", "kernel", "grad")):
        hists, scales = [], []
        for j in range(int(np.prod(lead, dtype=int))):
            h, s = np.zeros(L, np.float32), np.ones(1, np.float32)
            for t in range(steps):
                h, s = te_update(h, s, 1.0 + t + 10 * i + 100 * j, FP8_MAX[p])
            hists.append(h)
            scales.append(s)
        out[f"{p}_amax_history"] = np.reshape(hists, (*lead, L))
        out[f"{p}_scale"] = np.reshape(scales, (*lead, 1))
    return out


def test_te_order_matches_fp8jax_update():
    """The same amaxes through TE's update and through fp8jax's give the same state once
    converted (fp8jax's last slot, dropped at the next step, is TE's zeroed slot) and the same
    next scale."""
    recipe = fp8jax.DelayedScaling(amax_history_len=L)
    meta = fp8jax.init_fp8_meta(recipe)
    steps = 6  # more than L: the history has rolled over
    for t in range(steps):
        obs = jnp.array([1.0 + t, 11.0 + t, 21.0 + t], jnp.float32)
        meta = fp8jax.update_fp8_meta(meta, obs, recipe)
    got = convert_te_state({"layer": te_collection(steps)})["layer"]
    np.testing.assert_array_equal(got["scale"], meta.scale)
    np.testing.assert_array_equal(got["amax_history"][:, : L - 1], meta.amax_history[:, : L - 1])
    np.testing.assert_array_equal(got["amax_history"][:, -1], 0.0)
    # one more step from each: the same scale
    obs = jnp.array([0.5, 0.5, 0.5], jnp.float32)
    mine = fp8jax.update_fp8_meta(fp8jax.Fp8Meta(got["amax_history"], got["scale"]), obs, recipe)
    np.testing.assert_array_equal(mine.scale, fp8jax.update_fp8_meta(meta, obs, recipe).scale)


def test_round_trip_and_leading_axes():
    te = {"decoder": {"layers": te_collection(5, lead=(2,)), "other": np.arange(3)}}
    fp = convert_te_state(te)
    assert fp["decoder"]["layers"]["amax_history"].shape == (2, 3, L)  # scan axis kept
    assert fp["decoder"]["layers"]["scale"].shape == (2, 3)
    np.testing.assert_array_equal(fp["decoder"]["other"], np.arange(3))
    back = to_te_state(fp)
    assert set(back["decoder"]["layers"]) == set(te["decoder"]["layers"])
    for k, v in te["decoder"]["layers"].items():
        np.testing.assert_array_equal(back["decoder"]["layers"][k], v)  # TE's slot 0 is 0


def test_several_gemms_and_fp8jax_order():
    a = te_collection(3)
    b = {k: v * 2 for k, v in a.items()}
    te = {k.replace("_", "_0_", 1): v for k, v in a.items()}
    te.update({k.replace("_", "_1_", 1): v for k, v in b.items()})
    assert "kernel_0_amax_history" in te and "grad_1_scale" in te
    fp = convert_te_state({"mlp": te}, history_order="fp8jax")["mlp"]
    assert fp["amax_history"].shape == (6, L)
    np.testing.assert_array_equal(fp["amax_history"][4], b["kernel_amax_history"])  # not reversed
    rev = convert_te_state({"mlp": te}, gemm_order=["_1", "_0"])["mlp"]
    first = np.concatenate([b["x_scale"], b["kernel_scale"], b["grad_scale"]])
    np.testing.assert_array_equal(rev["scale"][:3], first)
    back = to_te_state({"mlp": fp}, history_order="fp8jax")["mlp"]
    assert set(back) == set(te)
    for k, v in te.items():
        np.testing.assert_array_equal(back[k], v)


def test_errors_name_the_argument():
    te = te_collection(2)
    with pytest.raises(ValueError, match="history_order"):
        convert_te_state(te, history_order="newest_first")
    with pytest.raises(TypeError, match="collection"):
        convert_te_state([te])
    with pytest.raises(TypeError, match="gemm_order"):
        convert_te_state(te, gemm_order="_0")
    with pytest.raises(ValueError, match="gemm_order"):
        convert_te_state(te, gemm_order=["_0"])
    del te["grad_scale"]
    with pytest.raises(ValueError, match="grad_scale"):
        convert_te_state({"d": te})
    with pytest.raises(ValueError, match="GEMM triples"):
        to_te_state({"d": {"amax_history": jnp.zeros((2, L)), "scale": jnp.ones(2)}})
    with pytest.raises(ValueError, match="postfixes"):
        to_te_state(
            {"d": {"amax_history": jnp.zeros((3, L)), "scale": jnp.ones(3)}}, postfixes=["a", "b"]
        )
    with pytest.raises(TypeError, match="postfixes"):
        to_te_state({}, postfixes="_0")


OWG = "_overwrite_with_gradient"
RECIPE = te_recipe.DelayedScaling(amax_history_len=L)
TX = optax.sgd(0.05)


class TEDense(TransformerEngineBase):
    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", nn.initializers.lecun_normal(), (x.shape[-1], 64))
        qs = self.generate_quantizer_set(variable_collection=OWG, fp8_recipe=RECIPE)
        return dense(x, kernel, contracting_dims=((x.ndim - 1,), (0,)), quantizer_set=qs)


def _data():
    x = rand((2, 32, 64), 0)
    return x, jnp.tanh(x)


def _te_train(model, variables, steps=3):
    """MaxText's step: the state collection's gradient is its next value."""
    x, y = _data()
    opt = TX.init(variables["params"])

    @jax.jit
    def step(variables, opt):
        def loss_fn(v):
            return jnp.mean((model.apply(v, x) - y) ** 2)

        grads = jax.grad(loss_fn)(variables)
        updates, opt = TX.update(grads["params"], opt)
        return {"params": optax.apply_updates(variables["params"], updates), OWG: grads[OWG]}, opt

    for _ in range(steps):
        variables, opt = step(variables, opt)
    return variables


def _fp8jax_train(model, variables, steps=3):
    """fp8jax's step: the state is updated from the probes' gradients."""
    x, y = _data()
    opt = TX.init(variables["params"])

    @jax.jit
    def step(variables, opt):
        def loss_fn(params, probes):
            with fp8jax.autocast(enabled=True, recipe=RECIPE):
                out = model.apply({**variables, "params": params, "fp8_probe": probes}, x)
            return jnp.mean((out - y) ** 2)

        g, pg = jax.grad(loss_fn, argnums=(0, 1))(variables["params"], variables["fp8_probe"])
        updates, opt = TX.update(g, opt)
        new = {**variables, "params": optax.apply_updates(variables["params"], updates)}
        new["fp8_meta"] = update_fp8_variables(variables["fp8_meta"], pg, RECIPE)
        return new, opt

    for _ in range(steps):
        variables, opt = step(variables, opt)
    return variables


def test_fp8jax_te_collection_converts_to_fp8jax_module_state():
    """A collection of fp8jax.te's modules after some MaxText-style steps, converted with
    history_order="fp8jax", is the fp8_meta of fp8jax's DenseGeneral after the same steps."""
    x, _ = _data()
    te_model = TEDense()
    first = te_model.init(jax.random.key(0), x)
    te_vars = _te_train(te_model, first)
    twin = DenseGeneral(64, use_bias=False)
    with fp8jax.autocast(enabled=True, recipe=RECIPE):
        tw_vars = twin.init(jax.random.key(0), x)
    tw_vars = _fp8jax_train(twin, {**tw_vars, "params": {"kernel": first["params"]["kernel"]}})
    got = convert_te_state(te_vars[OWG], history_order="fp8jax")
    want: Any = tw_vars["fp8_meta"]
    np.testing.assert_array_equal(got["amax_history"], want["amax_history"])
    np.testing.assert_array_equal(got["scale"], want["scale"])
    assert not np.array_equal(got["scale"], np.ones(3))  # the state moved


def test_te_checkpoint_to_fp8jax_te_collection():
    """A TE checkpoint's collection as fp8jax.te's modules keep it: the same names (MaxText's
    _overwrite_with_gradient tree restores as is), the histories reversed."""
    te = {"layers": te_collection(5, lead=(2,))}
    mine = to_te_state(convert_te_state(te), history_order="fp8jax")
    assert set(mine["layers"]) == set(te["layers"])
    for k, v in te["layers"].items():
        want = v[..., ::-1] if k.endswith("_amax_history") else v
        np.testing.assert_array_equal(mine["layers"][k], want)
