"""fp8jax.flax.LayerNorm and LayerNormDenseGeneral against plain-Flax twins, and the module
behaviours every fp8jax module shares (params, FP8 state, errors, scan, remat)."""

from __future__ import annotations

import flax.errors
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _shared import rand

import fp8jax
from fp8jax import DelayedScaling, Float8CurrentScaling
from fp8jax.flax import Fp8TrainState, LayerNorm, LayerNormDenseGeneral, LayerNormMLP

pytestmark = pytest.mark.usefixtures("float32_matmuls")

RECIPE = DelayedScaling(amax_history_len=4)
H = 32


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def _flax_norm(norm_type, **kw):
    return nn.LayerNorm(**kw) if norm_type == "layernorm" else nn.RMSNorm(**kw)


def _as_flax(p):
    """fp8jax's norm params (TE names) as Flax's: scale -> scale, ln_bias -> bias."""
    return {"scale": p["scale"], **({"bias": p["ln_bias"]} if "ln_bias" in p else {})}


@pytest.mark.parametrize("norm_type", ["layernorm", "rmsnorm"])
def test_layernorm_fp8_off_is_bit_identical_to_flax(norm_type):
    x = rand((3, 5, H), 0, 3.0) + 1.0
    ours = LayerNorm(epsilon=1e-5, layernorm_type=norm_type)
    theirs = _flax_norm(norm_type, epsilon=1e-5)
    params = ours.init(jax.random.key(0), x)["params"]
    params = jax.tree.map(lambda p: p + rand(p.shape, 1, 0.1), params)
    assert set(params) == ({"scale", "ln_bias"} if norm_type == "layernorm" else {"scale"})
    c = rand(x.shape, 2)

    def f(mod, p, x):
        return jnp.sum(mod.apply({"params": p}, x) * c)

    np.testing.assert_array_equal(
        np.asarray(ours.apply({"params": params}, x)),
        np.asarray(theirs.apply({"params": _as_flax(params)}, x)),
    )
    g = jax.grad(lambda p, x: f(ours, p, x), argnums=(0, 1))(params, x)
    tg = jax.grad(lambda p, x: f(theirs, p, x), argnums=(0, 1))(_as_flax(params), x)
    np.testing.assert_array_equal(np.asarray(g[1]), np.asarray(tg[1]))
    for a, b in zip(jax.tree.leaves(_as_flax(g[0])), jax.tree.leaves(tg[0]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # inside autocast: fp8jax's norm kernel (float32 statistics in another order)
    with fp8jax.autocast(enabled=True, recipe=RECIPE):
        y = ours.apply({"params": params}, x)
        gk = jax.grad(lambda p, x: f(ours, p, x), argnums=(0, 1))(params, x)
    np.testing.assert_allclose(np.asarray(y), np.asarray(theirs.apply({"params":
                               _as_flax(params)}, x)), rtol=1e-5, atol=1e-5)  # fmt: skip
    for a, b in zip(jax.tree.leaves(gk), jax.tree.leaves(g), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-4)


def test_zero_centered_gamma_starts_at_zero_and_scales_by_one_plus():
    x = rand((4, H), 3)
    m = LayerNorm(zero_centered_gamma=True)
    v = m.init(jax.random.key(0), x)
    assert not np.asarray(v["params"]["scale"]).any()
    np.testing.assert_array_equal(
        np.asarray(m.apply(v, x)), np.asarray(LayerNorm().apply(LayerNorm().init(
            jax.random.key(0), x), x)),
    )  # fmt: skip


class _Twin(nn.Module):
    """LayerNorm + DenseGeneral from flax.linen."""

    features: tuple[int, ...]
    norm_type: str = "layernorm"

    @nn.compact
    def __call__(self, x):
        ln = _flax_norm(self.norm_type, epsilon=1e-6, name="ln")(x)
        return nn.DenseGeneral(self.features, use_bias=True, name="dense")(ln), ln


def _twin_params(p):
    return {"ln": _as_flax(p), "dense": {"kernel": p["kernel"], "bias": p["bias"]}}


@pytest.mark.parametrize("norm_type", ["layernorm", "rmsnorm"])
def test_layernorm_dense_fp8_off_is_bit_identical_to_the_twin(norm_type):
    x = rand((3, 5, H), 4, 2.0)
    ours = LayerNormDenseGeneral((2, 8), layernorm_type=norm_type, use_bias=True,
                                 return_layernorm_output=True)  # fmt: skip
    twin = _Twin((2, 8), norm_type)
    params = ours.init(jax.random.key(0), x)["params"]
    params = {**params, "bias": rand((2, 8), 5)}
    c, d = rand((3, 5, 2, 8), 6), rand((3, 5, H), 7)

    def loss(mod, p, x):
        y, ln = mod.apply({"params": p}, x)
        return jnp.sum(y * c) + jnp.sum(ln * d)

    np.testing.assert_array_equal(
        np.asarray(loss(ours, params, x)), np.asarray(loss(twin, _twin_params(params), x))
    )
    g = jax.grad(lambda p, x: loss(ours, p, x), argnums=(0, 1))(params, x)
    tg = jax.grad(lambda p, x: loss(twin, p, x), argnums=(0, 1))(_twin_params(params), x)
    np.testing.assert_array_equal(np.asarray(g[1]), np.asarray(tg[1]))
    for a, b in zip(jax.tree.leaves(_twin_params(g[0])), jax.tree.leaves(tg[0]), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # FP8 on (current scaling): within FP8 bounds
    with fp8jax.autocast(enabled=True, recipe=Float8CurrentScaling()):
        g8 = jax.grad(lambda p, x: loss(ours, p, x), argnums=(0, 1))(params, x)
    for a, b in zip(jax.tree.leaves(g8), jax.tree.leaves(g), strict=True):
        assert _rel(a, b) < 0.15


def test_params_state_and_outputs():
    x = rand((2, 3, H), 8)
    m = LayerNormDenseGeneral(16)
    with fp8jax.autocast(enabled=True, recipe=RECIPE):
        v = m.init(jax.random.key(0), x)
        y, ln = m.apply(v, x)
    assert jax.tree.map(jnp.shape, v["params"]) == {"kernel": (H, 16), "ln_bias": (H,),
                                                    "scale": (H,)}  # fmt: skip
    assert jax.tree.map(jnp.shape, v["fp8_meta"]) == {"amax_history": (3, 4), "scale": (3,)}
    assert y.shape == (2, 3, 16) and ln is None
    # enable_layernorm=False: an FP8 dense layer; the "norm output" is the input
    plain = LayerNormDenseGeneral(16, enable_layernorm=False, return_layernorm_output=True,
                                  use_bias=True, depth_scaling=2.0)  # fmt: skip
    pv = plain.init(jax.random.key(0), x)
    assert set(pv["params"]) == {"kernel", "bias"}
    y, ln = plain.apply(pv, x)
    assert ln is x
    want = (x @ pv["params"]["kernel"] + pv["params"]["bias"]) / 2.0
    np.testing.assert_allclose(np.asarray(y), np.asarray(want), rtol=1e-6, atol=1e-6)
    # LayerNormMLP: TE's stacked wi_kernel init, one key per activation slice
    mlp = LayerNormMLP(intermediate_dim=8, activations=("gelu", "linear"))
    mv = mlp.init(jax.random.key(3), x, deterministic=True)["params"]
    slices = np.asarray(mv["wi_kernel"])
    assert slices.shape == (H, 2, 8) and not np.allclose(slices[:, 0], slices[:, 1])


@pytest.mark.parametrize(
    ("module", "match"),
    [
        (LayerNormDenseGeneral(8, layernorm_type="batchnorm"), "layernorm_type"),
        (LayerNormDenseGeneral(8, epsilon=-1.0), "epsilon"),
        (LayerNormDenseGeneral(8, axis=0), "axis"),
        (LayerNormDenseGeneral(0), "features"),
        (LayerNormDenseGeneral(8, kernel_axes=("embed",)), "kernel_axes"),
        (LayerNorm(layernorm_type="groupnorm"), "layernorm_type"),
        (LayerNormMLP(intermediate_dim=8, activations=("tanh",)), "activations"),
        (LayerNormMLP(intermediate_dim=8, activations=("gelu", "relu")), "activations"),
        (LayerNormMLP(intermediate_dim=0), "intermediate_dim"),
        (LayerNormMLP(intermediate_dim=8, intermediate_dropout_rate=1.0), "dropout_rate"),
        (LayerNormMLP(intermediate_dim=8, intermediate_hidden_dropout_dims=(5,)), "dropout_dims"),
        (LayerNormMLP(intermediate_dim=8, kernel_axes_1=("embed", "mlp")), "kernel_axes_1"),
    ],
)
def test_bad_configuration_names_the_argument(module, match):
    with pytest.raises((ValueError, TypeError), match=match):
        module.init(jax.random.key(0), jnp.ones((2, 4, H)))


def test_non_float_input_is_a_type_error():
    for m in (LayerNorm(), LayerNormDenseGeneral(4), LayerNormMLP(intermediate_dim=4)):
        with pytest.raises(TypeError, match="floating-point"):
            m.init(jax.random.key(0), jnp.ones((2, H), jnp.int32))


def test_mlp_dropout_uses_its_rng_and_broadcast_dims():
    x = rand((4, 6, H), 9)
    m = LayerNormMLP(intermediate_dim=16, intermediate_dropout_rate=0.5,
                     intermediate_hidden_dropout_dims=(-2,))  # fmt: skip
    v = m.init(jax.random.key(0), x, deterministic=True)
    with pytest.raises(flax.errors.InvalidRngError, match="dropout"):
        m.apply(v, x)  # dropout active and no rng
    a = m.apply(v, x, rngs={"dropout": jax.random.key(1)})[0]
    b = m.apply(v, x, rngs={"dropout": jax.random.key(1)})[0]
    c = m.apply(v, x, rngs={"dropout": jax.random.key(2)})[0]
    det = m.apply(v, x, deterministic=True)[0]
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert not np.array_equal(np.asarray(a), np.asarray(c))
    assert not np.array_equal(np.asarray(a), np.asarray(det))
    # the mask is shared along the sequence dim (-2): zeroing the hidden units the mask drops
    # in one position drops them everywhere, so the sequence positions of a constant input agree
    xs = jnp.broadcast_to(x[:, :1], x.shape)
    ys = m.apply(v, xs, rngs={"dropout": jax.random.key(1)})[0]
    np.testing.assert_allclose(np.asarray(ys), np.asarray(jnp.broadcast_to(ys[:, :1], ys.shape)),
                               rtol=1e-6, atol=1e-6)  # fmt: skip


def test_train_step_updates_all_six_roles_with_the_backward_format():
    x, y = rand((4, 8, H), 10), rand((4, 8, H), 11)
    model = LayerNormMLP(intermediate_dim=64, activations=("gelu",), use_bias=True,
                         intermediate_dropout_rate=0.0)  # fmt: skip
    state = Fp8TrainState.from_model(model, jax.random.key(0), x, tx=optax.sgd(0.1),
                                     recipe=RECIPE)  # fmt: skip
    assert state.fp8_probe["call_0"].shape == (6,)

    @jax.jit
    def step(state):
        def loss(params, probes):
            out, _ = state.apply(state.variables(params, probes), x)
            return jnp.mean((out - y) ** 2)

        grads, probe_grads = jax.grad(loss, argnums=(0, 1))(state.params, state.fp8_probe)
        return state.apply_gradients(grads=grads, probe_grads=probe_grads), probe_grads

    state, seen = step(state)
    seen = np.asarray(seen["call_0"])
    assert (seen > 0).all()
    hist = np.asarray(state.fp8_meta["amax_history"])
    np.testing.assert_array_equal(hist[:, 0], seen)
    fmax = np.array([448.0, 448.0, 57344.0] * 2)
    np.testing.assert_allclose(np.asarray(state.fp8_meta["scale"]), fmax / seen, rtol=1e-6)


def test_scan_over_layers_and_remat_with_the_fp8_policy():
    """Four LayerNormMLP layers under nn.scan (state and probes stacked) and nn.remat with
    fp8jax.save_fp8_operands: the same losses, gradients and state as the unrolled stack."""

    class Block(nn.Module):
        @nn.compact
        def __call__(self, x, _):
            y, _ = LayerNormMLP(intermediate_dim=32, intermediate_dropout_rate=0.0,
                                activations=("silu", "linear"))(x)  # fmt: skip
            return x + y, None

    class Scanned(nn.Module):
        remat: bool

        @nn.compact
        def __call__(self, x):
            block = nn.remat(Block, policy=fp8jax.save_fp8_operands) if self.remat else Block
            stack = nn.scan(block, variable_axes={"params": 0, "fp8_meta": 0, "fp8_probe": 0},
                            split_rngs={"params": True}, length=4)  # fmt: skip
            return stack(name="layers")(x, None)[0]

    x, y = rand((2, 8, H), 12), rand((2, 8, H), 13)
    results = []
    for remat in (False, True):
        state = Fp8TrainState.from_model(Scanned(remat), jax.random.key(0), x,
                                         tx=optax.sgd(0.05), recipe=RECIPE)  # fmt: skip
        (node,) = jax.tree.leaves(state.fp8_meta, is_leaf=lambda t: "scale" in t)
        assert node["scale"].shape == (4, 6)

        @jax.jit
        def step(state):
            def loss(params, probes):
                return jnp.mean((state.apply(state.variables(params, probes), x) - y) ** 2)

            value, (g, pg) = jax.value_and_grad(loss, argnums=(0, 1))(state.params,
                                                                      state.fp8_probe)  # fmt: skip
            return state.apply_gradients(grads=g, probe_grads=pg), value

        losses = []
        for _ in range(3):
            state, value = step(state)
            losses.append(float(value))
        results.append((losses, state))
    (l0, s0), (l1, s1) = results
    np.testing.assert_array_equal(l0, l1)
    for a, b in zip(jax.tree.leaves(s0.fp8_meta), jax.tree.leaves(s1.fp8_meta), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    (node,) = jax.tree.leaves(s0.fp8_meta, is_leaf=lambda t: "scale" in t)
    scales = np.asarray(node["scale"])
    assert not np.allclose(scales[0], scales[1])  # each layer its own state


def test_layernorm_dense_five_delayed_steps_match_flax_fp8_ops():
    """LayerNormDenseGeneral vs LayerNorm + DenseGeneral(dot_general_cls=Fp8DirectDotGeneralOp)
    over five SGD steps: losses, params and the next step's scales (Flax derives them from its
    amax history when it next runs) agree to 2e-3 (see tests/flax/test_flax_mlp.py)."""
    import functools

    from flax.linen import fp8_ops

    from fp8jax.flax import update_fp8_variables

    class Fp8Twin(nn.Module):
        @nn.compact
        def __call__(self, x):
            op = functools.partial(fp8_ops.Fp8DirectDotGeneralOp, amax_history_length=4)
            ln = nn.LayerNorm(epsilon=1e-6, name="ln")(x)
            return nn.DenseGeneral((2, 8), use_bias=True, dot_general_cls=op, name="dense")(ln)

    ours = LayerNormDenseGeneral((2, 8), use_bias=True)
    twin = Fp8Twin()
    x, y = rand((4, 6, H), 20, 2.0), rand((4, 6, 2, 8), 21)
    with fp8jax.autocast(enabled=True, recipe=RECIPE):
        v = ours.init(jax.random.key(0), x)
    v = {**v, "params": {**v["params"], "bias": rand((2, 8), 22, 0.1)}}
    ow = fp8_ops.OVERWRITE_WITH_GRADIENT
    tv = {"params": _twin_params(v["params"]), ow: twin.init(jax.random.key(0), x)[ow]}

    @jax.jit
    def step(v):
        def loss(p, probes):
            with fp8jax.autocast(enabled=True, recipe=RECIPE):
                out, _ = ours.apply({"params": p, "fp8_meta": v["fp8_meta"],
                                     "fp8_probe": probes}, x)  # fmt: skip
            return jnp.mean((out - y) ** 2)

        value, (g, pg) = jax.value_and_grad(loss, argnums=(0, 1))(v["params"], v["fp8_probe"])
        params = jax.tree.map(lambda p, g: p - 0.1 * g, v["params"], g)
        meta = update_fp8_variables(v["fp8_meta"], pg, RECIPE)
        return {"params": params, "fp8_meta": meta, "fp8_probe": v["fp8_probe"]}, value

    @jax.jit
    def tstep(tv):
        value, g = jax.value_and_grad(lambda tv: jnp.mean((twin.apply(tv, x) - y) ** 2))(tv)
        params = jax.tree.map(lambda p, g: p - 0.1 * g, tv["params"], g["params"])
        return {"params": params, ow: g[ow]}, value

    for _ in range(5):
        v, loss = step(v)
        tv, tloss = tstep(tv)
        np.testing.assert_allclose(float(loss), float(tloss), rtol=2e-3)
    for a, b in zip(jax.tree.leaves(_twin_params(v["params"])), jax.tree.leaves(tv["params"]),
                    strict=True):  # fmt: skip
        assert _rel(a, b) < 2e-3
    (op,) = tv[ow]["dense"].values()
    fmax = {"input": 448.0, "kernel": 448.0, "output_grad": 57344.0}
    theirs = [fmax[r] / float(jnp.max(op[f"{r}_amax_history"])) for r in fmax]
    np.testing.assert_allclose(np.asarray(v["fp8_meta"]["scale"]), theirs, rtol=2e-3)
