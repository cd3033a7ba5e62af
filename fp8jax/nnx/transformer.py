"""NNX ``TransformerLayer``: a native
``nnx.Module`` composed of the FP8 layers of :mod:`fp8jax.nnx` (typed attributes named
as the Linen twins' submodules: ``layer.attention.qkv``, ``layer.mlp``, ...), built from the
configs of :mod:`fp8jax.layers` (as the twins of :mod:`fp8jax.flax` are); FP8
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

from typing import Any

import jax
from flax import nnx

from fp8jax.layers.attention import MultiHeadAttentionConfig
from fp8jax.layers.checks import check_float_array, positive_int
from fp8jax.layers.relative_position import RelativePositionBiasesConfig
from fp8jax.layers.transformer import TransformerLayerConfig, TransformerLayerType
from fp8jax.nnx._base import Fp8Module, call_rngs, dropout, keys_for, make_config
from fp8jax.nnx._children import child_layer
from fp8jax.nnx.attention import MultiHeadAttention
from fp8jax.nnx.relative_position import RelativePositionBiases

__all__ = ["TransformerLayer"]


class TransformerLayer(Fp8Module):
    """One FP8 Transformer encoder or decoder layer (:class:`fp8jax.flax.TransformerLayer`:
    TE's arguments, defaults, submodule names and data flow).

    Children (typed attributes, Linen's names): ``attention`` (encoder) or ``self_attention``
    and ``encoder_decoder_attention`` (decoder): :class:`MultiHeadAttention`; ``mlp``:
    :class:`~fp8jax.nnx.LayerNormMLP`, called as ``mlp(x, deterministic=..., rngs=...)`` and
    returning ``(out, ln_out)`` (with ``mlp="moe"``: :class:`~fp8jax.nnx.MoEBlock`, called as
    ``mlp(x)``, returning ``(out, aux_loss)``); ``relpos_bias``
    (:class:`RelativePositionBiases`) and ``output_layernorm`` (:class:`~fp8jax.nnx.LayerNorm`)
    when configured. Any of them may be replaced by a module of your own with the same call
    signature.

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
                layer = child_layer(child, hidden, keys.child(name), rngs, deterministic)
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
        if cfg.mlp == "moe":  # (out, aux_loss): the losses are sown by the block
            children["mlp"] = lambda x: (self.mlp(x)[0], None)
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
