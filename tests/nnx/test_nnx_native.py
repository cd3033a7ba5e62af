"""fp8jax.nnx as native NNX modules: typed children that a user can replace (a LoRA wrapper
around ``layer.mlp``), decoding with a key/value cache, the deprecated names."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from _nnx import RECIPE, TRANSFORMER, assert_trees_equal, float32_matmuls  # noqa: F401
from _shared import rand
from flax import nnx

import fp8jax
from fp8jax import flax as fflax
from fp8jax import nnx as fnnx


def _build(fp8=True, **config):
    with fp8jax.autocast(enabled=fp8, recipe=RECIPE):
        return fnnx.TransformerLayer(**{**TRANSFORMER, **config}, rngs=nnx.Rngs(0))


def test_children_are_typed_fp8_layers():
    layer = _build()
    assert isinstance(layer.mlp, fnnx.LayerNormMLP)
    assert isinstance(layer.attention, fnnx.MultiHeadAttention)
    assert isinstance(layer.attention.qkv, fnnx.LayerNormDenseGeneral)
    assert isinstance(layer.attention.out, fnnx.DenseGeneral)
    assert isinstance(layer.relpos_bias, fnnx.RelativePositionBiases)
    assert isinstance(layer.mlp.fp8_meta.scale, fnnx.Fp8MetaVariable)
    assert isinstance(layer.mlp.fp8_probe.call_0, fnnx.Fp8Probe)
    assert isinstance(layer.mlp.wi_kernel, nnx.Param)
    gqa = _build(num_gqa_groups=1)  # no packed kernel: query + kv
    assert isinstance(gqa.attention.query, fnnx.LayerNormDenseGeneral)
    assert isinstance(gqa.attention.kv, fnnx.DenseGeneral)


def test_a_linen_relative_embedding_is_refused():
    rel = fflax.RelativePositionBiases(num_buckets=8, max_distance=16, num_attention_heads=2)
    with pytest.raises(ValueError, match=r"relative_embedding .* not supported"):
        fnnx.TransformerLayer(**TRANSFORMER, relative_embedding=rel, rngs=nnx.Rngs(0))


class LoraMlp(nnx.Module):
    """``mlp(x) + x @ a @ b``: a low-rank adapter around the layer's own MLP, with the MLP's
    call signature."""

    def __init__(self, base: fnnx.LayerNormMLP, rank: int, *, rngs: nnx.Rngs):
        width = base.in_features
        self.base = base
        self.a = nnx.Param(jax.random.normal(rngs.params(), (width, rank)) * 0.1)
        self.b = nnx.Param(jnp.zeros((rank, width)))

    def __call__(self, x, *, deterministic=None, rngs=None):
        y, ln = self.base(x, deterministic=deterministic, rngs=rngs)
        return y + (x @ self.a[...]) @ self.b[...], ln


def test_a_replaced_mlp_runs_and_trains():
    layer = _build()
    x, y = rand((2, 4, 16), 1), rand((2, 4, 16), 2)
    with fp8jax.autocast(enabled=True, recipe=RECIPE):
        before = layer(x, deterministic=True)
        layer.mlp = LoraMlp(layer.mlp, 4, rngs=nnx.Rngs(5))
        assert_trees_equal(layer(x, deterministic=True), before)  # b = 0: the same layer
    assert fnnx.model_recipe(layer) == RECIPE
    # train only the adapter (and observe every FP8 layer, the wrapped MLP's too)
    lora = nnx.All(nnx.Param, nnx.PathContains("mlp"), nnx.Not(nnx.PathContains("base")))
    optimizer = nnx.Optimizer(layer, optax.sgd(0.5), wrt=lora)

    @nnx.jit
    def step(layer, optimizer):
        def loss(m):
            return jnp.mean((m(x, deterministic=True) - y) ** 2)

        with fp8jax.autocast(enabled=True, recipe=RECIPE):
            value, grads = nnx.value_and_grad(loss, argnums=fnnx.diff_state(params=lora))(layer)
        fnnx.apply_gradients(layer, optimizer, grads)
        return value

    kernel = np.asarray(layer.mlp.base.wi_kernel[...])
    losses = [float(step(layer, optimizer)) for _ in range(3)]
    assert losses[-1] < losses[0]
    assert np.any(np.asarray(layer.mlp.b[...]) != 0)
    np.testing.assert_array_equal(layer.mlp.base.wi_kernel[...], kernel)  # frozen
    assert float(layer.mlp.base.fp8_meta.amax_history[0, 0]) > 0  # the base MLP observed


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("rotary", [False, True])
def test_decode_token_by_token_equals_the_causal_forward(fp8, rotary):
    """With the FP8 state fixed (evaluation), each decoded token sees what its row of the
    causal forward sees: the same FP8 scales, so the same codes per row. Tolerance: float32
    rounding of the attention's padded sums (the masked cache positions)."""
    layer = _build(fp8, enable_rotary_pos_emb=rotary)
    x = rand((2, 6, 16), 3)
    with fp8jax.autocast(enabled=fp8, recipe=RECIPE):
        full = layer(x, deterministic=True)
        layer.init_cache(x.shape)
        step = nnx.jit(lambda m, t: m(t, deterministic=True, decode=True))
        tokens = [step(layer, x[:, i : i + 1]) for i in range(x.shape[1])]
    np.testing.assert_allclose(jnp.concatenate(tokens, axis=1), full, rtol=2e-5, atol=2e-5)
    assert int(layer.attention.cache_index[...]) == x.shape[1]
    assert isinstance(layer.attention.cached_key, nnx.Cache)


