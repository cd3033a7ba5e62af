"""Issue 46's reproducers on meshes, each as its user wrote it (the matrix,
test_mesh_matrix.py, covers the layers more widely): explicit-axis meshes from
``jax.make_mesh`` (an MoE block placed by fp8jax itself, a fused-QKV kernel split on its heads,
a TransformerLayer with FP8 off) and expert parallelism through the modules under every recipe,
jitted or not, and in NNX under ``DEFAULT_RULES``."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _shared import make_mesh, rand
from conftest import needs_devices
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import fp8jax
from fp8jax.flax import DEFAULT_RULES, Fp8TrainState, MoEBlock
from fp8jax.layers import MoEBlockConfig

pytestmark = needs_devices(8)

RECIPES = {
    "off": None,
    "delayed": fp8jax.DelayedScaling(amax_history_len=4),
    "current": fp8jax.Float8CurrentScaling(),
    "block": fp8jax.Float8BlockScaling(),
    "mxfp8": fp8jax.MXFP8BlockScaling(),
}


def _autocast(name):
    return fp8jax.autocast(enabled=RECIPES[name] is not None, recipe=RECIPES[name])


def _moe(**kw):
    return MoEBlock(num_experts=8, num_experts_per_tok=2, intermediate_size=128, **kw)


@pytest.mark.parametrize("recipe", ["off", "delayed"])
def test_moe_block_on_make_mesh_places_its_tokens_and_experts_itself(recipe):
    """Was: ``in_specs passed to shard_map: P('expert', None) does not match the specs of the
    input: P(None, None)`` unless the user sharded tokens and params by hand; the output is laid
    out as the input."""
    mesh = make_mesh((8,), names=("expert",), explicit=True)
    x = rand((64, 128), 0)
    with _autocast(recipe):
        want, _ = _moe().apply(_moe().init(jax.random.key(0), x), x)
    with jax.set_mesh(mesh), _autocast(recipe):
        variables = jax.jit(_moe(expert_axis="expert").init)(jax.random.key(0), x)
        out, _ = jax.jit(_moe(expert_axis="expert").apply)(variables, x)
    assert jax.typeof(out).sharding.spec == jax.typeof(x).sharding.spec
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("layer", "recipe", "gemm"),
    [
        ("dense", "off", "kernel"),
        ("dense", "delayed", "kernel"),
        ("layernorm_dense", "current", "kernel"),
        ("layernorm_dense", "block", "kernel"),
        ("layernorm_dense", "delayed", "xla"),
    ],
)
def test_fused_qkv_kernel_split_on_its_heads_trains_on_make_mesh(layer, recipe, gemm):
    """Was: ``ShardingTypeError: This reshape is not supported`` ((hidden, 3, heads) merged into
    (hidden, 3 * heads) with heads split): DenseGeneral always, LayerNormDenseGeneral under
    current and block scaling and the XLA GEMM."""
    cls = fp8jax.flax.DenseGeneral if layer == "dense" else fp8jax.flax.LayerNormDenseGeneral
    module = cls(features=(3, 256), kernel_axes=("embed", None, "heads"))
    rules = (("batch", "data"), ("embed", None), ("heads", "model"))
    mesh = make_mesh((2, 4), explicit=True)
    x = rand((256, 128), 1)
    with _autocast(recipe):
        boxed = module.init(jax.random.key(0), x)
    variables = nn.unbox(boxed)

    def loss(variables, x):
        with _autocast(recipe), fp8jax.ops.implementation(gemm=gemm):
            y = module.apply(variables, x)
        return jnp.sum(jnp.tanh(y[0] if isinstance(y, tuple) else y))

    want = jax.jit(jax.grad(loss))(variables, x)
    with nn.logical_axis_rules(rules):
        shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh, rules)
    placed = jax.device_put(variables, shardings)
    assert placed["params"]["kernel"].sharding.spec == P(None, None, "model")
    with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
        got = jax.jit(jax.grad(loss))(placed, jax.device_put(x, NamedSharding(mesh, P("data"))))
    assert got["params"]["kernel"].sharding.spec == P(None, None, "model")
    tol = 1e-5 if recipe == "off" else 2e-2  # float32 order; FP8 codes at a tie
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert np.linalg.norm(np.asarray(g) - w) <= tol * np.linalg.norm(w)


def test_transformer_layer_with_fp8_off_trains_on_make_mesh():
    """Was: "Contracting dimensions are sharded and it is ambiguous how the output should be
    sharded" (LayerNormMLP's high-precision second GEMM, row parallel)."""
    layer = fp8jax.flax.TransformerLayer(
        hidden_size=64, mlp_hidden_size=128, num_attention_heads=4, logical_axes=True,
        hidden_dropout=0.0, attention_dropout=0.0, intermediate_dropout=0.0,
    )  # fmt: skip
    mesh = make_mesh((2, 4), explicit=True)
    x = rand((4, 8, 64), 2)
    boxed = layer.init(jax.random.key(0), x, deterministic=True)
    variables = nn.unbox(boxed)
    loss = lambda v, x: jnp.sum(layer.apply(v, x, deterministic=True) ** 2)
    want = jax.jit(jax.grad(loss))(variables, x)
    with nn.logical_axis_rules(DEFAULT_RULES):
        shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(boxed), mesh)
    placed = jax.device_put(variables, shardings)
    with jax.set_mesh(mesh), nn.logical_axis_rules(DEFAULT_RULES):
        got = jax.jit(jax.grad(loss))(placed, jax.device_put(x, NamedSharding(mesh, P("data"))))
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert np.linalg.norm(np.asarray(g) - w) <= 1e-5 * np.linalg.norm(w)  # float32 order


