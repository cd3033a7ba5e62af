"""The config of ``TransformerLayer`` (one encoder or decoder block), shared by both Flax APIs:
fields with TransformerEngine's names and defaults, every refusal of a call (decoding included),
the children as configs, and the block's data flow on given children. :class:`fp8jax.flax.
TransformerLayer` documents the fields."""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fp8jax.layers.attention import MultiHeadAttentionConfig
from fp8jax.layers.attention_core import canonical_mask_type
from fp8jax.layers.checks import check_off, positive_int
from fp8jax.layers.layernorm import LayerNormConfig
from fp8jax.layers.mlp import LayerNormMLPConfig
from fp8jax.layers.moe import MoEBlockConfig
from fp8jax.layers.params import Initializer, default_mha_kernel_init, zeros
from fp8jax.layers.relative_position import RelativePositionBiasesConfig

__all__ = ["TransformerLayerConfig", "TransformerLayerType"]

_RELPOS_INIT = jax.nn.initializers.variance_scaling(1.0, "fan_avg", "uniform")


class TransformerLayerType(enum.Enum):
    """Which block a ``TransformerLayer`` builds."""

    ENCODER = "encoder"
    DECODER = "decoder"


@dataclasses.dataclass(unsafe_hash=True)
class TransformerLayerConfig:
    """The config of ``TransformerLayer`` (:class:`fp8jax.flax.TransformerLayer` documents the
    fields)."""

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
    bias_init: Initializer = zeros
    apply_residual_connection_post_layernorm: bool = False
    output_layernorm: bool = False
    float32_attention_logits: bool = False
    layer_type: TransformerLayerType = TransformerLayerType.ENCODER
    self_attn_mask_type: str = "causal"
    self_attn_bias_type: str | None = None
    enable_relative_embedding: bool = True
    relative_embedding: Any = None
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
    mlp: str = "dense"
    moe: MoEBlockConfig | None = None
    attention_implementation: str | None = None
    fp8_dpa: bool = False
    context_parallel_axis: str = ""
    context_parallel_strategy: str = "DEFAULT"
    context_parallel_causal_load_balanced: bool = False

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
        self.check_config()
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

    def check_config(self) -> None:
        """The refusals of the configuration alone."""
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
            positive_int(owner, name, getattr(self, name))
        self._check_mlp()
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"{owner}: num_attention_heads={self.num_attention_heads} must divide "
                f"hidden_size={self.hidden_size}"
            )
        for name in ("hidden_dropout", "attention_dropout", "intermediate_dropout", "drop_path"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v < 1:
                raise ValueError(f"{owner}: {name} must be a float in [0, 1), got {v!r}")

    def _check_mlp(self) -> None:
        """``mlp`` and ``moe``: the block's MLP kind and its mixture-of-experts settings."""
        owner = "TransformerLayer"
        if self.mlp not in ("dense", "moe"):
            raise ValueError(f"{owner}: mlp must be 'dense' or 'moe', got {self.mlp!r}")
        if self.moe is not None and not isinstance(self.moe, MoEBlockConfig):
            raise TypeError(
                f"{owner}: moe must be a fp8jax.layers.MoEBlockConfig (or None), got "
                f"{type(self.moe).__name__}"
            )
        if self.mlp == "dense":
            if self.moe is not None:
                raise ValueError(f"{owner}: moe is set but mlp='dense'; pass mlp='moe'")
            return
        if self.apply_residual_connection_post_layernorm:
            raise ValueError(
                f"{owner}: mlp='moe' does not support apply_residual_connection_post_layernorm "
                "(the MoE block returns no norm output)"
            )
        if self.intermediate_dropout:
            raise ValueError(
                f"{owner}: mlp='moe' has no intermediate dropout; got intermediate_dropout="
                f"{self.intermediate_dropout!r}"
            )
        self.moe_config().check_config()

    def moe_config(self) -> MoEBlockConfig:
        """The ``mlp`` child's config with ``mlp="moe"``: ``moe`` (default ``MoEBlockConfig(
        intermediate_size=mlp_hidden_size, activation_type=mlp_activations[0])``) with the
        layer's pre-norm, dtypes, kernel init and (with ``logical_axes``) axis names."""
        base = self.moe or MoEBlockConfig(
            intermediate_size=self.mlp_hidden_size, activation_type=self.mlp_activations[0]
        )
        axes = self._axes(
            scale_axes=("embed",), ln_bias_axes=("embed",), gate_kernel_axes=("embed", None),
            wi_kernel_axes=("exp", "embed", "mlp"), wo_kernel_axes=("exp", "mlp", "embed"),
        )  # fmt: skip
        return dataclasses.replace(
            base, enable_layernorm=True, layernorm_type=self.layernorm_type,
            epsilon=self.layernorm_epsilon, zero_centered_gamma=self.zero_centered_gamma,
            dtype=self.dtype, param_dtype=self.param_dtype,
            kernel_init=base.kernel_init or self.mlp_kernel_init,
            input_axes=self._input_axes(), **axes,
        )  # fmt: skip

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

    def decode_length(self, cache_len: int, max_decode_length: Any) -> int:
        """The sequence length the relative position bias covers with ``decode=True``: the
        cache's, ``cache_len`` (the input's, on the call that creates the cache); a
        ``max_decode_length`` must equal it."""
        if max_decode_length is None:
            return cache_len
        if (
            not isinstance(max_decode_length, (int, np.integer))
            or isinstance(max_decode_length, bool)
            or max_decode_length != cache_len
        ):
            raise ValueError(
                f"TransformerLayer: max_decode_length must be None or the key/value cache's "
                f"length {cache_len} (the sequence length of the input that created the cache), "
                f"got {max_decode_length!r}"
            )
        return cache_len

    def submodule_configs(self) -> dict[str, Any]:
        """The layer's children as ``{submodule name: config}``: the self-attention
        (``attention``, or ``self_attention`` in a decoder), a decoder's
        ``encoder_decoder_attention``, ``relpos_bias`` (with ``enable_relative_embedding`` and
        no ``relative_embedding`` of your own), ``mlp`` and ``output_layernorm`` (with
        ``output_layernorm``)."""
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
            attention_implementation=self.attention_implementation, fp8_dpa=self.fp8_dpa,
            context_parallel_axis=self.context_parallel_axis,
            context_parallel_strategy=self.context_parallel_strategy,
            context_parallel_causal_load_balanced=self.context_parallel_causal_load_balanced,
            **common,
            **self._axes(
                scale_axes=("embed",), ln_bias_axes=("embed",), qkv_kernel_axes=("embed", "heads"),
                qkv_bias_axes=("heads",), out_kernel_axes=("heads", "embed"),
                out_bias_axes=("embed",),
            ),
        )  # fmt: skip
        out: dict[str, Any] = {
            "self_attention" if decoder else "attention": MultiHeadAttentionConfig(**attention)
        }
        if decoder:
            # the encoder's sequence is not split: the cross-attention runs without CP
            cross = dict(attention, input_layernorm=True, attn_mask_type="padding",
                         attn_bias_type="no_bias", context_parallel_axis="")  # fmt: skip
            out["encoder_decoder_attention"] = MultiHeadAttentionConfig(**cross)
        if self.enable_relative_embedding and self.relative_embedding is None:
            out["relpos_bias"] = RelativePositionBiasesConfig(**dict(
                num_buckets=32, max_distance=128, num_attention_heads=self.num_attention_heads,
                embedding_init=_RELPOS_INIT,
                **self._axes(embedding_axes=("heads", "relpos_buckets")),
            ))  # fmt: skip
        out["mlp"] = self.moe_config() if self.mlp == "moe" else LayerNormMLPConfig(**dict(
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
            out["output_layernorm"] = LayerNormConfig(**dict(
                epsilon=self.layernorm_epsilon, layernorm_type=self.layernorm_type,
                zero_centered_gamma=self.zero_centered_gamma, dtype=self.dtype,
                param_dtype=self.param_dtype,
                **self._axes(scale_axes=("embed",), bias_axes=("embed",)),
            ))  # fmt: skip
        return out

    def forward(
        self,
        children: Mapping[str, Callable[..., Any]],
        inputs: jax.Array,
        encoded: jax.Array | None,
        attention_mask: Any,
        encoder_decoder_mask: Any,
        *,
        bias_length: int,
        drop: Callable[[jax.Array, float, Sequence[int]], jax.Array],
    ) -> jax.Array:
        """The block's data flow on checked inputs (see :class:`fp8jax.flax.TransformerLayer`).

        ``children``, the front-end's submodules as callables by name: the self-attention
        ``(x, mask, bias) -> (out, ln_out)``, ``encoder_decoder_attention`` ``(x, encoded,
        mask) -> (out, ln_out)``, ``relpos_bias`` ``(q_len, k_len, bidirectional)``, ``mlp``
        ``(x) -> (out, ln_out)`` and ``output_layernorm`` ``(x)``; ``drop(x, rate,
        broadcast_dims)`` is the front-end's dropout (``x`` itself when off); ``bias_length``:
        the length the relative position bias covers (the cache's when decoding)."""
        decoder = self.layer_type is TransformerLayerType.DECODER
        post = self.apply_residual_connection_post_layernorm
        bias = None
        if self.enable_relative_embedding:
            bias = children["relpos_bias"](bias_length, bias_length, not decoder)
        x, ln = children["self_attention" if decoder else "attention"](inputs, attention_mask, bias)
        x = self._drop_path(drop, drop(x, self.hidden_dropout, self.hidden_dropout_dims))
        x = x + (ln if post else inputs)
        mlp_input = x
        if decoder:
            y, ln = children["encoder_decoder_attention"](x, encoded, encoder_decoder_mask)
            y = drop(y, self.hidden_dropout, self.hidden_dropout_dims)
            mlp_input = y + (ln if post else x)
        z, ln = children["mlp"](mlp_input)
        residual = ln if post else mlp_input
        z = self._drop_path(drop, drop(z, self.hidden_dropout, self.hidden_dropout_dims))
        z = z + residual
        if self.output_layernorm:
            z = children["output_layernorm"](z)
        return z.astype(inputs.dtype)

    def _drop_path(self, drop: Callable[..., jax.Array], x: jax.Array) -> jax.Array:
        """Stochastic depth: whole examples of a residual branch dropped."""
        if self.drop_path <= 0:
            return x
        batch_dim = 1 if self.transpose_batch_sequence else 0
        return drop(x, self.drop_path, tuple(d for d in range(x.ndim) if d != batch_dim))
