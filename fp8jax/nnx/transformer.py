"""NNX ``MultiHeadAttention``, ``RelativePositionBiases`` and ``TransformerLayer``: native
``nnx.Module``s composed of the FP8 layers of :mod:`fp8jax.nnx.layers` (typed attributes named
as the Linen twins' submodules: ``layer.attention.qkv``, ``layer.mlp``, ...), with the params
and init of the twins of :mod:`fp8jax.flax`; FP8 in every GEMM inside ``fp8jax.autocast``.

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

from fp8jax import flax as fflax
from fp8jax.flax._variables import check_float_array
from fp8jax.flax.attention import decode_step
from fp8jax.flax.dot_product_attention import attention_core
from fp8jax.flax.relative_position import t5_relative_buckets
from fp8jax.nnx._base import (
    Fp8Module,
    Given,
    call_rngs,
    check_rngs,
    child,
    dropout,
    linen_init,
    positive_int,
)
from fp8jax.nnx.layers import (
    DenseGeneral,
    LayerNorm,
    LayerNormDenseGeneral,
    LayerNormMLP,
    linen_config,
    sample,
)
from fp8jax.rotary import rotary_pos_emb

__all__ = ["MultiHeadAttention", "RelativePositionBiases", "TransformerLayer"]


def _layer(given: Given, name: str, linen: Any, rngs: nnx.Rngs, deterministic: bool) -> Any:
    """The NNX layer of Linen config ``linen`` with ``given``'s subtree ``name``."""
    sub = child(given, name, linen)
    if isinstance(linen, fflax.LayerNormDenseGeneral):
        return LayerNormDenseGeneral(0, 0, _given=sub)
    if isinstance(linen, fflax.DenseGeneral):
        return DenseGeneral(0, 0, _given=sub)
    if isinstance(linen, fflax.LayerNormMLP):
        return LayerNormMLP(0, rngs=rngs, deterministic=deterministic, _given=sub)
    if isinstance(linen, fflax.LayerNorm):
        return LayerNorm(0, _given=sub)
    raise TypeError(f"no NNX layer for {type(linen).__name__}")


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
        _given: Given | None = None,
        **config: Any,
    ) -> None:
        owner = "MultiHeadAttention"
        check_rngs(owner, rngs)
        self.in_features = positive_int(owner, "in_features", in_features)
        self.kv_features = None if kv_features is None else positive_int(
            owner, "kv_features", kv_features
        )  # fmt: skip
        if _given is None:
            if head_dim is None or num_attention_heads is None:
                raise TypeError(f"{owner}: head_dim and num_attention_heads are required")
            cfg = linen_config(
                owner, fflax.MultiHeadAttention, config, {"head_dim", "num_attention_heads"}
            )
            linen = fflax.MultiHeadAttention(
                head_dim=head_dim, num_attention_heads=num_attention_heads, **cfg
            )
            x = sample((1, 1, self.in_features), cfg.get("param_dtype"))
            kv = x if kv_features is None else sample((1, 1, kv_features), cfg.get("param_dtype"))
            _given = linen_init(owner, linen, (x, kv), rngs, {"deterministic": True})
        linen = _given.linen
        self._linen, self._recipe = linen, _given.recipe
        self._heads, self._groups = linen.check_config()
        configs = linen.projection_configs(self.kv_features is None, self.in_features)
        for name, (cls, kwargs) in configs.items():
            setattr(self, name, _layer(_given, name, cls(**kwargs), rngs, deterministic))
        self._projections = tuple(configs)
        self._dropout_stream(rngs, linen.dropout_rng_name, deterministic)

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
        cfg = self._linen
        dtype = dtype or cfg.dtype or cfg.param_dtype
        kv_shape = (*shape[:2], self._groups, int(cfg.head_dim))
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
        owner, cfg = "MultiHeadAttention", self._linen
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
        bdim = 1 if cfg.transpose_batch_sequence else 0
        heads, groups, d = self._heads, self._groups, int(cfg.head_dim)
        if "qkv" in self._projections:
            qkv, ln_out = self.qkv(inputs_q)
            q, k, v = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]
        else:
            q, ln_out = self.query(inputs_q)
            kv_in = ln_out if is_self else inputs_kv
            if "kv" in self._projections:
                kv = self.kv(kv_in)
                k, v = kv[..., 0, :], kv[..., 1, :]
            else:
                k, v = self.key(kv_in), self.value(kv_in)
        q = q.reshape(*q.shape[:2], heads, d)
        k = k.reshape(*k.shape[:2], groups, d)
        v = v.reshape(*v.shape[:2], groups, d)
        mask_type, positions = cfg.attn_mask_type, None
        if decode:
            positions = self.cache_index.get_value()[None]
        if cfg.enable_rotary_pos_emb:
            rope = dict(
                windows=cfg.rotary_pos_emb_windows,
                transpose_batch_sequence=cfg.transpose_batch_sequence,
                group_method=cfg.rotary_pos_emb_group_method, positions=positions,
            )  # fmt: skip
            q, k = rotary_pos_emb(q, **rope), rotary_pos_emb(k, **rope)
        if decode:
            index = self.cache_index.get_value()
            k, v, mask, bias = decode_step(
                self.cached_key.get_value(), self.cached_value.get_value(), index, k, v, mask,
                bias, seq_axis=1 - bdim, mask_type=cfg.attn_mask_type,
            )  # fmt: skip
            self.cached_key.set_value(k)
            self.cached_value.set_value(v)
            self.cache_index.set_value(index + 1)
            mask_type = "padding"
        x = attention_core(
            q, k, v, mask, bias, **cfg.core_config(mask_type, jnp.result_type(q, k, v)),
            segment_ids=segment_ids,
            dropout_rng=None if deterministic else functools.partial(self._dropout_key, rngs),
        )  # fmt: skip
        x = x.reshape(*x.shape[:2], heads * d)
        return self.out(x), ln_out


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
        _given: Given | None = None,
        **config: Any,
    ) -> None:
        if _given is None:
            cfg = linen_config("RelativePositionBiases", fflax.RelativePositionBiases, config,
                               {"num_buckets", "max_distance", "num_attention_heads"})  # fmt: skip
            linen = fflax.RelativePositionBiases(
                num_buckets=num_buckets, max_distance=max_distance,
                num_attention_heads=num_attention_heads, **cfg,
            )  # fmt: skip
            _given = linen_init("RelativePositionBiases", linen, (2, 2), rngs)
        self._adopt(_given)

    def __call__(self, q_seqlen: int, k_seqlen: int, bidirectional: bool = True) -> jax.Array:
        cfg = self._linen
        cfg.check(q_seqlen, k_seqlen, bidirectional)
        buckets = t5_relative_buckets(
            int(q_seqlen), int(k_seqlen), int(cfg.num_buckets), int(cfg.max_distance),
            bool(bidirectional),
        )  # fmt: skip
        table = self.rel_embedding.get_value()
        values = jnp.take(table, jnp.asarray(buckets), axis=1)
        return values[None].astype(cfg.dtype or table.dtype)


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
        ``relative_embedding`` (a Linen module) is not supported.
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
        cfg = linen_config(owner, fflax.TransformerLayer, config, {"hidden_size"})
        if cfg.get("relative_embedding") is not None:
            raise ValueError(
                f"{owner}: relative_embedding (a Linen module) is not supported in fp8jax.nnx; "
                "replace layer.relpos_bias with an nnx.Module of your own instead"
            )
        linen = fflax.TransformerLayer(hidden_size=hidden, **cfg)
        decoder = linen.layer_type == fflax.TransformerLayerType.DECODER
        x = sample((1, 1, hidden), cfg.get("param_dtype"))
        given = linen_init(owner, linen, (x, x if decoder else None), rngs,
                           {"deterministic": True})  # fmt: skip
        self.hidden_size = hidden
        self._linen, self._recipe = linen, given.recipe
        self._self_attention = "self_attention" if decoder else "attention"
        for name, (cls, kwargs) in linen.submodule_configs().items():
            sub = child(given, name, cls(**kwargs))
            if cls is fflax.MultiHeadAttention:
                layer = MultiHeadAttention(
                    hidden, kv_features=None if name == self._self_attention else hidden,
                    deterministic=deterministic, rngs=rngs, _given=sub,
                )  # fmt: skip
            elif cls is fflax.RelativePositionBiases:
                layer = RelativePositionBiases(0, 0, 0, _given=sub)
            else:
                layer = _layer(given, name, sub.linen, rngs, deterministic)
            setattr(self, name, layer)
        self._dropout_stream(rngs, linen.dropout_rng_name, deterministic)

    def init_cache(self, input_shape: tuple[int, ...], dtype: Any = None) -> None:
        """Creates the self-attention's key/value cache (see
        :meth:`MultiHeadAttention.init_cache`)."""
        getattr(self, self._self_attention).init_cache(input_shape, dtype)

    def _drop(self, x: jax.Array, rate: float, dims: Any, on: bool, rngs: Any) -> jax.Array:
        if not on or rate <= 0.0:
            return x
        return dropout(x, rate, tuple(dims), self._dropout_key(rngs))

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
        cfg = self._linen
        inputs = check_float_array("TransformerLayer", "inputs", inputs)
        cfg.check(inputs, encoded, decode)
        deterministic = self._deterministic(deterministic)
        rngs = call_rngs(rngs)
        on = not deterministic
        decoder = cfg.layer_type is fflax.TransformerLayerType.DECODER
        seq_dim = 0 if cfg.transpose_batch_sequence else 1
        post = cfg.apply_residual_connection_post_layernorm
        attention = getattr(self, self._self_attention)
        bias = None
        if cfg.enable_relative_embedding:
            length = inputs.shape[seq_dim]
            if decode and hasattr(attention, "cached_key"):  # one row per cached position
                length = attention.cached_key.get_value().shape[seq_dim]
            bias = self.relpos_bias(length, length, not decoder)
        x, ln = attention(inputs, None, attention_mask, bias, decode=decode,
                          deterministic=deterministic, rngs=rngs)  # fmt: skip
        x = self._drop(x, cfg.hidden_dropout, cfg.hidden_dropout_dims, on, rngs)
        x = self._drop_path(x, on, rngs)
        x = x + (ln if post else inputs)
        mlp_input = x
        if decoder:
            y, ln = self.encoder_decoder_attention(
                x, encoded, encoder_decoder_mask, deterministic=deterministic, rngs=rngs
            )
            y = self._drop(y, cfg.hidden_dropout, cfg.hidden_dropout_dims, on, rngs)
            mlp_input = y + (ln if post else x)
        z, ln = self.mlp(mlp_input, deterministic=deterministic, rngs=rngs)
        residual = ln if post else mlp_input
        z = self._drop(z, cfg.hidden_dropout, cfg.hidden_dropout_dims, on, rngs)
        z = self._drop_path(z, on, rngs)
        z = z + residual
        if cfg.output_layernorm:
            z = self.output_layernorm(z)
        return z.astype(inputs.dtype)

    def _drop_path(self, x: jax.Array, on: bool, rngs: Any) -> jax.Array:
        """Stochastic depth: whole examples of a residual branch dropped."""
        batch_dim = 1 if self._linen.transpose_batch_sequence else 0
        dims = tuple(d for d in range(x.ndim) if d != batch_dim)
        return self._drop(x, self._linen.drop_path, dims, on, rngs)
