"""NNX ``MultiHeadAttention`` and ``TransformerLayer``: the Linen twins of :mod:`fp8jax.flax`
as ``nnx.Module``s (same math, params, init and submodule names; FP8 in every GEMM inside
``fp8jax.autocast``).

>>> import jax.numpy as jnp, fp8jax
>>> from flax import nnx
>>> with fp8jax.autocast(enabled=True, recipe=fp8jax.DelayedScaling(amax_history_len=8)):
...     layer = fp8jax.nnx.TransformerLayer(
...         hidden_size=16, mlp_hidden_size=32, num_attention_heads=2, hidden_dropout=0.0,
...         attention_dropout=0.0, intermediate_dropout=0.0, rngs=nnx.Rngs(0))
...     y = layer(jnp.ones((2, 4, 16)), deterministic=True)
>>> y.shape, layer.mlp.wi_kernel.shape
((2, 4, 16), (16, 1, 32))
"""

from __future__ import annotations

from typing import Any

import jax
from flax import nnx

from fp8jax import flax as fflax
from fp8jax.nnx._linen_backed import LinenBacked
from fp8jax.nnx.layers import linen_config, positive_int, sample

__all__ = ["MultiHeadAttention", "TransformerLayer"]


class MultiHeadAttention(LinenBacked):
    """FP8 multi-head attention (:class:`fp8jax.flax.MultiHeadAttention`): norm fused into the
    QKV projection, ``jax.nn.dot_product_attention``, output projection; returns ``(out,
    ln_out)``.

    Self- or cross-attention is fixed at construction (the params differ: a fused ``qkv``
    kernel, or ``query`` and ``kv``): ``kv_features=None`` builds self-attention, called as
    ``mha(x)`` (or ``mha(x, x)``); an int builds cross-attention over inputs of that width,
    called as ``mha(x, encoded)``.

    Args:
      in_features: width of ``inputs_q`` (and of the output).
      head_dim, num_attention_heads: as the Linen twin.
      kv_features: see above.
      **config: the twin's other attributes (``num_gqa_groups``, ``attn_mask_type``,
        ``attention_dropout``, ``enable_rotary_pos_emb``, ``transpose_batch_sequence``
        (default ``True``, as TE), logical axis names, ...).
      deterministic: dropout off (``model.eval()`` sets it).
      rngs: ``rngs.params()`` draws the init key; the dropout stream is forked and kept.
    """

    def __init__(
        self,
        in_features: int,
        *,
        head_dim: int,
        num_attention_heads: int,
        kv_features: int | None = None,
        deterministic: bool = False,
        rngs: nnx.Rngs,
        **config: Any,
    ) -> None:
        owner = "MultiHeadAttention"
        self.in_features = positive_int(owner, "in_features", in_features)
        self.kv_features = None if kv_features is None else positive_int(
            owner, "kv_features", kv_features
        )  # fmt: skip
        cfg = linen_config(
            owner, fflax.MultiHeadAttention, config, {"head_dim", "num_attention_heads"}
        )
        linen = fflax.MultiHeadAttention(
            head_dim=head_dim, num_attention_heads=num_attention_heads, **cfg
        )
        x = sample((1, 1, self.in_features), cfg.get("param_dtype"))
        kv = x if kv_features is None else sample((1, 1, kv_features), cfg.get("param_dtype"))
        self._build(
            linen, (x, kv), rngs=rngs, init_kwargs={"deterministic": True},
            dropout_rng_name=linen.dropout_rng_name, deterministic=deterministic,
        )  # fmt: skip

    def __call__(
        self,
        inputs_q: jax.Array,
        inputs_kv: jax.Array | None = None,
        mask: jax.Array | None = None,
        bias: jax.Array | None = None,
        *,
        deterministic: bool | None = None,
        rngs: nnx.Rngs | jax.Array | None = None,
        segment_ids: Any = None,
    ) -> tuple[jax.Array, jax.Array | None]:
        """Attention of ``inputs_q`` over itself (self-attention) or over ``inputs_kv``;
        ``mask`` is True where attention is *not* allowed."""
        owner = "MultiHeadAttention"
        is_self = inputs_kv is None or inputs_kv is inputs_q
        if is_self != (self.kv_features is None):
            built = "self" if self.kv_features is None else "cross"
            raise ValueError(
                f"{owner}: built for {built}-attention (kv_features={self.kv_features}); "
                f"call it with {'inputs_kv=None' if built == 'self' else 'inputs_kv'} "
                "(the params of self- and cross-attention differ)"
            )
        kv = inputs_q if is_self else inputs_kv
        return self._apply(
            inputs_q, kv, mask, bias, deterministic=deterministic, rngs=rngs,
            segment_ids=segment_ids,
        )  # fmt: skip


class TransformerLayer(LinenBacked):
    """One FP8 Transformer encoder or decoder layer (:class:`fp8jax.flax.TransformerLayer`:
    TE's arguments, defaults, submodule names and data flow).

    Args:
      hidden_size: the model width (the input's last dim).
      **config: the twin's other attributes (``mlp_hidden_size``, ``num_attention_heads``,
        ``layer_type``, ``self_attn_mask_type``, ``enable_rotary_pos_emb``, dropout rates
        (TE's defaults: hidden and attention 0.1, intermediate 0.0), ``logical_axes``, ...).
      deterministic: dropout off (``model.eval()`` sets it, ``model.train()`` clears it).
      rngs: ``rngs.params()`` draws the init key; the dropout stream (``dropout_rng_name``,
        default ``"dropout"``) is forked and kept.

    Not supported (as in the twin): ``decode`` (a key/value cache).
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
        self.hidden_size = positive_int(owner, "hidden_size", hidden_size)
        cfg = linen_config(owner, fflax.TransformerLayer, config, {"hidden_size"})
        linen = fflax.TransformerLayer(hidden_size=self.hidden_size, **cfg)
        x = sample((1, 1, self.hidden_size), cfg.get("param_dtype"))
        encoded = x if linen.layer_type == fflax.TransformerLayerType.DECODER else None
        self._build(
            linen, (x, encoded), rngs=rngs, init_kwargs={"deterministic": True},
            dropout_rng_name=linen.dropout_rng_name, deterministic=deterministic,
        )  # fmt: skip

    def __call__(
        self,
        inputs: jax.Array,
        encoded: jax.Array | None = None,
        attention_mask: jax.Array | None = None,
        encoder_decoder_mask: jax.Array | None = None,
        *,
        deterministic: bool | None = None,
        rngs: nnx.Rngs | jax.Array | None = None,
    ) -> jax.Array:
        """The layer on ``inputs`` ``[batch, seq, hidden]`` (``[seq, batch, hidden]`` with
        ``transpose_batch_sequence``); ``encoded`` for a decoder; masks are True where
        attention is *not* allowed."""
        return self._apply(
            inputs, encoded, attention_mask, encoder_decoder_mask, deterministic=deterministic,
            rngs=rngs,
        )  # fmt: skip
