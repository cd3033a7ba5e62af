"""Flax Linen ``TransformerLayer``: one encoder or decoder block in FP8, with TransformerEngine's
argument names, defaults, submodule names and data flow.

A block is self-attention (``MultiHeadAttention``: norm fused into the FP8 QKV projection,
``jax.nn.dot_product_attention``, FP8 output projection), for a decoder cross-attention over the
encoder's output, then ``LayerNormMLP``; each with dropout and a residual connection. Every GEMM
runs in FP8 inside ``fp8jax.autocast(enabled=True, ...)``; outside it the block is plain high
precision.

>>> import jax, jax.numpy as jnp, fp8jax
>>> from fp8jax.flax import TransformerLayer
>>> layer = TransformerLayer(hidden_size=16, mlp_hidden_size=32, num_attention_heads=2,
...                          hidden_dropout=0.0, attention_dropout=0.0, intermediate_dropout=0.0)
>>> x = jnp.ones((2, 4, 16))
>>> with fp8jax.autocast(enabled=True, recipe=fp8jax.DelayedScaling(amax_history_len=8)):
...     variables = layer.init(jax.random.key(0), x, deterministic=True)
...     y = layer.apply(variables, x, deterministic=True)
>>> y.shape
(2, 4, 16)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax

from fp8jax.flax.attention import MultiHeadAttention, RelativePositionBiases
from fp8jax.flax.layernorm import LayerNorm
from fp8jax.flax.mlp import LayerNormMLP
from fp8jax.flax.moe import MoEBlock
from fp8jax.layers.attention import MultiHeadAttentionConfig
from fp8jax.layers.checks import check_float_array, check_no_score_mod
from fp8jax.layers.layernorm import LayerNormConfig
from fp8jax.layers.mlp import LayerNormMLPConfig
from fp8jax.layers.moe import MoEBlockConfig
from fp8jax.layers.relative_position import RelativePositionBiasesConfig
from fp8jax.layers.transformer import TransformerLayerConfig, TransformerLayerType

__all__ = ["TransformerLayer", "TransformerLayerType"]

#: The Linen module of each child config.
_LINEN = {
    MultiHeadAttentionConfig: MultiHeadAttention,
    RelativePositionBiasesConfig: RelativePositionBiases,
    LayerNormMLPConfig: LayerNormMLP,
    LayerNormConfig: LayerNorm,
    MoEBlockConfig: MoEBlock,
}


class TransformerLayer(TransformerLayerConfig, nn.Module):
    """One Transformer encoder or decoder layer, FP8 in every GEMM (TransformerEngine's
    ``TransformerLayer``: the same arguments, defaults, submodule names and data flow).

    Data flow (pre-LayerNorm by default; ``x`` is ``inputs``):

    - ``h = x + dropout(self_attention(norm(x)))`` (encoder: submodule ``attention``, decoder:
      ``self_attention``), with the T5 relative position bias (``relpos_bias``) when
      ``enable_relative_embedding``;
    - decoder only: ``h = h + dropout(encoder_decoder_attention(norm(h), encoded))``;
    - ``z = h + dropout(mlp(norm(h)))`` (``mlp``: :class:`LayerNormMLP`);
    - ``output_layernorm``: a final norm on ``z`` (``output_layernorm``), and no norm before
      self-attention (post-LayerNorm); ``apply_residual_connection_post_layernorm``: the
      residuals are the norms' outputs instead of their inputs.

    Attributes:
      hidden_size, mlp_hidden_size, num_attention_heads, num_gqa_groups: widths and heads
        (``head_dim = hidden_size // num_attention_heads``; the input's last dim must equal
        ``hidden_size``); ``num_gqa_groups`` defaults to ``num_attention_heads``.
      layernorm_type, layernorm_epsilon, zero_centered_gamma: every norm of the layer.
      hidden_dropout, hidden_dropout_dims, attention_dropout, intermediate_dropout,
        intermediate_dropout_dims, dropout_rng_name: dropout rates, broadcast dims and the RNG
        stream (dropout is off when ``deterministic``).
      mha_kernel_init, mlp_kernel_init: TE's defaults (``variance_scaling(1, "fan_in",
        "normal")`` and ``(..., "truncated_normal")``).
      mlp_activations: see :class:`LayerNormMLP` (default ``("gelu",)``, TE's since v2.10).
      use_bias, bias_init: biases of every projection.
      apply_residual_connection_post_layernorm, output_layernorm: see above.
      float32_attention_logits: attention logits in float32.
      layer_type: :class:`TransformerLayerType` ``ENCODER`` or ``DECODER``.
      self_attn_mask_type, self_attn_bias_type: the self-attention's mask and bias types
        (``"no_mask"``, ``"padding"``, ``"causal"``, ``"padding_causal"``).
      enable_relative_embedding, relative_embedding: the T5 bias (a module of your own, or
        ``RelativePositionBiases(32 buckets, max distance 128)``).
      enable_rotary_pos_emb, rotary_pos_emb_windows, rotary_pos_emb_group_method: rotary
        position embeddings in both attentions.
      dtype, param_dtype: computation dtype (default: the input's with float32 params, as in
        Flax) and params' dtype.
      drop_path: stochastic depth rate (whole residual branches dropped per example).
      fuse_qkv_params, transpose_batch_sequence, scale_attn_logits, scaled_query_init,
        window_size: passed to the attentions (see :class:`MultiHeadAttention`).
      mlp, moe: ``"dense"`` (default: :class:`LayerNormMLP`) or ``"moe"``: the MLP is a
        :class:`MoEBlock` (submodule ``mlp``) configured by ``moe`` (a
        :class:`fp8jax.layers.MoEBlockConfig`; default: ``intermediate_size=mlp_hidden_size``,
        ``activation_type=mlp_activations[0]``), with the layer's pre-norm, dtypes, kernel init
        and logical axis names (``exp`` for the experts' dim). Its router losses are sown into
        ``"intermediates"`` (``mlp/aux_loss``, ``mlp/z_loss``); add them to the training loss.
        Not with ``apply_residual_connection_post_layernorm`` or ``intermediate_dropout``.
      logical_axes: annotate every param with logical axis names and constrain each block's
        input to ``("batch", "length", "embed")`` (``("length", "batch", "embed")`` with
        ``transpose_batch_sequence``), the names :data:`~fp8jax.flax.DEFAULT_RULES` maps:
        ``embed`` (model width), ``heads`` (QKV output, output projection input), ``mlp``
        (FFN width), ``act`` (the gated pair), ``relpos_buckets``. Map them to a mesh with
        :func:`flax.linen.logical_axis_rules`: ``DEFAULT_RULES`` for data x tensor
        parallelism, ``("embed", "data")`` added for FSDP, ``("length", "model")`` for sequence
        parallelism. ``init`` then returns :class:`flax.linen.LogicallyPartitioned` params
        (``nn.unbox`` them, or use ``nn.get_partition_spec`` for their shardings).
      attention_implementation: the attention cores' ``implementation`` (``None``: cuDNN where
        JAX can lower it, else XLA; see :class:`DotProductAttention`).
      fp8_dpa: FP8 attention in the attention cores (:class:`DotProductAttention`'s
        ``fp8_dpa``); default ``False``. Not with the relative position bias (the FP8
        attention takes no bias): set ``enable_relative_embedding=False`` (a rotary embedding
        is fine).
      context_parallel_axis, context_parallel_strategy, context_parallel_causal_load_balanced:
        context parallelism in the self-attention (:class:`DotProductAttention`'s; fp8jax's
        addition, TE's ``TransformerLayer`` lacks them); needs
        ``enable_relative_embedding=False`` (a bias is not split). Default: off.

    Decoding (``decode=True``): the self-attention keeps TE's autoregressive key/value cache
    in the ``"cache"`` collection (see :class:`MultiHeadAttention`). ``init`` (or a first call)
    with ``decode=True`` on the full-length input ``[batch, max_len, hidden]`` creates it; each
    later ``apply(..., decode=True, mutable=["cache"])`` takes one token and returns that
    position's output of the causal forward pass over the sequence. It needs a causal
    ``self_attn_mask_type`` (with ``"padding_causal"`` each step's ``attention_mask`` is the
    query's row, ``[batch, 1, 1, max_len]``) and no ``window_size``; a decoder's
    cross-attention has no cache (``encoded`` is passed whole at every step, with an
    ``encoder_decoder_mask`` row ``[batch, 1, 1, encoded_len]``). The relative position bias
    is computed for the cache's length (``max_decode_length``, if given, must equal it).

    Differences from TE: ``dtype``/``param_dtype`` follow Flax; ``decode`` also works for an
    ``ENCODER`` layer with a causal mask (a decoder-only block; TE asserts it off), takes the
    bias length from the cache when ``max_decode_length`` is left out, and is a ValueError
    with a non-causal self-attention mask, ``window_size``, or rotary embeddings in a
    ``DECODER`` layer (its cross-attention would rotate the token's query at position 0);
    ``enable_sequence_parallel`` is accepted for compatibility
    (sequence parallelism comes from logical axis rules here); logical axis names are opt-in
    (``logical_axes``; TE always annotates, with its own names); LoRA
    (``low_rank_adaptation_scope``, ``low_rank_adaptation_dim``,
    ``low_rank_adaptation_alpha``), ``mlp_activation_params``, ``softmax_type``, ``score_mod``
    and ``score_mod_bprop`` are accepted at TE's defaults only (ValueError otherwise), as are
    the call's ``score_mod_tensors``/``score_mod_bprop_tensors`` (``None``).
    """

    @nn.compact
    def __call__(
        self,
        inputs: jax.Array,
        encoded: jax.Array | None = None,
        attention_mask: jax.Array | None = None,
        encoder_decoder_mask: jax.Array | None = None,
        deterministic: bool = False,
        decode: bool = False,
        max_decode_length: int | None = None,
        score_mod_tensors: Any = None,
        score_mod_bprop_tensors: Any = None,
    ) -> jax.Array:
        """The layer on ``inputs`` ``[batch, seq, hidden]`` (``[seq, batch, hidden]`` with
        ``transpose_batch_sequence``); masks are True where attention is *not* allowed.
        ``decode``/``max_decode_length``: the key/value cache (see the class docstring)."""
        check_no_score_mod("TransformerLayer", score_mod_tensors, score_mod_bprop_tensors)
        inputs = check_float_array("TransformerLayer", "inputs", inputs)
        self.check(inputs, encoded, decode)
        decoder = self.layer_type is TransformerLayerType.DECODER
        attn_name = "self_attention" if decoder else "attention"
        length = inputs.shape[0 if self.transpose_batch_sequence else 1]
        if decode:
            cached = self.variables.get("cache", {}).get(attn_name, {})
            cached_key = cached.get("cached_key") if hasattr(cached, "get") else None
            if cached_key is not None:
                length = int(cached_key.shape[0 if self.transpose_batch_sequence else 1])
            length = self.decode_length(length, max_decode_length)
        made = {
            name: _LINEN[type(config)](**_fields(config), name=name)
            for name, config in self.submodule_configs().items()
        }
        children = {
            attn_name: lambda x, mask, bias: made[attn_name](
                x, None, mask, bias, decode=decode, deterministic=deterministic
            ),
            "relpos_bias": self.relative_embedding or made.get("relpos_bias"),
            "mlp": lambda x: made["mlp"](x, deterministic=deterministic),
        }
        if self.mlp == "moe":  # (out, aux_loss): the losses are sown by the block
            children["mlp"] = lambda x: (made["mlp"](x)[0], None)
        if decoder:
            children["encoder_decoder_attention"] = lambda x, enc, mask: made[
                "encoder_decoder_attention"
            ](x, enc, mask, deterministic=deterministic)
        if self.output_layernorm:
            children["output_layernorm"] = made["output_layernorm"]

        def drop(x: jax.Array, rate: float, dims: Sequence[int]) -> jax.Array:
            dropout = nn.Dropout(rate=rate, broadcast_dims=tuple(dims),
                                 rng_collection=self.dropout_rng_name)  # fmt: skip
            return dropout(x, deterministic=deterministic)

        return self.forward(children, inputs, encoded, attention_mask, encoder_decoder_mask,
                            bias_length=length, drop=drop)  # fmt: skip


def _fields(config: Any) -> dict[str, Any]:
    return {f: getattr(config, f) for f in config.__dataclass_fields__}
