"""fp8jax.nnx modules against their Linen twins (same key: same params; same forward, FP8 on
and off) and against plain flax.nnx layers with FP8 off; constructor and call errors."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _nnx import RECIPE, TRANSFORMER, assert_trees_equal, float32_matmuls  # noqa: F401
from _shared import rand
from flax import nnx

import fp8jax
from fp8jax import DelayedScaling, Float8CurrentScaling
from fp8jax import flax as fflax
from fp8jax import nnx as fnnx
from fp8jax.nnx.variables import pure

# (name, NNX constructor, Linen twin, sample input, call kwargs)
CASES = [
    ("dense", lambda r: fnnx.DenseGeneral(8, 4, rngs=r), fflax.DenseGeneral(features=4),
     (4, 8), {}),
    ("dense_axes", lambda r: fnnx.DenseGeneral((3, 8), (2, 4), axis=(-2, -1), rngs=r),
     fflax.DenseGeneral(features=(2, 4), axis=(-2, -1)), (5, 3, 8), {}),
    ("layernorm", lambda r: fnnx.LayerNorm(8, layernorm_type="rmsnorm", rngs=r),
     fflax.LayerNorm(layernorm_type="rmsnorm"), (4, 8), {}),
    ("ln_dense", lambda r: fnnx.LayerNormDenseGeneral(8, 6, use_bias=True, rngs=r),
     fflax.LayerNormDenseGeneral(features=6, use_bias=True), (4, 8), {}),
    ("mlp", lambda r: fnnx.LayerNormMLP(8, intermediate_dim=16, activations=("silu", "linear"),
                                        intermediate_dropout_rate=0.0, rngs=r),
     fflax.LayerNormMLP(intermediate_dim=16, activations=("silu", "linear"),
                        intermediate_dropout_rate=0.0), (4, 8), {"deterministic": True}),
    ("mha", lambda r: fnnx.MultiHeadAttention(16, head_dim=8, num_attention_heads=2,
                                              transpose_batch_sequence=False, rngs=r),
     fflax.MultiHeadAttention(head_dim=8, num_attention_heads=2,
                              transpose_batch_sequence=False), (2, 4, 16), {}),
    ("transformer", lambda r: fnnx.TransformerLayer(**TRANSFORMER, rngs=r),
     fflax.TransformerLayer(**TRANSFORMER), (2, 4, 16), {"deterministic": True}),
]  # fmt: skip


def _linen_apply(linen, name, variables, x, kwargs):
    if name == "mha":
        return linen.apply(variables, x, x, **kwargs)
    return linen.apply(variables, x, **kwargs)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize(
    ("name", "make", "linen", "shape", "kwargs"), CASES, ids=[c[0] for c in CASES]
)
def test_same_params_and_outputs_as_the_linen_twin(name, make, linen, shape, kwargs, fp8):
    x = rand(shape, 0)
    key = nnx.Rngs(0).params()  # what the NNX constructor draws first
    with fp8jax.autocast(enabled=fp8, recipe=RECIPE):
        model = make(nnx.Rngs(0))
        variables = linen.init(key, *([x, x] if name == "mha" else [x]), **kwargs)
        want = _linen_apply(linen, name, variables, x, kwargs)
        got = model(x, **kwargs)
    assert_trees_equal(model.linen_variables()["params"], nn.unbox(variables["params"]))
    assert_trees_equal(got, want)
    has_state = fp8 and name != "layernorm"
    assert bool(pure(model, fnnx.Fp8MetaVariable)) == has_state
    assert model.recipe == (RECIPE if has_state else None)
    if has_state:
        assert_trees_equal(model.linen_variables()["fp8_meta"], variables["fp8_meta"])


def test_dense_is_nnx_linear_general_with_fp8_off():
    model = fnnx.DenseGeneral(8, 4, rngs=nnx.Rngs(0))
    twin = nnx.LinearGeneral(8, 4, rngs=nnx.Rngs(1))
    twin.kernel[...] = model.kernel[...]
    twin.bias[...] = model.bias[...]
    x = rand((4, 8), 1)
    assert_trees_equal(model(x), twin(x))
    assert model.kernel.shape == (8, 4) and model.in_features == (8,)


def test_layernorm_is_nnx_layernorm_with_fp8_off():
    model = fnnx.LayerNorm(8, epsilon=1e-5, rngs=nnx.Rngs(0))
    twin = nnx.LayerNorm(8, epsilon=1e-5, rngs=nnx.Rngs(0))
    x = rand((4, 8), 2) * 3 + 1
    assert_trees_equal(model(x), twin(x))
    assert set(pure(model, nnx.Param)) == {"scale", "ln_bias"}


def test_fp8_state_layout_and_filters():
    with fp8jax.autocast(enabled=True, recipe=RECIPE):
        model = fnnx.LayerNormMLP(8, intermediate_dim=16, rngs=nnx.Rngs(0))
    meta = pure(model, fnnx.Fp8MetaVariable)
    assert jax.tree.map(jnp.shape, meta) == {"fp8_meta": {"amax_history": (6, 4), "scale": (6,)}}
    probes = pure(model, fnnx.Fp8Probe)
    assert jax.tree.map(jnp.shape, probes) == {"fp8_probe": {"call_0": (6,)}}
    params = pure(model, nnx.Param)
    assert "fp8_meta" not in params and "fp8_probe" not in params
    np.testing.assert_array_equal(model.fp8_meta.scale[...], np.ones(6, np.float32))


def test_current_scaling_needs_no_state():
    with fp8jax.autocast(enabled=True, recipe=Float8CurrentScaling()):
        model = fnnx.DenseGeneral(8, 4, rngs=nnx.Rngs(0))
        y = model(rand((4, 8), 3))
    assert y.shape == (4, 4) and model.recipe is None
    assert not pure(model, nnx.Any(fnnx.Fp8MetaVariable, fnnx.Fp8Probe))


def test_logical_axes_become_nnx_sharding_metadata():
    model = fnnx.DenseGeneral(8, 4, kernel_axes=("embed", "mlp"), bias_axes=("mlp",),
                              rngs=nnx.Rngs(0))  # fmt: skip
    assert model.kernel.get_metadata()["out_sharding"] == ("embed", "mlp")
    with nn.logical_axis_rules(fflax.DEFAULT_RULES):
        specs = nnx.get_partition_spec(nnx.state(model))
    assert specs["kernel"].get_value() == jax.sharding.PartitionSpec(None, "model")
    assert specs["bias"].get_value() == jax.sharding.PartitionSpec("model")
    with fp8jax.autocast(enabled=True, recipe=RECIPE):
        layer = fnnx.TransformerLayer(**TRANSFORMER, logical_axes=True, rngs=nnx.Rngs(0))
    assert layer.mlp.wi_kernel.get_metadata()["out_sharding"] == ("embed", "act", "mlp")
    assert "out_sharding" not in layer.mlp.fp8_meta.scale.get_metadata()


def test_dropout_follows_eval_and_train():
    model = fnnx.LayerNormMLP(8, intermediate_dim=64, intermediate_dropout_rate=0.5,
                              rngs=nnx.Rngs(0, dropout=1))  # fmt: skip
    x = rand((4, 8), 4)
    a, b = model(x)[0], model(x)[0]
    assert not np.array_equal(a, b)  # a new dropout key per call
    model.eval()
    assert model.deterministic is True
    assert_trees_equal(model(x)[0], model(x)[0])
    model.train()
    c = model(x, rngs=nnx.Rngs(dropout=7))[0]
    d = model(x, rngs=jax.random.key(7))[0]
    assert c.shape == d.shape == (4, 8)
    assert_trees_equal(model(x, deterministic=True)[0], model(x, deterministic=True)[0])


def test_linen_checkpoint_round_trip():
    with fp8jax.autocast(enabled=True, recipe=RECIPE):
        a = fnnx.TransformerLayer(**TRANSFORMER, rngs=nnx.Rngs(0))
        b = fnnx.TransformerLayer(**TRANSFORMER, rngs=nnx.Rngs(1))
    variables = a.linen_variables()
    assert set(variables) == {"params", "fp8_meta", "fp8_probe"}
    variables["fp8_meta"]["mlp"]["scale"] = variables["fp8_meta"]["mlp"]["scale"] * 2
    b.load_linen_variables(variables)
    assert_trees_equal(b.linen_variables(), variables)
    with pytest.raises(ValueError, match="structure/shapes"):
        b.load_linen_variables({"params": {"kernel": jnp.zeros(3)}})
    with pytest.raises(ValueError, match="holding 'params'"):
        b.load_linen_variables({})


def test_errors_name_the_argument():
    with pytest.raises(TypeError, match=r"rngs must be a flax\.nnx\.Rngs"):
        fnnx.DenseGeneral(8, 4, rngs=0)
    with pytest.raises(TypeError, match="unexpected keyword argument 'featurez'"):
        fnnx.LayerNormMLP(8, featurez=3, rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="unexpected keyword argument 'features'"):
        fnnx.LayerNormDenseGeneral(8, 4, features=3, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="in_features must be a positive int"):
        fnnx.DenseGeneral(0, 4, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="out_features must be a positive int"):
        fnnx.LayerNormDenseGeneral(8, -1, rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"axis=.* names 2 dims but in_features has 1"):
        fnnx.DenseGeneral(8, 4, axis=(0, 1), rngs=nnx.Rngs(0))
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        fnnx.LayerNormMLP(8, deterministic=1, rngs=nnx.Rngs(0))


def test_call_errors():
    model = fnnx.DenseGeneral(8, 4, rngs=nnx.Rngs(0))  # no FP8 state
    with (
        fp8jax.autocast(enabled=True, recipe=RECIPE),
        pytest.raises(ValueError, match=r"construct it inside fp8jax\.autocast"),
    ):
        model(rand((2, 8), 5))
    with fp8jax.autocast(enabled=True, recipe=RECIPE):
        stated = fnnx.DenseGeneral(8, 4, rngs=nnx.Rngs(0))
    other = DelayedScaling(amax_history_len=8)
    with (
        fp8jax.autocast(enabled=True, recipe=other),
        pytest.raises(ValueError, match="the recipe is stated once"),
    ):
        stated(rand((2, 8), 5))
    with fp8jax.autocast(enabled=True, recipe=RECIPE):
        mha = fnnx.MultiHeadAttention(16, head_dim=8, num_attention_heads=2, rngs=nnx.Rngs(0))
        cross = fnnx.MultiHeadAttention(16, head_dim=8, num_attention_heads=2, kv_features=8,
                                        rngs=nnx.Rngs(0))  # fmt: skip
    x = rand((4, 2, 16), 6)
    with pytest.raises(ValueError, match="built for self-attention"):
        mha(x, rand((4, 2, 16), 7), deterministic=True)
    with pytest.raises(ValueError, match="built for cross-attention"):
        cross(x, deterministic=True)
    assert cross(x, rand((4, 3, 8), 8), deterministic=True)[0].shape == x.shape
    assert mha(x, x, deterministic=True)[0].shape == x.shape
    with pytest.raises(TypeError, match="deterministic must be a bool or None"):
        mha(x, deterministic="yes")


def test_decoder_layer():
    cfg = {**TRANSFORMER, "layer_type": fflax.TransformerLayerType.DECODER}
    with fp8jax.autocast(enabled=True, recipe=RECIPE):
        layer = fnnx.TransformerLayer(**cfg, rngs=nnx.Rngs(0))
        x, enc = rand((2, 4, 16), 9), rand((2, 6, 16), 10)
        variables = fflax.TransformerLayer(**cfg).init(
            nnx.Rngs(0).params(), x, enc, deterministic=True
        )
        want = fflax.TransformerLayer(**cfg).apply(variables, x, enc, deterministic=True)
        got = layer(x, enc, deterministic=True)
    assert_trees_equal(got, want)
    assert hasattr(layer, "encoder_decoder_attention")
