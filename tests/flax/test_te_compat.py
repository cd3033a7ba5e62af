"""TransformerEngine compatibility of the Linen modules: today's TE defaults, TE's arguments
(off values accepted, on values refused by name), and self-attention without object identity.

TE_DEFAULTS is read off TransformerEngine v2.18 (transformer_engine/jax/flax/module.py and
transformer.py): every field listed there has TE's default here too. docs/porting-from-te.md
lists the differences kept on purpose (``dtype`` is Flax's computation dtype, logical axis
names are opt-in, ...), which are therefore not in this table.
"""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _shared import rand

import fp8jax
from fp8jax.flax import (
    DenseGeneral,
    DotProductAttention,
    LayerNorm,
    LayerNormDenseGeneral,
    LayerNormMLP,
    MultiHeadAttention,
    TransformerLayer,
    TransformerLayerType,
)
from fp8jax.layers.checks import OFF

_LORA = dict(
    enable_low_rank_adaptation=False, low_rank_adaptation_dim=32, low_rank_adaptation_alpha=None
)
_ATTN = dict(softmax_type="vanilla", score_mod=None, score_mod_bprop=None)

TE_DEFAULTS = {
    DenseGeneral: dict(
        use_bias=True, kernel_axes=(), bias_axes=(), axis=-1, input_axes=(),
        transpose_batch_sequence=False, quantization_checkpoint_name=None, **_LORA,
    ),
    LayerNorm: dict(epsilon=1e-6, layernorm_type="layernorm", zero_centered_gamma=False,
                    scale_init=None),
    LayerNormDenseGeneral: dict(
        enable_layernorm=True, layernorm_type="layernorm", epsilon=1e-6,
        zero_centered_gamma=False, scale_init=None, kernel_init=None, kernel_axes=(),
        use_bias=False, bias_axes=(), return_layernorm_output=False, axis=-1,
        depth_scaling=None, transpose_batch_sequence=False, quantization_checkpoint_name=None,
        **_LORA,
    ),
    LayerNormMLP: dict(
        intermediate_dim=2048, enable_layernorm=True, layernorm_type="layernorm", epsilon=1e-6,
        zero_centered_gamma=False, scale_init=None, kernel_init=None, use_bias=False,
        return_layernorm_output=False, activations=("gelu",), activation_params=None,
        intermediate_dropout_rng_name="dropout", intermediate_dropout_rate=0.0,
        intermediate_hidden_dropout_dims=(), axis=-1, dot_1_input_axes=None,
        dot_2_input_axes=None, ffn1_ckpt_name="ffn1", ffn2_ckpt_name="ffn2",
        transpose_batch_sequence=False, quantization_checkpoint_name=None, **_LORA,
    ),
    DotProductAttention: dict(
        num_gqa_groups=None, attention_dropout=0.0, attn_mask_type="causal",
        attn_bias_type=None, dtype=None, dropout_rng_name="dropout", float32_logits=False,
        qkv_layout="bshd_bshd_bshd", scale_factor=None, transpose_batch_sequence=False,
        window_size=None, max_segments_per_seq=1, context_parallel_causal_load_balanced=False,
        context_parallel_axis="", context_parallel_strategy="DEFAULT",
        context_checkpoint_name="context", **_ATTN,
    ),
    MultiHeadAttention: dict(
        num_gqa_groups=None, attention_dropout=0.0, dropout_rng_name="dropout",
        input_layernorm=True, layernorm_type="layernorm", layernorm_epsilon=1e-6,
        return_layernorm_output=False, zero_centered_gamma=False, kernel_init=None,
        use_bias=False, attn_mask_type="causal", attn_bias_type=None,
        enable_rotary_pos_emb=False, rotary_pos_emb_windows=(1, 10000),
        rotary_pos_emb_group_method="consecutive", low_rank_adaptation_scope="none",
        low_rank_adaptation_dim=32, low_rank_adaptation_alpha=None, fuse_qkv_params=True,
        transpose_batch_sequence=False, enable_sequence_parallel=False,
        scale_attn_logits=False, scaled_query_init=True, float32_logits=False,
        window_size=None, num_heads=None, dropout_rate=None, output_layernorm=None,
        apply_residual_connection_post_layernorm=None, fuse_qkv=None, **_ATTN,
    ),
    TransformerLayer: dict(
        hidden_size=512, mlp_hidden_size=2048, num_attention_heads=8, num_gqa_groups=None,
        layernorm_type="layernorm", layernorm_epsilon=1e-6, zero_centered_gamma=False,
        hidden_dropout=0.1, hidden_dropout_dims=(), attention_dropout=0.1,
        intermediate_dropout=0.0, intermediate_dropout_dims=(), dropout_rng_name="dropout",
        mha_kernel_init=None, mlp_kernel_init=None, mlp_activations=("gelu",),
        mlp_activation_params=None, use_bias=False,
        apply_residual_connection_post_layernorm=False, output_layernorm=False,
        float32_attention_logits=False, layer_type=TransformerLayerType.ENCODER,
        self_attn_mask_type="causal", self_attn_bias_type=None,
        enable_relative_embedding=True, relative_embedding=None, enable_rotary_pos_emb=False,
        rotary_pos_emb_windows=(1, 10000), rotary_pos_emb_group_method="consecutive",
        low_rank_adaptation_scope="none", low_rank_adaptation_dim=32,
        low_rank_adaptation_alpha=None, drop_path=0.0, fuse_qkv_params=True,
        transpose_batch_sequence=False, enable_sequence_parallel=False,
        scale_attn_logits=False, scaled_query_init=True, window_size=None, **_ATTN,
    ),
}  # fmt: skip


