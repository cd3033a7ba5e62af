"""The config of ``MultiHeadAttention`` (FP8 projections around the high-precision attention
core), shared by both Flax APIs: fields with TransformerEngine's names and defaults, every refusal
of a call, the projections as child configs, the key/value cache step, and the forward on given
projections, core and cache. :class:`fp8jax.flax.MultiHeadAttention` documents the fields."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from typing import Any, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from fp8jax.layers.attention_core import canonical_mask_type, check_heads
from fp8jax.layers.checks import check_float_array, check_names, check_off
from fp8jax.layers.dense import DenseGeneralConfig
from fp8jax.layers.layernorm import LayerNormDenseGeneralConfig
from fp8jax.layers.params import Initializer, concat_init, default_mha_kernel_init, zeros
from fp8jax.ops.base import partition
from fp8jax.rotary import canonical_group_method, rotary_pos_emb

__all__ = [
    "KVCache",
    "MultiHeadAttentionConfig",
    "check_attention_inputs",
    "decode_step",
]


def _fused_axes(names: tuple[str | None, ...], n_dims: int) -> tuple[str | None, ...]:
    """Logical names of a fused kernel/bias: ``None`` for the stacking dim before the last."""
    if not names:
        return ()
    return (*names[:-1], None, names[-1]) if n_dims else names


def check_attention_inputs(
    owner: str, inputs_q: Any, inputs_kv: Any, transpose_batch_sequence: bool
) -> tuple[jax.Array, jax.Array]:
    """``(inputs_q, inputs_kv)`` checked (float arrays of rank 3 with one batch size; for
    self-attention pass the same object twice)."""
    q = check_float_array(owner, "inputs_q", inputs_q)
    kv = q if inputs_kv is inputs_q else check_float_array(owner, "inputs_kv", inputs_kv)
    for name, t in (("inputs_q", q), ("inputs_kv", kv)):
        if t.ndim != 3:
            raise ValueError(f"{owner}: {name} must be [batch, seq, hidden] (or [seq, batch, "
                             f"hidden]), got shape {t.shape}")  # fmt: skip
    bdim = 1 if transpose_batch_sequence else 0
    if q.shape[bdim] != kv.shape[bdim]:
        raise ValueError(
            f"{owner}: inputs_q and inputs_kv batch sizes differ: {q.shape} vs {kv.shape} "
            f"(transpose_batch_sequence={transpose_batch_sequence})"
        )
    return q, kv


def decode_step(
    cached_key: jax.Array,
    cached_value: jax.Array,
    index: jax.Array,
    k: jax.Array,
    v: jax.Array,
    mask: Any,
    bias: Any,
    *,
    seq_axis: int,
    mask_type: str,
    owner: str = "MultiHeadAttention",
) -> tuple[jax.Array, jax.Array, Any, Any]:
    """One decode step on a key/value cache.

    Writes the token's ``k``/``v`` (one position along ``seq_axis``) into the caches at
    ``index`` and returns ``(keys, values, mask, bias)`` for the attention: the updated caches,
    a mask (True = masked out) of the positions after ``index`` (with a padding
    ``mask_type``, or-ed with the given ``mask``), and ``bias`` sliced at query row ``index``
    when it has one row per cached position. The caller stores the caches and ``index + 1``."""
    length = cached_key.shape[seq_axis]
    expect = list(cached_key.shape)
    expect[seq_axis] = 1
    if tuple(k.shape) != tuple(expect):
        raise ValueError(
            f"{owner}: a decode step takes one token: keys of shape {tuple(expect)} for the "
            f"cache {cached_key.shape}, got {k.shape}"
        )
    k = jax.lax.dynamic_update_slice_in_dim(cached_key, k.astype(cached_key.dtype), index, seq_axis)
    v = jax.lax.dynamic_update_slice_in_dim(
        cached_value, v.astype(cached_value.dtype), index, seq_axis
    )
    future = (jnp.arange(length) > index)[None, None, None, :]
    if mask is not None and canonical_mask_type(mask_type) in ("padding", "padding_causal"):
        mask = jnp.asarray(mask)
        mask = (mask if mask.dtype == jnp.bool_ else mask != 0) | future
    else:
        mask = future
    if bias is not None:
        bias = jnp.asarray(bias)
        if bias.ndim == 4 and bias.shape[2] == length:
            bias = jax.lax.dynamic_slice_in_dim(bias, index, 1, axis=2)
    return k, v, mask, bias


class KVCache(Protocol):
    """A front-end's key/value cache, as :meth:`MultiHeadAttentionConfig.forward` uses it."""

    def index(self) -> jax.Array | None:
        """The position of this call's token (a decode step), or ``None`` (no step: the call
        creates the cache, or attends normally)."""

    def update(self, k: jax.Array, v: jax.Array, mask: Any, bias: Any) -> tuple[Any, ...]:
        """The keys, values, mask and bias the attention uses; a step writes the token into
        the cache (:func:`decode_step`) and advances the index."""