def test_mha_decode_matches_linen_decode():
    kw = dict(head_dim=8, num_attention_heads=2, num_gqa_groups=1, attn_mask_type="causal")
    with fp8jax.autocast(enabled=True, recipe=RECIPE):
        mha = fnnx.MultiHeadAttention(16, **kw, rngs=nnx.Rngs(0))
        linen = fflax.MultiHeadAttention(**kw)
        x = rand((2, 5, 16), 4)
        variables = linen.init(nnx.Rngs(0).params(), x, x, decode=True)
        mha.init_cache(x.shape)
        cache = variables["cache"]
        for i in range(x.shape[1]):
            token = x[:, i : i + 1]
            (want, _), mutated = linen.apply(
                {**variables, "cache": cache}, token, None, decode=True, mutable=["cache"]
            )
            cache = mutated["cache"]
            got, _ = mha(token, decode=True, deterministic=True)
            assert_trees_equal(got, want)


def test_mha_attention_dropout_takes_the_call_key_or_the_kept_stream():
    """The attention core gets the dropout key explicitly: the same call key gives the same
    result, the kept stream a new mask per call, deterministic none."""
    mha = fnnx.MultiHeadAttention(16, head_dim=8, num_attention_heads=2, attention_dropout=0.5,
                                  rngs=nnx.Rngs(0, dropout=1))  # fmt: skip
    x = rand((2, 5, 16), 6)
    a = mha(x, rngs=jax.random.key(3))[0]
    np.testing.assert_array_equal(a, mha(x, rngs=jax.random.key(3))[0])
    assert not np.allclose(a, mha(x, rngs=jax.random.key(4))[0])
    off = mha(x, deterministic=True)[0]
    assert not np.allclose(a, off) and not np.allclose(mha(x)[0], mha(x)[0])


def test_decode_errors():
    with fp8jax.autocast(enabled=True, recipe=RECIPE):
        mha = fnnx.MultiHeadAttention(16, head_dim=8, num_attention_heads=2, rngs=nnx.Rngs(0))
    x = rand((2, 1, 16), 5)
    with pytest.raises(ValueError, match="call init_cache first"):
        mha(x, decode=True, deterministic=True)
    with pytest.raises(ValueError, match="input_shape must be"):
        mha.init_cache((2, 16))
    mha.init_cache((2, 4, 16))
    with pytest.raises(ValueError, match="takes one token"):
        mha(rand((2, 2, 16), 6), decode=True, deterministic=True)
    with pytest.raises(TypeError, match="head_dim and num_attention_heads are required"):
        fnnx.MultiHeadAttention(16, rngs=nnx.Rngs(0))


def test_old_names_are_deprecated_aliases():
    with pytest.warns(DeprecationWarning, match=r"fp8jax\.nnx\.Fp8MetaVariable"):
        old = fnnx.Fp8Meta
    assert old is fnnx.Fp8MetaVariable
    with pytest.warns(DeprecationWarning, match=r"fp8jax\.nnx\.update_fp8_variables"):
        from fp8jax.nnx import update_fp8_state
    assert update_fp8_state is fnnx.update_fp8_variables
    with pytest.raises(AttributeError, match="no attribute 'Node'"):
        fnnx.Node  # noqa: B018


def test_the_linen_backed_wrappers_are_gone():
    assert not (Path(fp8jax.__file__).parent / "nnx" / "_linen_backed.py").exists()