@pytest.mark.parametrize("recipe", ["current", "block", "mxfp8"])
def test_moe_block_trains_with_expert_parallelism_under_stateless_recipes(recipe):
    """Was: "Custom VJP bwd rule must produce an output with the same type ... manual axis
    types do not match" (the module, not the functional moe with a probe)."""
    mesh = make_mesh((8,), names=("expert",))
    x = rand((256, 128), 3)
    variables = _moe().init(jax.random.key(0), x)

    def loss(module):
        def fn(params, x):
            with _autocast(recipe):
                return jnp.sum(jnp.tanh(module.apply({"params": params}, x)[0]))

        return fn

    want = jax.jit(jax.grad(loss(_moe())))(variables["params"], x)
    with jax.set_mesh(mesh):
        got = jax.jit(jax.grad(loss(_moe(expert_axis="expert"))))(variables["params"], x)
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        assert np.linalg.norm(np.asarray(g) - w) <= 1e-2 * max(np.linalg.norm(w), 1e-30)


@pytest.mark.parametrize("recipe", ["delayed", "current"])
def test_expert_parallel_init_and_apply_run_without_jit(recipe):
    """Was: "custom_vjp symbolic_zeros support with shard_map is not implemented" on an eager
    init/apply, Fp8TrainState.from_model under jax.set_mesh included (the start of a run)."""
    mesh = make_mesh((8,), names=("expert",))
    x = rand((64, 128), 4)
    module = _moe(expert_axis="expert")
    with jax.set_mesh(mesh):
        state = Fp8TrainState.from_model(
            module, jax.random.key(0), x, tx=optax.sgd(0.1), recipe=RECIPES[recipe]
        )
        with _autocast(recipe):
            out, _ = module.apply(state.variables(), x)
    with _autocast(recipe):
        want, _ = _moe().apply(state.variables(), x)
    np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-6)


def test_nnx_moe_transformer_layer_is_sharded_under_default_rules():
    """Was: "Resource axis: exp ... is not found in mesh" (DEFAULT_RULES had no rule for the
    experts' axis name)."""
    mesh = make_mesh((2, 4))
    moe = MoEBlockConfig(num_experts=4, num_experts_per_tok=2, intermediate_size=32)
    with jax.set_mesh(mesh), nn.logical_axis_rules(DEFAULT_RULES):
        layer = fp8jax.nnx.TransformerLayer(
            64, mlp_hidden_size=128, num_attention_heads=4, logical_axes=True, mlp="moe",
            moe=moe, hidden_dropout=0.0, attention_dropout=0.0, intermediate_dropout=0.0,
            rngs=nnx.Rngs(0),
        )  # fmt: skip
        y = nnx.jit(lambda m, x: m(x, deterministic=True))(layer, rand((4, 8, 64), 5))
        assert layer.mlp.wi_0[...].sharding.spec == P(None, None, "model")
    assert y.shape == (4, 8, 64)


def test_linen_init_under_make_mesh_and_the_rules_gives_sharded_params():
    """Under explicit axes Flax's unboxing constrains each boxed param (which only asserts
    there) and the layers constrain their inputs: both are laid out instead, so ``init`` inside
    ``jax.set_mesh`` and the rules gives params split as the rules say."""
    layer = fp8jax.flax.TransformerLayer(
        hidden_size=64, mlp_hidden_size=128, num_attention_heads=4, logical_axes=True,
    )  # fmt: skip
    mesh = make_mesh((2, 4), explicit=True)
    x = rand((4, 8, 64), 6)  # not placed: the layer lays its input out
    with jax.set_mesh(mesh), nn.logical_axis_rules(DEFAULT_RULES), _autocast("delayed"):
        variables = jax.jit(lambda k, x: layer.init(k, x, deterministic=True))(jax.random.key(0), x)
    params = nn.unbox(variables)["params"]
    assert params["mlp"]["wi_kernel"].sharding.spec == P(None, None, "model")
    assert params["mlp"]["wo_kernel"].sharding.spec == P("model", None)
    assert params["attention"]["qkv"]["kernel"].sharding.spec[-1] == "model"
