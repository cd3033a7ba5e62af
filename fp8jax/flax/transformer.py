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

import enum
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.typing import Initializer

from fp8jax.flax._te_args import check_no_score_mod, check_off
from fp8jax.flax._variables import check_float_array
from fp8jax.flax.attention import (
    MultiHeadAttention,
    RelativePositionBiases,
    default_mha_kernel_init,
)
from fp8jax.flax.dot_product_attention import canonical_mask_type
from fp8jax.flax.layernorm import LayerNorm
from fp8jax.flax.mlp import LayerNormMLP

__all__ = ["TransformerLayer", "TransformerLayerType"]


class TransformerLayerType(enum.Enum):
    """Which block :class:`TransformerLayer` builds."""

    ENCODER = "encoder"
    DECODER = "decoder"


class TransformerLayer(nn.Module):
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
      logical_axes: annotate every param with logical axis names and constrain each block's
        input to ``("batch", "length", "embed")`` (``("length", "batch", "embed")`` with
        ``transpose_batch_sequence``), the names :data:`~fp8jax.flax.DEFAULT_RULES` maps:
        ``embed`` (model width), ``heads`` (QKV output, output projection input), ``mlp``
        (FFN width), ``act`` (the gated pair), ``relpos_buckets``. Map them to a mesh with
        :func:`flax.linen.logical_axis_rules`: ``DEFAULT_RULES`` for data x tensor
        parallelism, ``("embed", "data")`` added for FSDP, ``("length", "model")`` for sequence
        parallelism. ``init`` then returns :class:`flax.linen.LogicallyPartitioned` params
        (``nn.unbox`` them, or use ``nn.get_partition_spec`` for their shardings).

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

    hidden_size: int = 512
    mlp_hidden_size: int = 2048
    num_attention_heads: int = 8
    num_gqa_groups: int | None = None
    layernorm_type: str = "layernorm"
    layernorm_epsilon: float = 1e-6
    zero_centered_gamma: bool = False
    hidden_dropout: float = 0.1
    hidden_dropout_dims: Sequence[int] = ()
    attention_dropout: float = 0.1
    intermediate_dropout: float = 0.0
    intermediate_dropout_dims: Sequence[int] = ()
    dropout_rng_name: str = "dropout"
    mha_kernel_init: Initializer | None = None
    mlp_kernel_init: Initializer | None = None
    mlp_activations: Sequence[str] = ("gelu",)
    mlp_activation_params: Any = None
    use_bias: bool = False
    bias_init: Initializer = nn.initializers.zeros_init()
    apply_residual_connection_post_layernorm: bool = False
    output_layernorm: bool = False
    float32_attention_logits: bool = False
    layer_type: TransformerLayerType = TransformerLayerType.ENCODER
    self_attn_mask_type: str = "causal"
    self_attn_bias_type: str | None = None
    enable_relative_embedding: bool = True
    relative_embedding: nn.Module | None = None
    enable_rotary_pos_emb: bool = False
    rotary_pos_emb_windows: tuple[int, int] = (1, 10000)
    rotary_pos_emb_group_method: str = "consecutive"
    dtype: Any = None
    param_dtype: Any = jnp.float32
    drop_path: float = 0.0
    fuse_qkv_params: bool = True
    transpose_batch_sequence: bool = False
    enable_sequence_parallel: bool = False
    scale_attn_logits: bool = False
    scaled_query_init: bool = True
    window_size: tuple[int, int] | None = None
    low_rank_adaptation_scope: str = "none"
    low_rank_adaptation_dim: int = 32
    low_rank_adaptation_alpha: float | None = None
    softmax_type: str = "vanilla"
    score_mod: Any = None
    score_mod_bprop: Any = None
    logical_axes: bool = False

    def _input_axes(self) -> tuple[str, ...]:
        if not self.logical_axes:
            return ()
        return ("length", "batch", "embed") if self.transpose_batch_sequence else (
            "batch", "length", "embed")  # fmt: skip

    def _axes(self, **names: tuple[str | None, ...]) -> dict[str, tuple[str | None, ...]]:
        """Submodule axis-name arguments: ``names`` with ``logical_axes``, else none."""
        return names if self.logical_axes else {}

    def check(self, inputs: jax.Array, encoded: jax.Array | None, decode: bool) -> None:
        """Every refusal of a call on ``inputs`` (and a decoder's ``encoded``), with
        ``decode``: the configuration and the arguments (ValueError naming them). Shared with
        :class:`fp8jax.nnx.TransformerLayer`, which calls it with its own call's arguments."""
        owner = "TransformerLayer"
        check_off(
            owner, self, "low_rank_adaptation_scope", "mlp_activation_params", "softmax_type",
            "score_mod", "score_mod_bprop",
        )  # fmt: skip
        if not isinstance(self.layer_type, TransformerLayerType):
            raise ValueError(
                f"{owner}: layer_type must be TransformerLayerType.ENCODER or DECODER, got "
                f"{self.layer_type!r}"
            )
        for name in ("hidden_size", "mlp_hidden_size", "num_attention_heads"):
            v = getattr(self, name)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{owner}: {name} must be a positive int, got {v!r}")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"{owner}: num_attention_heads={self.num_attention_heads} must divide "
                f"hidden_size={self.hidden_size}"
            )
        if inputs.ndim != 3:
            raise ValueError(
                f"{owner}: inputs must be rank 3 ([batch, seq, hidden], or [seq, batch, hidden] "
                f"with transpose_batch_sequence), got shape {inputs.shape}"
            )
        if inputs.shape[-1] != self.hidden_size:
            raise ValueError(
                f"{owner}: inputs' last dim {inputs.shape[-1]} must equal hidden_size="
                f"{self.hidden_size}"
            )
        if decode:
            self.check_decode()
        if self.layer_type is TransformerLayerType.DECODER and encoded is None:
            raise ValueError(f"{owner}: a DECODER layer needs encoded (the encoder's output)")
        for name in ("hidden_dropout", "attention_dropout", "intermediate_dropout", "drop_path"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1:
                raise ValueError(f"{owner}: {name} must be a float in [0, 1), got {v!r}")

    def check_decode(self) -> None:
        """The configurations ``decode=True`` supports (ValueError otherwise)."""
        owner = "TransformerLayer"
        mask_type = canonical_mask_type(self.self_attn_mask_type, "self_attn_mask_type")
        if mask_type not in ("causal", "padding_causal"):
            raise ValueError(
                f"{owner}: decode=True needs a causal self-attention (self_attn_mask_type "
                f"'causal' or 'padding_causal'): each cached step attends to the tokens before "
                f"it; got self_attn_mask_type={self.self_attn_mask_type!r}"
            )
        if self.window_size is not None:
            raise ValueError(
                f"{owner}: decode=True does not support window_size (sliding-window attention "
                f"over the cache); got window_size={self.window_size!r}"
            )
        if self.layer_type is TransformerLayerType.DECODER and self.enable_rotary_pos_emb:
            raise ValueError(
                f"{owner}: decode=True with enable_rotary_pos_emb is not supported for a DECODER "
                "layer: its cross-attention (no cache) would rotate each token's query at "
                "position 0 instead of the token's position"
            )

    def _decode_length(self, attn_name: str, length: int, max_decode_length: Any) -> int:
        """The sequence length the relative position bias covers with ``decode=True``: the
        cache's (the input's, on the call that creates the cache)."""
        owner = "TransformerLayer"
        seq_dim = 0 if self.transpose_batch_sequence else 1
        cache = self.variables.get("cache", {}).get(attn_name, {})
        cached_key = cache.get("cached_key") if hasattr(cache, "get") else None
        cache_len = length if cached_key is None else int(cached_key.shape[seq_dim])
        if max_decode_length is None:
            return cache_len
        if (
            not isinstance(max_decode_length, (int, np.integer))
            or isinstance(max_decode_length, bool)
            or max_decode_length != cache_len
        ):
            raise ValueError(
                f"{owner}: max_decode_length must be None or the key/value cache's length "
                f"{cache_len} (the sequence length of the input that created the cache), got "
                f"{max_decode_length!r}"
            )
        return cache_len

    def submodule_configs(self) -> dict[str, tuple[type[nn.Module], dict[str, Any]]]:
        """The layer's children as ``{submodule name: (Linen class, its attributes)}``: the
        self-attention (``attention``, or ``self_attention`` in a decoder), a decoder's
        ``encoder_decoder_attention``, ``relpos_bias`` (with ``enable_relative_embedding`` and
        no ``relative_embedding`` of your own), ``mlp`` and ``output_layernorm`` (with
        ``output_layernorm``). Shared with :class:`fp8jax.nnx.TransformerLayer`, which builds
        its children from them."""
        decoder = self.layer_type is TransformerLayerType.DECODER
        post = self.apply_residual_connection_post_layernorm
        common = dict(
            layernorm_type=self.layernorm_type, zero_centered_gamma=self.zero_centered_gamma,
            use_bias=self.use_bias, bias_init=self.bias_init, dtype=self.dtype,
            param_dtype=self.param_dtype, layernorm_input_axes=self._input_axes(),
        )  # fmt: skip
        attention = dict(
            head_dim=self.hidden_size // self.num_attention_heads,
            num_attention_heads=self.num_attention_heads, num_gqa_groups=self.num_gqa_groups,
            attention_dropout=self.attention_dropout, dropout_rng_name=self.dropout_rng_name,
            float32_logits=self.float32_attention_logits,
            scale_attn_logits=self.scale_attn_logits, scaled_query_init=self.scaled_query_init,
            layernorm_epsilon=self.layernorm_epsilon, return_layernorm_output=post,
            input_layernorm=not self.output_layernorm, attn_mask_type=self.self_attn_mask_type,
            attn_bias_type=self.self_attn_bias_type,
            enable_rotary_pos_emb=self.enable_rotary_pos_emb,
            rotary_pos_emb_windows=self.rotary_pos_emb_windows,
            rotary_pos_emb_group_method=self.rotary_pos_emb_group_method,
            fuse_qkv_params=self.fuse_qkv_params,
            kernel_init=self.mha_kernel_init or default_mha_kernel_init,
            transpose_batch_sequence=self.transpose_batch_sequence, window_size=self.window_size,
            **common,
            **self._axes(
                scale_axes=("embed",), ln_bias_axes=("embed",), qkv_kernel_axes=("embed", "heads"),
                qkv_bias_axes=("heads",), out_kernel_axes=("heads", "embed"),
                out_bias_axes=("embed",),
            ),
        )  # fmt: skip
        out: dict[str, tuple[type[nn.Module], dict[str, Any]]] = {
            "self_attention" if decoder else "attention": (MultiHeadAttention, attention)
        }
        if decoder:
            cross = dict(attention, input_layernorm=True, attn_mask_type="padding",
                         attn_bias_type="no_bias")  # fmt: skip
            out["encoder_decoder_attention"] = (MultiHeadAttention, cross)
        if self.enable_relative_embedding and self.relative_embedding is None:
            out["relpos_bias"] = (RelativePositionBiases, dict(
                num_buckets=32, max_distance=128, num_attention_heads=self.num_attention_heads,
                embedding_init=nn.initializers.variance_scaling(1.0, "fan_avg", "uniform"),
                **self._axes(embedding_axes=("heads", "relpos_buckets")),
            ))  # fmt: skip
        out["mlp"] = (LayerNormMLP, dict(
            intermediate_dim=self.mlp_hidden_size, epsilon=self.layernorm_epsilon,
            return_layernorm_output=post, activations=tuple(self.mlp_activations),
            intermediate_dropout_rng_name=self.dropout_rng_name,
            intermediate_dropout_rate=self.intermediate_dropout,
            intermediate_hidden_dropout_dims=tuple(self.intermediate_dropout_dims),
            kernel_init=self.mlp_kernel_init, **common,
            **self._axes(
                scale_axes=("embed",), ln_bias_axes=("embed",),
                kernel_axes_1=("embed", "act", "mlp"), kernel_axes_2=("mlp", "embed"),
                bias_axes_1=("act", "mlp"), bias_axes_2=("embed",),
            ),
        ))  # fmt: skip
        if self.output_layernorm:
            out["output_layernorm"] = (LayerNorm, dict(
                epsilon=self.layernorm_epsilon, layernorm_type=self.layernorm_type,
                zero_centered_gamma=self.zero_centered_gamma, dtype=self.dtype,
                param_dtype=self.param_dtype,
                **self._axes(scale_axes=("embed",), bias_axes=("embed",)),
            ))  # fmt: skip
        return out

    def _dropout(self, x: jax.Array, rate: float, dims: Sequence[int], deterministic: bool):
        drop = nn.Dropout(
            rate=rate, broadcast_dims=tuple(dims), rng_collection=self.dropout_rng_name
        )
        return drop(x, deterministic=deterministic)

    def _drop_path(self, x: jax.Array, deterministic: bool) -> jax.Array:
        if self.drop_path <= 0:
            return x
        batch_dim = 1 if self.transpose_batch_sequence else 0
        dims = tuple(d for d in range(x.ndim) if d != batch_dim)
        drop = nn.Dropout(rate=self.drop_path, broadcast_dims=dims,
                          rng_collection=self.dropout_rng_name)  # fmt: skip
        return drop(x, deterministic=deterministic)

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
        seq_dim = 0 if self.transpose_batch_sequence else 1
        attn_name = "self_attention" if decoder else "attention"
        length = inputs.shape[seq_dim]
        if decode:
            length = self._decode_length(attn_name, length, max_decode_length)
        configs = self.submodule_configs()

        def child(name: str) -> nn.Module:
            cls, kwargs = configs[name]
            return cls(name=name, **kwargs)

        bias = None
        if self.enable_relative_embedding:
            rel = self.relative_embedding
            if rel is None:
                rel = child("relpos_bias")
            bias = rel(length, length, not decoder)

        x, ln = child(attn_name)(
            inputs, None, attention_mask, bias, decode=decode, deterministic=deterministic
        )
        x = self._dropout(x, self.hidden_dropout, self.hidden_dropout_dims, deterministic)
        x = self._drop_path(x, deterministic)
        residual = ln if self.apply_residual_connection_post_layernorm else inputs
        x = x + residual
        mlp_input = x
        if decoder:
            y, ln = child("encoder_decoder_attention")(
                x, encoded, encoder_decoder_mask, deterministic=deterministic
            )
            y = self._dropout(y, self.hidden_dropout, self.hidden_dropout_dims, deterministic)
            residual = ln if self.apply_residual_connection_post_layernorm else x
            mlp_input = y + residual
        z, ln = child("mlp")(mlp_input, deterministic=deterministic)
        residual = ln if self.apply_residual_connection_post_layernorm else mlp_input
        z = self._dropout(z, self.hidden_dropout, self.hidden_dropout_dims, deterministic)
        z = self._drop_path(z, deterministic)
        z = z + residual
        if self.output_layernorm:
            z = child("output_layernorm")(z)
        return z.astype(inputs.dtype)