@pytest.mark.parametrize("module", list(TE_DEFAULTS), ids=lambda m: m.__name__)
def test_defaults_are_te_v2_18(module):
    defaults = {f.name: f.default for f in dataclasses.fields(module)}
    for name, te_default in TE_DEFAULTS[module].items():
        assert name in defaults, f"{module.__name__} lacks TE's argument {name}"
        assert defaults[name] == te_default, (name, defaults[name], te_default)


# Each module with the TE arguments it accepts only at their off value, and how to run it.
_X = rand((2, 4, 16))
_RUNS = {
    "DenseGeneral": (lambda **kw: DenseGeneral(features=8, **kw), (_X,)),
    "LayerNormDenseGeneral": (lambda **kw: LayerNormDenseGeneral(features=8, **kw), (_X,)),
    "LayerNormMLP": (lambda **kw: LayerNormMLP(intermediate_dim=8, **kw), (_X, True)),
    "DotProductAttention": (
        lambda **kw: DotProductAttention(head_dim=8, num_attention_heads=2, **kw),
        (rand((2, 4, 2, 8)),) * 3,
    ),
    "MultiHeadAttention": (
        lambda **kw: MultiHeadAttention(head_dim=8, num_attention_heads=2, **kw),
        (_X, None),
    ),
    "TransformerLayer": (
        lambda **kw: TransformerLayer(
            hidden_size=16, mlp_hidden_size=32, num_attention_heads=2, **kw
        ),
        (_X, None, None, None, True),
    ),
}
_OFF_ARGS = {
    "DenseGeneral": ["enable_low_rank_adaptation", "quantization_checkpoint_name"],
    "LayerNormDenseGeneral": ["enable_low_rank_adaptation", "quantization_checkpoint_name"],
    "LayerNormMLP": [
        "activation_params", "enable_low_rank_adaptation", "dot_1_input_axes",
        "dot_2_input_axes", "quantization_checkpoint_name",
    ],
    "DotProductAttention": ["max_segments_per_seq", *_ATTN],
    "MultiHeadAttention": [
        "low_rank_adaptation_scope", "num_heads", "dropout_rate", "output_layernorm",
        "apply_residual_connection_post_layernorm", "fuse_qkv", *_ATTN,
    ],
    "TransformerLayer": ["low_rank_adaptation_scope", "mlp_activation_params", *_ATTN],
}  # fmt: skip
_ON = {
    "enable_low_rank_adaptation": True, "low_rank_adaptation_scope": "all",
    "quantization_checkpoint_name": "quant", "activation_params": {"limit": 7.0},
    "mlp_activation_params": {"limit": 7.0}, "softmax_type": "off_by_one",
    "score_mod": lambda s: s, "score_mod_bprop": lambda s: s, "max_segments_per_seq": 4,
    "dot_1_input_axes": ("batch", None, "embed"),
    "dot_2_input_axes": ("batch", None, "mlp"), "num_heads": 2, "dropout_rate": 0.1,
    "output_layernorm": True, "apply_residual_connection_post_layernorm": True, "fuse_qkv": True,
}  # fmt: skip


def _run(name, **kw):
    make, args = _RUNS[name]
    return make(**kw).init(jax.random.key(0), *args)


@pytest.mark.parametrize("name", list(_RUNS))
def test_te_off_values_are_accepted_when_passed_explicitly(name):
    """TE code passes these at their defaults; they must not be a TypeError."""
    offs = {arg: OFF[arg][0] for arg in _OFF_ARGS[name]}
    plain = _run(name)
    explicit = _run(name, **offs)
    jax.tree.map(np.testing.assert_array_equal, plain, explicit)