@dataclasses.dataclass(unsafe_hash=True)
class MultiHeadAttentionConfig:
    """The config of ``MultiHeadAttention`` (:class:`fp8jax.flax.MultiHeadAttention` documents
    the fields)."""

    head_dim: int
    num_attention_heads: int
    num_gqa_groups: int | None = None
    attention_dropout: float = 0.0
    dropout_rng_name: str = "dropout"
    input_layernorm: bool = True
    layernorm_type: str = "layernorm"
    layernorm_epsilon: float = 1e-6
    return_layernorm_output: bool = False
    zero_centered_gamma: bool = False
    kernel_init: Initializer | None = None
    use_bias: bool = False
    bias_init: Initializer = zeros
    attn_mask_type: str = "causal"
    attn_bias_type: str | None = None
    enable_rotary_pos_emb: bool = False
    rotary_pos_emb_windows: tuple[float, float] = (1, 10000)
    rotary_pos_emb_group_method: str = "consecutive"
    dtype: Any = None
    param_dtype: Any = jnp.float32
    fuse_qkv_params: bool = True
    transpose_batch_sequence: bool = False
    scale_attn_logits: bool = False
    scaled_query_init: bool = True
    float32_logits: bool = False
    window_size: tuple[int, int] | None = None
    layernorm_input_axes: tuple[str | None, ...] = ()
    scale_axes: tuple[str | None, ...] = ()
    ln_bias_axes: tuple[str | None, ...] = ()
    qkv_kernel_axes: tuple[str | None, ...] = ()
    qkv_bias_axes: tuple[str | None, ...] = ()
    out_kernel_axes: tuple[str | None, ...] = ()
    out_bias_axes: tuple[str | None, ...] = ()
    attention_implementation: str | None = None
    fp8_dpa: bool = False
    context_parallel_axis: str = ""
    context_parallel_strategy: str = "DEFAULT"
    context_parallel_causal_load_balanced: bool = False
    low_rank_adaptation_scope: str = "none"
    low_rank_adaptation_dim: int = 32
    low_rank_adaptation_alpha: float | None = None
    enable_sequence_parallel: bool = False
    softmax_type: str = "vanilla"
    score_mod: Any = None
    score_mod_bprop: Any = None
    num_heads: int | None = None
    dropout_rate: float | None = None
    output_layernorm: bool | None = None
    apply_residual_connection_post_layernorm: bool | None = None
    fuse_qkv: bool | None = None

    def check_config(self) -> tuple[int, int]:
        """The refusals of the configuration alone; returns ``(heads, gqa groups)``."""
        owner = "MultiHeadAttention"
        check_off(
            owner, self, "low_rank_adaptation_scope", "softmax_type", "score_mod",
            "score_mod_bprop", "num_heads", "dropout_rate", "output_layernorm",
            "apply_residual_connection_post_layernorm", "fuse_qkv",
        )  # fmt: skip
        heads, groups = check_heads(owner, self.num_attention_heads, self.num_gqa_groups)
        if (
            not isinstance(self.head_dim, (int, np.integer))
            or isinstance(self.head_dim, bool)
            or self.head_dim < 1
        ):
            raise ValueError(f"{owner}: head_dim must be a positive int, got {self.head_dim!r}")
        canonical_mask_type(self.attn_mask_type)
        if self.enable_rotary_pos_emb:
            canonical_group_method(self.rotary_pos_emb_group_method, "rotary_pos_emb_group_method")
            if self.head_dim % 2:
                raise ValueError(
                    f"{owner}: rotary embeddings need an even head_dim, got {self.head_dim}"
                )
        for name, n in (("qkv_kernel_axes", 2), ("qkv_bias_axes", 1), ("out_kernel_axes", 2),
                        ("out_bias_axes", 1)):  # fmt: skip
            if getattr(self, name):
                check_names(owner, name, getattr(self, name), n)
        return heads, groups

    def check(
        self,
        inputs_q: Any,
        inputs_kv: Any,
        *,
        decode: bool = False,
        step: bool = False,
        segment_ids: Any = None,
    ) -> tuple[int, int, jax.Array, jax.Array]:
        """Every refusal of a call (ValueError/TypeError naming the argument): the
        configuration, the inputs (``inputs_kv is inputs_q`` for self-attention), and with
        ``decode`` what decoding supports; ``step``: the call is a decode step on an existing
        cache. Returns ``(heads, gqa groups, inputs_q, inputs_kv)``."""
        owner = "MultiHeadAttention"
        heads, groups = self.check_config()
        q, kv = check_attention_inputs(owner, inputs_q, inputs_kv, self.transpose_batch_sequence)
        if decode:
            mask_type = canonical_mask_type(self.attn_mask_type)
            if mask_type not in ("causal", "padding_causal"):
                raise ValueError(
                    f"{owner}: decode=True needs a causal attention (attn_mask_type 'causal' or "
                    "'padding_causal'): each cached step attends to the tokens before it; got "
                    f"attn_mask_type={self.attn_mask_type!r}"
                )
            if self.window_size is not None:
                raise ValueError(
                    f"{owner}: decode=True does not support window_size (sliding-window "
                    f"attention over the cache); got window_size={self.window_size!r}"
                )
        if step and segment_ids is not None:
            raise ValueError(f"{owner}: decode steps do not support segment_ids")
        return heads, groups, q, kv

    def core_config(self, attn_mask_type: str, dtype: Any) -> dict[str, Any]:
        """The attention core's settings (the arguments of
        :func:`~fp8jax.layers.attention_core.attention_core`, the attributes of
        :class:`~fp8jax.flax.DotProductAttention`) for inputs of ``dtype``;
        ``attn_mask_type``: the call's (``"padding"`` on a decode step)."""
        heads, groups = self.check_config()
        d = int(self.head_dim)
        return dict(
            head_dim=d, num_attention_heads=heads, num_gqa_groups=groups,
            attention_dropout=self.attention_dropout, attn_mask_type=attn_mask_type,
            attn_bias_type=self.attn_bias_type, dtype=dtype,
            scale_factor=1.0 / math.sqrt(d) if self.scale_attn_logits else 1.0,
            transpose_batch_sequence=self.transpose_batch_sequence, window_size=self.window_size,
            implementation=self.attention_implementation, fp8_dpa=self.fp8_dpa,
            context_parallel_axis=self.context_parallel_axis,
            context_parallel_strategy=self.context_parallel_strategy,
            context_parallel_causal_load_balanced=self.context_parallel_causal_load_balanced,
        )  # fmt: skip

    def cache_shape(self, input_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The cached keys' (and values') shape for inputs of ``input_shape``."""
        _, groups = self.check_config()
        return (*input_shape[:2], groups, int(self.head_dim))

    def projection_configs(self, is_self: bool, out_features: int) -> dict[str, Any]:
        """The FP8 projections as ``{child name: config}``: ``qkv`` (self-attention with the
        packed kernel) or ``query`` and ``kv`` (or ``key`` and ``value``), and ``out``
        (``out_features`` wide); a :class:`LayerNormDenseGeneralConfig` or
        :class:`DenseGeneralConfig` each."""
        heads, groups = self.check_config()
        d = int(self.head_dim)
        q_width, kv_width = heads * d, groups * d
        kernel_init = self.kernel_init or default_mha_kernel_init
        depth = math.sqrt(d) if self.scaled_query_init else 1.0

        def query_init(rng: jax.Array, shape: tuple[int, ...], dtype: Any = jnp.float32):
            return kernel_init(rng, shape, dtype) / jnp.asarray(depth, dtype)

        ln_kwargs = dict(
            enable_layernorm=self.input_layernorm, layernorm_type=self.layernorm_type,
            epsilon=self.layernorm_epsilon, zero_centered_gamma=self.zero_centered_gamma,
            scale_axes=self.scale_axes, ln_bias_axes=self.ln_bias_axes, use_bias=self.use_bias,
            bias_init=self.bias_init, dtype=self.dtype, param_dtype=self.param_dtype,
            layernorm_input_axes=self.layernorm_input_axes,
        )  # fmt: skip
        dense_kwargs = dict(use_bias=self.use_bias, bias_init=self.bias_init, dtype=self.dtype,
                            param_dtype=self.param_dtype)  # fmt: skip
        kax, bax = tuple(self.qkv_kernel_axes), tuple(self.qkv_bias_axes)
        out: dict[str, Any] = {}
        if self.fuse_qkv_params and groups == heads and is_self:
            out["qkv"] = LayerNormDenseGeneralConfig(
                features=(3, q_width),
                kernel_init=concat_init([query_init, kernel_init, kernel_init]),
                kernel_axes=_fused_axes(kax, 1), bias_axes=_fused_axes(bax, 1),
                return_layernorm_output=self.return_layernorm_output, **ln_kwargs,
            )  # fmt: skip
        else:
            out["query"] = LayerNormDenseGeneralConfig(
                features=q_width, kernel_init=query_init, kernel_axes=kax, bias_axes=bax,
                return_layernorm_output=self.return_layernorm_output or is_self, **ln_kwargs,
            )  # fmt: skip
            if self.fuse_qkv_params:
                out["kv"] = DenseGeneralConfig(
                    features=(2, kv_width), kernel_init=concat_init([kernel_init, kernel_init]),
                    kernel_axes=_fused_axes(kax, 1), bias_axes=_fused_axes(bax, 1),
                    **dense_kwargs,
                )  # fmt: skip
            else:
                for name in ("key", "value"):
                    out[name] = DenseGeneralConfig(features=kv_width, kernel_init=kernel_init,
                                                   kernel_axes=kax, bias_axes=bax,
                                                   **dense_kwargs)  # fmt: skip
        out["out"] = DenseGeneralConfig(
            features=out_features, kernel_init=kernel_init,
            kernel_axes=tuple(self.out_kernel_axes), bias_axes=tuple(self.out_bias_axes),
            **dense_kwargs,
        )  # fmt: skip
        return out

    def forward(
        self,
        project: Mapping[str, Callable[..., Any]],
        core: Callable[..., jax.Array],
        inputs_q: jax.Array,
        inputs_kv: jax.Array,
        is_self: bool,
        mask: Any,
        bias: Any,
        cache: KVCache | None = None,
    ) -> tuple[jax.Array, jax.Array | None]:
        """The attention on checked inputs: the projections ``project`` (the children, by
        name, as :meth:`projection_configs` lists them), the core ``core(q, k, v, mask, bias,
        mask_type)``, and with ``decode`` the front-end's ``cache``; returns ``(out,
        ln_output)``."""
        heads, groups = self.check_config()
        d = int(self.head_dim)
        if "qkv" in project:
            qkv, ln_out = project["qkv"](inputs_q)
            q, k, v = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]
        else:
            q, ln_out = project["query"](inputs_q)
            kv_in = ln_out if is_self else inputs_kv
            if "kv" in project:
                kv = project["kv"](kv_in)
                k, v = kv[..., 0, :], kv[..., 1, :]
            else:
                k, v = project["key"](kv_in), project["value"](kv_in)
        q = partition.reshape(q, (*q.shape[:2], heads, d))
        k = partition.reshape(k, (*k.shape[:2], groups, d))
        v = partition.reshape(v, (*v.shape[:2], groups, d))
        index = None if cache is None else cache.index()
        if self.enable_rotary_pos_emb:
            rope = dict(
                windows=self.rotary_pos_emb_windows,
                transpose_batch_sequence=self.transpose_batch_sequence,
                group_method=self.rotary_pos_emb_group_method,
                positions=None if index is None else index[None],
            )
            q, k = rotary_pos_emb(q, **rope), rotary_pos_emb(k, **rope)
        mask_type = self.attn_mask_type
        if cache is not None:
            k, v, mask, bias = cache.update(k, v, mask, bias)
            if index is not None:
                mask_type = "padding"  # the step's mask: the cached positions up to its own
        x = core(q, k, v, mask, bias, mask_type)
        x = partition.reshape(x, (*x.shape[:2], heads * d))
        return project["out"](x), ln_out
