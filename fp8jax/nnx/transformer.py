"""NNX ``MultiHeadAttention``, ``RelativePositionBiases`` and ``TransformerLayer``: native
``nnx.Module``s composed of the FP8 layers of :mod:`fp8jax.nnx.layers` (typed attributes named
as the Linen twins' submodules: ``layer.attention.qkv``, ``layer.mlp``, ...), built from the
configs of :mod:`fp8jax.layers` (the params and init of the twins of :mod:`fp8jax.flax`); FP8
in every GEMM inside ``fp8jax.autocast``.

A child layer may be replaced by a module of your own with the same call signature (e.g. a
LoRA wrapper around ``layer.mlp``); the composite only calls it.

>>> import jax.numpy as jnp, fp8jax
>>> from flax import nnx
>>> with fp8jax.autocast(enabled=True, recipe=fp8jax.DelayedScaling(amax_history_len=8)):
...     layer = fp8jax.nnx.TransformerLayer(
...         hidden_size=16, mlp_hidden_size=32, num_attention_heads=2, hidden_dropout=0.0,
...         attention_dropout=0.0, intermediate_dropout=0.0, rngs=nnx.Rngs(0))
...     y = layer(jnp.ones((2, 4, 16)), deterministic=True)
>>> y.shape, type(layer.mlp).__name__, layer.mlp.wi_kernel.shape
((2, 4, 16), 'LayerNormMLP', (16, 1, 32))
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from fp8jax.layers.attention import MultiHeadAttentionConfig, decode_step
from fp8jax.layers.attention_core import attention_core
from fp8jax.layers.checks import check_float_array, positive_int
from fp8jax.layers.dense import DenseGeneralConfig, LayerNormConfig, LayerNormDenseGeneralConfig
from fp8jax.layers.mlp import LayerNormMLPConfig
from fp8jax.layers.relative_position import RelativePositionBiasesConfig
from fp8jax.layers.transformer import TransformerLayerConfig, TransformerLayerType
from fp8jax.nnx._base import Fp8Module, Keys, call_rngs, check_rngs, dropout, keys_for
from fp8jax.nnx.layers import (
    DenseGeneral,
    LayerNorm,
    LayerNormDenseGeneral,
    LayerNormMLP,
    make_config,
)

__all__ = ["MultiHeadAttention", "RelativePositionBiases", "TransformerLayer"]


def _child(config: Any, in_features: int, keys: Keys, rngs: nnx.Rngs, deterministic: bool) -> Any:
    """The NNX layer of a child config, ``in_features`` wide."""
    kw = dict(_config=config, _keys=keys)
    if isinstance(config, LayerNormDenseGeneralConfig):
        return LayerNormDenseGeneral(in_features, 0, **kw)
    if isinstance(config, DenseGeneralConfig):
        return DenseGeneral(in_features, 0, **kw)
    if isinstance(config, LayerNormMLPConfig):
        return LayerNormMLP(in_features, rngs=rngs, deterministic=deterministic, **kw)
    if isinstance(config, LayerNormConfig):
        return LayerNorm(in_features, **kw)
    raise TypeError(f"no NNX layer for {type(config).__name__}")


class _Cache:
    """A :class:`MultiHeadAttention`'s ``nnx.Cache`` variables as the config's forward uses
    them (:class:`fp8jax.layers.attention.KVCache`): every call with ``decode=True`` is a step."""

    def __init__(self, module: MultiHeadAttention) -> None:
        self.module = module

    def index(self) -> jax.Array:
        return self.module.cache_index.get_value()

    def update(self, k, v, mask, bias):
        m, cfg = self.module, self.module.config
        index = m.cache_index.get_value()
        k, v, mask, bias = decode_step(
            m.cached_key.get_value(), m.cached_value.get_value(), index, k, v, mask, bias,
            seq_axis=0 if cfg.transpose_batch_sequence else 1, mask_type=cfg.attn_mask_type,
        )  # fmt: skip
        m.cached_key.set_value(k)
        m.cached_value.set_value(v)
        m.cache_index.set_value(index + 1)
        return k, v, mask, bias


class MultiHeadAttention(Fp8Module):
    """FP8 multi-head attention (:class:`fp8jax.flax.MultiHeadAttention`): norm fused into the
    QKV projection, ``jax.nn.dot_product_attention``, output projection; returns ``(out,
    ln_out)``.

    Self- or cross-attention is fixed at construction (the params differ: a fused ``qkv``
    kernel, or ``query`` and ``kv``): ``kv_features=None`` builds self-attention, called as
    ``mha(x)`` (or ``mha(x, x)``); an int builds cross-attention over inputs of that width,
    called as ``mha(x, encoded)``. The projections are attributes named as the Linen params:
    ``qkv`` (a :class:`~fp8jax.nnx.LayerNormDenseGeneral`) or ``query`` and ``kv`` (or
    ``key``/``value``: :class:`~fp8jax.nnx.DenseGeneral`), and ``out``.

    Decoding: :meth:`init_cache` creates the key/value cache (``nnx.Cache`` variables
    ``cached_key``, ``cached_value``, ``cache_index``), then each ``mha(token, decode=True)``
    takes one token, attends to the cached positions up to its own and advances the index.

    Args:
      in_features: width of ``inputs_q`` (and of the output).
      head_dim, num_attention_heads: as the Linen twin.
      kv_features: see above.
      **config: the twin's other attributes (``num_gqa_groups``, ``attn_mask_type``,
        ``attention_dropout``, ``enable_rotary_pos_emb``, ``transpose_batch_sequence``,
        logical axis names, ...).
      deterministic: dropout off (``model.eval()`` sets it).
      rngs: ``rngs.params()`` draws the init key; the dropout stream is forked and kept.
    """

    def __init__(
        self,
        in_features: int,
        *,
        head_dim: int | None = None,
        num_attention_heads: int | None = None,
        kv_features: int | None = None,
        deterministic: bool = False,
        rngs: nnx.Rngs,
        _config: MultiHeadAttentionConfig | None = None,
        _keys: Keys | None = None,
        **config: Any,
    ) -> None:
        owner = "MultiHeadAttention"
        check_rngs(owner, rngs)
        self.in_features = positive_int(owner, "in_features", in_features)
        self.kv_features = None if kv_features is None else positive_int(
            owner, "kv_features", kv_features
        )  # fmt: skip
        if _config is None:
            if head_dim is None or num_attention_heads is None:
                raise TypeError(f"{owner}: head_dim and num_attention_heads are required")
            _config = make_config(owner, MultiHeadAttentionConfig, config, head_dim=head_dim,
                                  num_attention_heads=num_attention_heads)  # fmt: skip
        self.config = _config
        heads, _ = _config.check_config()
        keys = keys_for(owner, rngs, _keys)
        is_self = self.kv_features is None
        widths = {"qkv": self.in_features, "query": self.in_features,
                  "out": heads * int(_config.head_dim)}  # fmt: skip
        kv_width = self.in_features if is_self else self.kv_features
        configs = _config.projection_configs(is_self, self.in_features)
        for name, child in configs.items():
            layer = _child(child, widths.get(name, kv_width), keys.child(name), rngs, deterministic)
            setattr(self, name, layer)
        self._projections = tuple(configs)
        self._fp8_state(None)
        self._dropout_stream(rngs, _config.dropout_rng_name, deterministic)

    def init_cache(self, input_shape: tuple[int, ...], dtype: Any = None) -> None:
        """Creates an empty key/value cache for decoding inputs of ``input_shape``
        (``(batch, max_length, in_features)``, or ``(max_length, batch, in_features)`` with
        ``transpose_batch_sequence``) and sets its index to 0; ``dtype`` of the cached keys
        and values (default: ``dtype``, else ``param_dtype``)."""
        owner = "MultiHeadAttention.init_cache"
        try:
            shape = tuple(int(s) for s in input_shape)
        except TypeError:
            raise TypeError(
                f"{owner}: input_shape must be a tuple of ints, got {input_shape!r}"
            ) from None
        if len(shape) != 3 or min(shape) < 1:
            raise ValueError(
                f"{owner}: input_shape must be (batch, max_length, features) (or (max_length, "
                f"batch, features) with transpose_batch_sequence), got {input_shape!r}"
            )
        cfg = self.config
        dtype = dtype or cfg.dtype or cfg.param_dtype
        kv_shape = cfg.cache_shape(shape)
        self.cached_key = nnx.Cache(jnp.zeros(kv_shape, dtype))
        self.cached_value = nnx.Cache(jnp.zeros(kv_shape, dtype))
        self.cache_index = nnx.Cache(jnp.array(0, jnp.int32))

    def __call__(
        self,
        inputs_q: jax.Array,
        inputs_kv: jax.Array | None = None,
        mask: jax.Array | None = None,
        bias: jax.Array | None = None,
        *,
        decode: bool = False,
        deterministic: bool | None = None,
        rngs: nnx.Rngs | nnx.RngStream | jax.Array | None = None,
        segment_ids: Any = None,
    ) -> tuple[jax.Array, jax.Array | None]:
        """Attention of ``inputs_q`` over itself (self-attention) or over ``inputs_kv``;
        ``mask`` is True where attention is *not* allowed; ``decode``: one token against the
        cache (see :meth:`init_cache`)."""
        owner, cfg = "MultiHeadAttention", self.config
        is_self = inputs_kv is None or inputs_kv is inputs_q
        if is_self != (self.kv_features is None):
            built = "self" if self.kv_features is None else "cross"
            raise ValueError(
                f"{owner}: built for {built}-attention (kv_features={self.kv_features}); "
                f"call it with {'inputs_kv=None' if built == 'self' else 'inputs_kv'} "
                "(the params of self- and cross-attention differ)"
            )
        deterministic = self._deterministic(deterministic)
        # decode=True is always a step here: init_cache made the cache
        _, _, inputs_q, inputs_kv = cfg.check(
            inputs_q, inputs_q if is_self else inputs_kv, decode=decode, step=decode,
            segment_ids=segment_ids,
        )  # fmt: skip
        if decode and not hasattr(self, "cache_index"):
            raise ValueError(f"{owner}: decode=True needs a cache: call init_cache first")
        dropout_rng = None if deterministic else functools.partial(self._dropout_key, rngs)

        def core(q, k, v, mask, bias, mask_type):
            return attention_core(
                q, k, v, mask, bias, **cfg.core_config(mask_type, jnp.result_type(q, k, v)),
                segment_ids=segment_ids, dropout_rng=dropout_rng,
            )  # fmt: skip

        project = {name: getattr(self, name) for name in self._projections}
        cache = _Cache(self) if decode else None
        return cfg.forward(project, core, inputs_q, inputs_kv, is_self, mask, bias, cache)


class RelativePositionBiases(Fp8Module):
    """T5 relative position biases (:class:`fp8jax.flax.RelativePositionBiases`): param
    ``rel_embedding`` ``(num_attention_heads, num_buckets)``; ``rpb(q_len, k_len,
    bidirectional=True)`` returns ``(1, heads, q_len, k_len)``."""

    def __init__(
        self,
        num_buckets: int,
        max_distance: int,
        num_attention_heads: int,
        *,
        rngs: nnx.Rngs | None = None,
        _config: RelativePositionBiasesConfig | None = None,
        _keys: Keys | None = None,
        **config: Any,
    ) -> None:
        owner = "RelativePositionBiases"
        if _config is None:
            _config = make_config(owner, RelativePositionBiasesConfig, config,
                                  num_buckets=num_buckets, max_distance=max_distance,
                                  num_attention_heads=num_attention_heads)  # fmt: skip
        self.config = _config
        _config.check_config()
        self._draw(owner, _config.param_specs(), keys_for(owner, rngs, _keys))
        self._recipe = None

    def __call__(self, q_seqlen: int, k_seqlen: int, bidirectional: bool = True) -> jax.Array:
        self.config.check(q_seqlen, k_seqlen, bidirectional)
        table = self.rel_embedding.get_value()
        return self.config.forward(table, q_seqlen, k_seqlen, bidirectional)


class TransformerLayer(Fp8Module):
    """One FP8 Transformer encoder or decoder layer (:class:`fp8jax.flax.TransformerLayer`:
    TE's arguments, defaults, submodule names and data flow).

    Children (typed attributes, Linen's names): ``attention`` (encoder) or ``self_attention``
    and ``encoder_decoder_attention`` (decoder): :class:`MultiHeadAttention`; ``mlp``:
    :class:`~fp8jax.nnx.LayerNormMLP`, called as ``mlp(x, deterministic=..., rngs=...)`` and
    returning ``(out, ln_out)``; ``relpos_bias`` (:class:`RelativePositionBiases`) and
    ``output_layernorm`` (:class:`~fp8jax.nnx.LayerNorm`) when configured. Any of them may be
    replaced by a module of your own with the same call signature.

    Decoding: :meth:`init_cache`, then ``layer(token, decode=True)`` per token.

    Args:
      hidden_size: the model width (the input's last dim).
      **config: the twin's other attributes (``mlp_hidden_size``, ``num_attention_heads``,
        ``layer_type``, ``self_attn_mask_type``, ``enable_rotary_pos_emb``, dropout rates
        (TE's defaults: hidden and attention 0.1, intermediate 0.0), ``logical_axes``, ...);
        ``relative_embedding`` (a Linen module) is not supported (replace ``relpos_bias``).
      deterministic: dropout off (``model.eval()`` sets it, ``model.train()`` clears it).
      rngs: ``rngs.params()`` draws the init key; the dropout streams (``dropout_rng_name``,
        default ``"dropout"``) are forked and kept.
    """

    def __init__(
        self,
        hidden_size: int = 512,
        *,
        deterministic: bool = False,
        rngs: nnx.Rngs,
        **config: Any,
    ) -> None:
        owner = "TransformerLayer"
        hidden = positive_int(owner, "hidden_size", hidden_size)
        if config.get("relative_embedding") is not None:
            raise ValueError(
                f"{owner}: relative_embedding (a Linen module) is not supported in fp8jax.nnx; "
                "replace layer.relpos_bias with an nnx.Module of your own instead"
            )
        cfg = make_config(owner, TransformerLayerConfig, config, hidden_size=hidden)
        cfg.check_config()
        self.hidden_size = hidden
        self.config = cfg
        decoder = cfg.layer_type is TransformerLayerType.DECODER
        self._self_attention = "self_attention" if decoder else "attention"
        keys = keys_for(owner, rngs, None)
        for name, child in cfg.submodule_configs().items():
            if isinstance(child, MultiHeadAttentionConfig):
                layer = MultiHeadAttention(
                    hidden, kv_features=None if name == self._self_attention else hidden,
                    deterministic=deterministic, rngs=rngs, _config=child,
                    _keys=keys.child(name),
                )  # fmt: skip
            elif isinstance(child, RelativePositionBiasesConfig):
                layer = RelativePositionBiases(0, 0, 0, _config=child, _keys=keys.child(name))
            else:
                layer = _child(child, hidden, keys.child(name), rngs, deterministic)
            setattr(self, name, layer)
        self._fp8_state(None)
        self._dropout_stream(rngs, cfg.dropout_rng_name, deterministic)

    def init_cache(self, input_shape: tuple[int, ...], dtype: Any = None) -> None:
        """Creates the self-attention's key/value cache (see
        :meth:`MultiHeadAttention.init_cache`)."""
        getattr(self, self._self_attention).init_cache(input_shape, dtype)

    def __call__(
        self,
        inputs: jax.Array,
        encoded: jax.Array | None = None,
        attention_mask: jax.Array | None = None,
        encoder_decoder_mask: jax.Array | None = None,
        *,
        deterministic: bool | None = None,
        decode: bool = False,
        rngs: nnx.Rngs | nnx.RngStream | jax.Array | None = None,
    ) -> jax.Array:
        """The layer on ``inputs`` ``[batch, seq, hidden]`` (``[seq, batch, hidden]`` with
        ``transpose_batch_sequence``); ``encoded`` for a decoder; masks are True where
        attention is *not* allowed; ``decode``: one token against the cache."""
        cfg = self.config
        inputs = check_float_array("TransformerLayer", "inputs", inputs)
        cfg.check(inputs, encoded, decode)
        deterministic = self._deterministic(deterministic)
        rngs = call_rngs(rngs)
        seq_dim = 0 if cfg.transpose_batch_sequence else 1
        attention = getattr(self, self._self_attention)
        length = inputs.shape[seq_dim]
        if decode and hasattr(attention, "cached_key"):  # one row per cached position
            length = attention.cached_key.get_value().shape[seq_dim]
        run = dict(deterministic=deterministic, rngs=rngs)
        children = {
            self._self_attention: lambda x, mask, bias: attention(
                x, None, mask, bias, decode=decode, **run
            ),
            "mlp": lambda x: self.mlp(x, **run),
        }
        if cfg.enable_relative_embedding:
            children["relpos_bias"] = self.relpos_bias
        if cfg.layer_type is TransformerLayerType.DECODER:
            children["encoder_decoder_attention"] = lambda x, enc, mask: (
                self.encoder_decoder_attention(x, enc, mask, **run)
            )
        if cfg.output_layernorm:
            children["output_layernorm"] = self.output_layernorm

        def drop(x: jax.Array, rate: float, dims: Any) -> jax.Array:
            if deterministic or rate <= 0.0:
                return x
            return dropout(x, rate, tuple(dims), self._dropout_key(rngs))

        return cfg.forward(children, inputs, encoded, attention_mask, encoder_decoder_mask,
                           bias_length=length, drop=drop)  # fmt: skip