@pytest.mark.parametrize(
    "name,arg", [(n, a) for n, args in _OFF_ARGS.items() for a in args], ids=lambda v: str(v)
)
def test_te_on_values_are_refused_by_name(name, arg):
    with pytest.raises(ValueError, match=rf"(?s){arg}=.*not supported by fp8jax"):
        _run(name, **{arg: _ON[arg]})


@pytest.mark.parametrize("name", ["DotProductAttention", "MultiHeadAttention", "TransformerLayer"])
def test_score_mod_call_arguments_only_none(name):
    make, args = _RUNS[name]
    variables = make().init(jax.random.key(0), *args)
    make().apply(variables, *args, score_mod_tensors=None, score_mod_bprop_tensors=None)
    with pytest.raises(ValueError, match="score_mod_tensors must be None"):
        make().apply(variables, *args, score_mod_tensors={"a": jnp.ones(())})


def test_dense_input_axes_constrain_the_input():
    model = DenseGeneral(features=8, input_axes=("batch", None, "embed"))
    variables = model.init(jax.random.key(0), _X)
    # one device, automatic axes: the constraint must appear without a multi-device run
    mesh = jax.make_mesh((1,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    with jax.set_mesh(mesh), nn.logical_axis_rules([("batch", "data"), ("embed", None)]):
        jaxpr = str(jax.make_jaxpr(model.apply)(variables, _X))
    assert "sharding_constraint" in jaxpr
    np.testing.assert_array_equal(
        model.apply(variables, _X), DenseGeneral(features=8).apply(variables, _X)
    )


def test_checkpoint_names_ffn2_and_context():
    """ffn2_ckpt_name and context_checkpoint_name name the outputs (for remat policies)."""
    mlp = LayerNormMLP(intermediate_dim=8, ffn2_ckpt_name="my_ffn2")
    v = mlp.init(jax.random.key(0), _X, True)
    assert "my_ffn2" in str(jax.make_jaxpr(lambda x: mlp.apply(v, x, True))(_X))
    make, args = _RUNS["DotProductAttention"]
    dpa = make(context_checkpoint_name="my_ctx")
    assert "my_ctx" in str(jax.make_jaxpr(lambda *a: dpa.apply({}, *a))(*args))


# ------------------------------------------------------------ batch-major attention by default


def test_attention_is_batch_major_by_default():
    """TE v2.10+: [batch, seq, hidden]; a batch of 2 never attends across examples."""
    x = rand((2, 5, 16))
    mha = MultiHeadAttention(head_dim=8, num_attention_heads=2, attn_mask_type="no_mask")
    v = mha.init(jax.random.key(0), x, None)
    out, _ = mha.apply(v, x, None)
    alone, _ = mha.apply(v, x[:1], None)  # example 0 by itself
    np.testing.assert_allclose(out[:1], alone, rtol=1e-6, atol=1e-6)
    seq_major = mha.clone(transpose_batch_sequence=True)
    out_t, _ = seq_major.apply(v, x.swapaxes(0, 1), None)
    np.testing.assert_allclose(out_t.swapaxes(0, 1), out, rtol=1e-6, atol=1e-6)


# ------------------------------------------------------------ self-attention without identity


@pytest.mark.parametrize("gqa", [False, True])
def test_self_attention_by_none_under_jit(gqa):
    """inputs_kv=None is self-attention, inside jit too, and equals TE's identity rule."""
    x = rand((2, 5, 16))
    mha = MultiHeadAttention(head_dim=8, num_attention_heads=2, num_gqa_groups=1 if gqa else None)
    with fp8jax.autocast(enabled=True, recipe=fp8jax.Float8CurrentScaling()):
        v = mha.init(jax.random.key(0), x, None)
        by_identity, _ = mha.apply(v, x, x)
        by_none, _ = jax.jit(lambda v, q: mha.apply(v, q, None))(v, x)
    np.testing.assert_array_equal(by_identity, by_none)


def test_self_attention_identity_lost_under_jit_is_a_clear_error():
    x = rand((2, 5, 16))
    mha = MultiHeadAttention(head_dim=8, num_attention_heads=2)
    v = mha.init(jax.random.key(0), x, x)
    with pytest.raises(ValueError, match=r"initialised as self-attention.*inputs_kv=None"):
        jax.jit(lambda v, q, kv: mha.apply(v, q, kv))(v, x, x)
    with pytest.raises(ValueError, match="initialised as self-attention"):
        mha.apply(v, x, jnp.array(x))  # a copy
    cross = mha.init(jax.random.key(0), x, jnp.array(x))
    with pytest.raises(ValueError, match="initialised as cross-attention"):
        mha.apply(cross, x, None)
