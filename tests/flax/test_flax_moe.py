"""fp8jax.flax.MoEBlock (and TransformerLayer(mlp="moe")): FP8 off it is its plain-Flax twin
(tests/flax/_moe_twin.py, ``jax.lax.ragged_dot``) bit for bit, values and gradients; FP8 on it is
close to it under every recipe and trains with delayed scaling (one state row per expert and
tensor); bad configurations are refused by name."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _moe_twin import PlainMoE
from _shared import rand

import fp8jax
from fp8jax.flax import Fp8TrainState, LayerNormMLP, MoEBlock, TransformerLayer
from fp8jax.layers import MoEBlockConfig

pytestmark = pytest.mark.usefixtures("float32_matmuls")

RECIPES = {
    "delayed": fp8jax.DelayedScaling(amax_history_len=4),
    "current": fp8jax.Float8CurrentScaling(),
    "block": fp8jax.Float8BlockScaling(),
    "mxfp8": fp8jax.MXFP8BlockScaling(),
    "rowwise": fp8jax.Float8RowwiseScaling(),
}
CONFIGS = {
    "softmax": dict(),
    "sigmoid-bias-ffn-bias": dict(
        score_function="sigmoid", use_expert_routing_bias=True, use_ffn_bias=True
    ),
    "gelu-top1": dict(activation_type="gelu", num_experts_per_tok=1),
}
X = rand((2, 12, 16), 0)


def _block(**kw):
    return MoEBlock(
        num_experts=4,
        num_experts_per_tok=kw.pop("num_experts_per_tok", 2),
        intermediate_size=8,
        **kw,
    )


def _twin_of(block):
    return PlainMoE(
        block.num_experts,
        block.num_experts_per_tok,
        block.intermediate_size,
        block.activation_type,
        block.score_function,
        block.use_expert_routing_bias,
        block.use_ffn_bias,
    )


def _randomised(params, seed=1):
    """Non-zero biases, so that they count."""
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(
        tree,
        [
            v + 0.1 * jax.random.normal(k, v.shape, v.dtype)
            for v, k in zip(leaves, keys, strict=True)
        ],
    )


@pytest.mark.parametrize("name", list(CONFIGS))
def test_fp8_off_is_the_plain_flax_twin_values_and_gradients(name):
    block = _block(**CONFIGS[name])
    params = _randomised(block.init(jax.random.key(0), X)["params"])
    twin = _twin_of(block)
    out, aux = block.apply({"params": params}, X)
    assert aux is None
    np.testing.assert_array_equal(out, twin.apply({"params": params}, X))
    c = rand(X.shape, 5)
    g = jax.grad(lambda p, x: jnp.sum(block.apply({"params": p}, x)[0] * c), (0, 1))(params, X)
    gt = jax.grad(lambda p, x: jnp.sum(twin.apply({"params": p}, x) * c), (0, 1))(params, X)
    jax.tree.map(np.testing.assert_array_equal, g, gt)


def test_params_are_tes_names_and_each_expert_its_own_draw():
    block = _block(use_ffn_bias=True, score_function="sigmoid", use_expert_routing_bias=True)
    p = block.init(jax.random.key(0), X)["params"]
    assert jax.tree.map(jnp.shape, p) == {
        "gate_kernel": (16, 4),
        "wi_0": (4, 16, 8),
        "wi_1": (4, 16, 8),
        "wo": (4, 8, 16),
        "wi_0_bias": (4, 8),
        "wi_1_bias": (4, 8),
        "wo_bias": (4, 16),
        "expert_bias": (4,),
    }
    # variance_scaling(1, fan_in) per expert: each expert's std is about 1 / sqrt(hidden)
    std = np.asarray(p["wi_0"]).reshape(4, -1).std(axis=1)
    assert np.all((std > 0.15) & (std < 0.4)), std
    assert not np.allclose(p["wi_0"][0], p["wi_0"][1])


def test_shared_experts_add_a_gated_mlp_on_the_same_input():
    block = _block(shared_expert_intermediate_size=6)
    variables = block.init(jax.random.key(0), X)
    params = variables["params"]
    assert params["shared_experts"]["wi_kernel"].shape == (16, 2, 6)
    routed = {k: v for k, v in params.items() if k != "shared_experts"}
    out, _ = block.apply({"params": params}, X)
    plain, _ = _block().apply({"params": routed}, X)
    mlp = LayerNormMLP(
        intermediate_dim=6,
        enable_layernorm=False,
        activations=("silu", "linear"),
        intermediate_dropout_rate=0.0,
    )
    shared, _ = mlp.apply({"params": params["shared_experts"]}, X, deterministic=True)
    np.testing.assert_array_equal(out, plain + shared)


@pytest.mark.parametrize("name", list(RECIPES))
def test_fp8_is_close_to_fp8_off_under_every_recipe(name):
    block = _block()
    recipe = RECIPES[name]
    with fp8jax.autocast(enabled=True, recipe=recipe):
        variables = block.init(jax.random.key(0), X)
    if name == "delayed":
        assert variables["fp8_meta"]["scale"].shape == (24,)  # 2 GEMMs x 4 experts x 3 roles
        meta = fp8jax.flax.calibrate(block.apply, variables, [X], recipe=recipe)
        variables = {**variables, "fp8_meta": meta}
    else:
        assert "fp8_meta" not in variables
    off, _ = block.apply({"params": variables["params"]}, X)
    with fp8jax.autocast(enabled=True, recipe=recipe):
        on, _ = block.apply(variables, X)
    err = float(jnp.linalg.norm(on - off))
    assert 0 < err <= 0.15 * float(jnp.linalg.norm(off))


def test_trains_with_delayed_scaling_and_updates_each_experts_state():
    block = _block(aux_loss_coeff=0.01, z_loss_coeff=1e-3)
    recipe = RECIPES["delayed"]
    y = rand(X.shape, 7)
    with fp8jax.autocast(enabled=True, recipe=recipe):
        variables = block.init(jax.random.key(0), X)
    state = Fp8TrainState.from_variables(
        apply_fn=block.apply, variables=variables, tx=optax.adam(3e-2), recipe=recipe
    )

    @jax.jit
    def step(state):
        def loss(params, probes):
            with fp8jax.autocast(enabled=True, recipe=recipe):
                out, aux = block.apply(
                    {"params": params, "fp8_meta": state.fp8_meta, "fp8_probe": probes}, X
                )
            return jnp.mean((out - y) ** 2) + aux

        value, (g, pg) = jax.value_and_grad(loss, (0, 1))(state.params, state.fp8_probe)
        return state.apply_gradients(grads=g, probe_grads=pg, recipe=recipe), value

    losses = []
    for _ in range(6):
        state, value = step(state)
        losses.append(float(value))
    assert losses[-1] < losses[0]
    scale = np.asarray(state.fp8_meta["scale"]).reshape(2, 4, 3)
    assert np.all(scale[:, :, 1] != 1.0)  # every expert's kernel has its own scale
    assert len(set(scale[0, :, 1].tolist())) == 4


def test_losses_are_returned_and_sown():
    block = _block(aux_loss_coeff=0.01, z_loss_coeff=1e-3)
    params = block.init(jax.random.key(0), X)["params"]
    (_out, aux), sown = block.apply({"params": params}, X, mutable=["intermediates"])
    inter = sown["intermediates"]
    np.testing.assert_allclose(aux, inter["aux_loss"][0] + inter["z_loss"][0], rtol=1e-6)
    assert float(inter["aux_loss"][0]) > 0 and float(inter["z_loss"][0]) > 0


def test_transformer_layer_with_an_moe_mlp():
    moe = MoEBlockConfig(
        num_experts=4, num_experts_per_tok=2, intermediate_size=8, aux_loss_coeff=0.01
    )
    layer = TransformerLayer(
        hidden_size=16,
        num_attention_heads=2,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        mlp="moe",
        moe=moe,
        logical_axes=True,
    )
    with fp8jax.autocast(enabled=True, recipe=RECIPES["delayed"]):
        variables = layer.init(jax.random.key(0), X, deterministic=True)
        y, sown = layer.apply(variables, X, deterministic=True, mutable=["intermediates"])
    p = variables["params"]["mlp"]
    assert {"scale", "ln_bias", "gate_kernel", "wi_0", "wi_1", "wo"} <= set(p)
    assert p["wi_0"].names == ("exp", "embed", "mlp")
    assert variables["fp8_meta"]["mlp"]["scale"].shape == (24,)
    assert y.shape == X.shape and np.isfinite(np.asarray(y)).all()
    assert float(sown["intermediates"]["mlp"]["aux_loss"][0]) > 0


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        (dict(num_experts_per_tok=5), "num_experts_per_tok=5 must be at most num_experts=4"),
        (dict(activation_type="tanh"), "activation_type must be one of"),
        (dict(score_function="relu"), "score_function must be 'softmax' or 'sigmoid'"),
        (dict(num_groups=2), "set both num_groups and group_topk"),
        (dict(num_groups=3, group_topk=1), "group-limited routing needs num_groups=3"),
        (dict(use_expert_routing_bias=True), "use_expert_routing_bias needs"),
        (dict(capacity_factor=0.0), "capacity_factor must be None or a float > 0"),
        (dict(aux_loss_coeff=-1.0), "aux_loss_coeff must be a float >= 0"),
        (dict(shared_expert_intermediate_size=-2), "shared_expert_intermediate_size"),
    ],
)
def test_bad_configurations_are_refused_by_name(kw, match):
    with pytest.raises(ValueError, match=match):
        _block(**kw).init(jax.random.key(0), X)


def test_bad_inputs_and_transformer_options_are_refused():
    with pytest.raises(TypeError, match="inputs must be a floating-point array"):
        _block().init(jax.random.key(0), jnp.ones((2, 16), jnp.int32))
    for kw, match in (
        (dict(mlp="moe", apply_residual_connection_post_layernorm=True), "post_layernorm"),
        (dict(mlp="moe", intermediate_dropout=0.1), "no intermediate dropout"),
        (dict(mlp="sparse"), "mlp must be 'dense' or 'moe'"),
        (dict(moe=MoEBlockConfig()), "pass mlp='moe'"),
    ):
        layer = TransformerLayer(hidden_size=16, num_attention_heads=2, **kw)
        with pytest.raises(ValueError, match=match):
            layer.init(jax.random.key(0), X, deterministic=True)
