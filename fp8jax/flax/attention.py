"""Flax Linen attention with TransformerEngine's argument names and params.

``MultiHeadAttention`` (here): the QKV projections (with the input norm fused in) and the output
projection in FP8, the attention core in high precision; ``DotProductAttention`` (the core,
:mod:`fp8jax.flax.dot_product_attention`) and ``RelativePositionBiases``
(:mod:`fp8jax.flax.relative_position`) are re-exported from here.

>>> import jax, jax.numpy as jnp, fp8jax
>>> from fp8jax.flax import MultiHeadAttention
>>> mha = MultiHeadAttention(head_dim=4, num_attention_heads=2)
>>> x = jnp.ones((2, 3, 8))                                  # (batch, seq, hidden)
>>> with fp8jax.autocast(enabled=True, recipe=fp8jax.Float8CurrentScaling()):
...     variables = mha.init(jax.random.key(0), x, x)
...     out, ln_out = mha.apply(variables, x, None)              # None: self-attention
>>> out.shape, ln_out is None
((2, 3, 8), True)
>>> jax.tree.map(jnp.shape, variables["params"])  # doctest: +NORMALIZE_WHITESPACE
{'out': {'kernel': (8, 8)},
 'qkv': {'kernel': (8, 3, 8), 'ln_bias': (8,), 'scale': (8,)}}
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.typing import Initializer

from fp8jax.flax._params import check_names
from fp8jax.flax._te_args import check_no_score_mod, check_off
from fp8jax.flax._variables import check_float_array
from fp8jax.flax.dense import DenseGeneral
from fp8jax.flax.dot_product_attention import (
    DotProductAttention,
    canonical_mask_type,
    check_heads,
)
from fp8jax.flax.layernorm import LayerNormDenseGeneral
from fp8jax.flax.relative_position import RelativePositionBiases
from fp8jax.rotary import canonical_group_method, rotary_pos_emb

__all__ = [
    "DotProductAttention",
    "MultiHeadAttention",
    "RelativePositionBiases",
    "decode_step",
    "default_mha_kernel_init",
]

#: TE's default QKV/output kernel initializer: ``variance_scaling(1.0, "fan_in", "normal")``.
default_mha_kernel_init = nn.initializers.variance_scaling(1.0, "fan_in", "normal")


def _concat_init(inits: Sequence[Initializer]) -> Initializer:
    """Draws a flat ``(hidden, n * f)`` kernel as ``n`` blocks ``(hidden, f)``, one key and one
    initializer each (so each block has fan-in ``hidden``); reshaped by the layer to
    ``(hidden, n, f)``, block ``i`` is ``kernel[:, i, :]`` (TE's fused QKV/KV init)."""

    def init(rng: jax.Array, shape: tuple[int, ...], dtype: Any = jnp.float32) -> jax.Array:
        n = len(inits)
        f = shape[-1] // n
        keys = jax.random.split(rng, n)
        blocks = [fn(k, (*shape[:-1], f), dtype) for fn, k in zip(inits, keys, strict=True)]
        return jnp.concatenate(blocks, axis=-1)

    return init


def _fused_axes(names: tuple[str | None, ...], n_dims: int) -> tuple[str | None, ...]:
    """Logical names of a fused kernel/bias: ``None`` for the stacking dim before the last."""
    if not names:
        return ()
    return (*names[:-1], None, names[-1]) if n_dims else names


def check_attention_inputs(
    owner: str, inputs_q: Any, inputs_kv: Any, transpose_batch_sequence: bool
) -> tuple[jax.Array, jax.Array]:
    """``(inputs_q, inputs_kv)`` checked (float arrays of rank 3 with one batch size; for
    self-attention pass the same object twice), for the Linen and the NNX attention."""
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


class MultiHeadAttention(nn.Module):
    """``[norm] -> Q, K, V projections (FP8) -> [rotary] -> attention -> output projection
    (FP8)``, TransformerEngine's ``MultiHeadAttention``.

    Call: ``mha(inputs_q, inputs_kv, mask=None, bias=None, *, decode=False,
    deterministic=False, segment_ids=None)`` returns ``(out, ln_out)``: ``out`` has
    ``inputs_q``'s shape; ``ln_out`` is the query input after the norm (the raw input with
    ``input_layernorm=False``) when ``return_layernorm_output``, and also, as in TE, for
    self-attention without the packed QKV projection (GQA or ``fuse_qkv_params=False``); else
    ``None``. Self-attention is ``inputs_kv=None`` (fp8jax's, recommended) or ``inputs_q is
    inputs_kv`` (TE's rule): the keys and values are projected from the normalised query
    input. Object identity does not survive ``jax.jit`` arguments (one array passed twice
    arrives as two tracers) or ``nn.remat`` of this module (which retraces its arguments), so
    pass ``None`` there; a module initialised as self-attention with the packed ``qkv`` kernel
    and then called with a distinct ``inputs_kv`` is a ValueError that says so.
    Cross-attention projects ``inputs_kv`` as is (no norm); its width may differ.
    ``mask``/``bias``/``segment_ids`` go to :class:`~fp8jax.flax.DotProductAttention` (mask:
    ``True`` = masked out). ``decode=True``
    uses an autoregressive key/value cache in the ``"cache"`` collection, as TE: ``init`` with
    the full-length input creates it, then each ``apply(..., decode=True,
    mutable=["cache"])`` takes one token (see :meth:`_cache`).

    Params (TE's names and shapes; ``h`` hidden, ``H`` heads, ``G`` GQA groups, ``d``
    head_dim):

    - self-attention, ``fuse_qkv_params`` and ``G == H``: ``qkv`` = {``scale``, ``ln_bias``,
      ``kernel`` ``(h, 3, H*d)``, ``bias`` ``(3, H*d)``};
    - otherwise with ``fuse_qkv_params``: ``query`` = {``scale``, ``ln_bias``, ``kernel``
      ``(h, H*d)``, ``bias``} and ``kv`` = {``kernel`` ``(h_kv, 2, G*d)``, ``bias`` ``(2,
      G*d)``};
    - ``fuse_qkv_params=False``: ``query`` as above, ``key`` and ``value`` = {``kernel``
      ``(h_kv, G*d)``, ``bias``};
    - ``out`` = {``kernel`` ``(H*d, h)``, ``bias`` ``(h,)``}.

    ``scale``/``ln_bias`` exist with ``input_layernorm`` (``ln_bias`` for LayerNorm only), the
    biases with ``use_bias``. The query kernel is divided by ``sqrt(d)`` at init when
    ``scaled_query_init``; the logits are scaled by ``1/sqrt(d)`` only with
    ``scale_attn_logits`` (TE's T5-style defaults: scaled init, unscaled logits). Each of the
    projections (``qkv`` or ``query``, ``kv`` or ``key``/``value``, ``out``) is an FP8 layer
    with the 3 FP8 roles of a dense layer under ``fp8jax.autocast(enabled=True, ...)``.

    Differences from TE: ``dtype`` is the computation dtype (default promoted from inputs and
    params, as in Flax) and ``param_dtype`` the params'; logical axis names default to none
    (TE's are ``kernel (embed, [joined,] tp)`` with its own ``nvte_*`` names; fp8jax's
    :data:`~fp8jax.flax.DEFAULT_RULES` suggest ``qkv_kernel_axes=("embed", "heads")``,
    ``qkv_bias_axes=("heads",)``, ``out_kernel_axes=("heads", "embed")``,
    ``out_bias_axes=("embed",)``, ``layernorm_input_axes=("batch", "length", "embed")``);
    ``enable_sequence_parallel`` has no effect (sequence parallelism comes from logical axis
    rules); LoRA, ``softmax_type``, ``score_mod``, ``score_mod_bprop`` and TE's deprecated
    aliases (``num_heads``, ``dropout_rate``, ``output_layernorm``,
    ``apply_residual_connection_post_layernorm``, ``fuse_qkv``) are accepted at TE's defaults
    only (ValueError otherwise); in decode
    steps rotary embeddings use the cached position (TE's use position 0) and sliding windows
    and ``segment_ids`` are rejected; the attention core is not FP8
    (``recipe.fp8_mha``/``fp8_dpa`` are rejected); rotary embeddings are applied in float32
    and cast back (as TE).

    Attributes:
      head_dim, num_attention_heads, num_gqa_groups: as :class:`DotProductAttention`.
      attention_dropout, dropout_rng_name, attn_mask_type (default ``"causal"``),
        attn_bias_type, float32_logits, window_size: passed to the attention core.
      input_layernorm, layernorm_type, layernorm_epsilon, zero_centered_gamma: the norm on the
        query input.
      return_layernorm_output: see the return value above.
      kernel_init: default TE's ``variance_scaling(1.0, "fan_in", "normal")``.
      use_bias, bias_init: biases of all four projections.
      enable_rotary_pos_emb, rotary_pos_emb_windows, rotary_pos_emb_group_method: rotary
        embeddings on the projected queries and keys (:mod:`fp8jax.rotary`).
      fuse_qkv_params: one ``qkv`` (or ``kv``) kernel instead of separate ones.
      transpose_batch_sequence: inputs are ``[seq, batch, hidden]``; default ``False``
        (``[batch, seq, hidden]``), TE's since v2.10.
      scale_attn_logits, scaled_query_init: see above.
      dtype, param_dtype: see above.
      layernorm_input_axes, scale_axes, ln_bias_axes, qkv_kernel_axes (2 names: input width,
        projected width; the fused kernels get ``None`` for their stacking dim),
        qkv_bias_axes (1), out_kernel_axes (2), out_bias_axes (1): logical axis names.
      attention_implementation: ``implementation`` of the attention core.
      low_rank_adaptation_scope, low_rank_adaptation_dim, low_rank_adaptation_alpha,
        enable_sequence_parallel, softmax_type, score_mod, score_mod_bprop, num_heads,
        dropout_rate, output_layernorm, apply_residual_connection_post_layernorm, fuse_qkv:
        TE's (see above).
    """

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
    bias_init: Initializer = nn.initializers.zeros_init()
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

    @nn.compact
    def __call__(
        self,
        inputs_q: jax.Array,
        inputs_kv: jax.Array,
        mask: jax.Array | None = None,
        bias: jax.Array | None = None,
        *,
        decode: bool = False,
        deterministic: bool = False,
        segment_ids: Any = None,
        score_mod_tensors: Any = None,
        score_mod_bprop_tensors: Any = None,
    ) -> tuple[jax.Array, jax.Array | None]:
        owner = "MultiHeadAttention"
        if inputs_kv is None:
            inputs_kv = inputs_q
        is_self = inputs_q is inputs_kv
        check_no_score_mod(owner, score_mod_tensors, score_mod_bprop_tensors)
        step = decode and self.has_variable("cache", "cached_key")
        heads, groups, inputs_q, inputs_kv = self.check(
            inputs_q, inputs_kv, decode=decode, step=step, segment_ids=segment_ids
        )
        d = int(self.head_dim)
        packed = self.fuse_qkv_params and groups == heads
        if packed and not is_self and "qkv" in self.variables.get("params", {}):
            raise ValueError(
                f"{owner}: initialised as self-attention (one packed 'qkv' kernel: inputs_kv was "
                "inputs_q) but called with a different inputs_kv object. Self-attention is "
                "decided by identity (TE's rule), which jax.jit arguments (one array passed "
                "twice arrives as two tracers), nn.remat of this module and copies do not "
                "keep: pass inputs_kv=None for self-attention."
            )
        if packed and is_self and "query" in self.variables.get("params", {}):
            raise ValueError(
                f"{owner}: initialised as cross-attention ('query' and 'kv' kernels: inputs_kv "
                "was another array) but called with inputs_kv being inputs_q (or None), i.e. "
                "as self-attention. Initialise with inputs_kv=None for self-attention, or pass "
                "the key/value input as a distinct array."
            )
        configs = self.projection_configs(is_self, inputs_q.shape[-1])
        layers = {name: cls(name=name, **kw) for name, (cls, kw) in configs.items()}
        if "qkv" in layers:
            qkv, ln_out = layers["qkv"](inputs_q)
            q, k, v = qkv[..., 0, :], qkv[..., 1, :], qkv[..., 2, :]
        else:
            q, ln_out = layers["query"](inputs_q)
            kv_in = ln_out if is_self else inputs_kv
            if "kv" in layers:
                kv = layers["kv"](kv_in)
                k, v = kv[..., 0, :], kv[..., 1, :]
            else:
                k, v = layers["key"](kv_in), layers["value"](kv_in)

        q = q.reshape(*q.shape[:2], heads, d)
        k = k.reshape(*k.shape[:2], groups, d)
        v = v.reshape(*v.shape[:2], groups, d)
        mask_type = self.attn_mask_type
        positions = None
        if step:
            positions = self.get_variable("cache", "cache_index")[None]
        if self.enable_rotary_pos_emb:
            rope = dict(
                windows=self.rotary_pos_emb_windows,
                transpose_batch_sequence=self.transpose_batch_sequence,
                group_method=self.rotary_pos_emb_group_method,
                positions=positions,
            )
            q = rotary_pos_emb(q, **rope)
            k = rotary_pos_emb(k, **rope)
        if decode:
            k, v, mask, bias = self._cache(q, k, v, mask, bias)
            if step:
                mask_type = "padding"
        x = DotProductAttention(
            **self.core_config(mask_type, jnp.result_type(q, k, v)),
            dropout_rng_name=self.dropout_rng_name, float32_logits=self.float32_logits,
            name="attention",
        )(q, k, v, mask, bias, deterministic=deterministic, segment_ids=segment_ids)  # fmt: skip
        x = x.reshape(*x.shape[:2], heads * d)
        return layers["out"](x), ln_out

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
        cache. Returns ``(heads, gqa groups, inputs_q, inputs_kv)``. Shared with
        :class:`fp8jax.nnx.MultiHeadAttention`, which calls it with its own call's arguments."""
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
        """The attention core's settings (the attributes of
        :class:`~fp8jax.flax.DotProductAttention` and arguments of
        :func:`~fp8jax.flax.dot_product_attention.attention_core`) for inputs of ``dtype``;
        ``attn_mask_type``: the call's (``"padding"`` on a decode step). Shared with
        :class:`fp8jax.nnx.MultiHeadAttention`."""
        heads, groups = self.check_config()
        d = int(self.head_dim)
        return dict(
            head_dim=d, num_attention_heads=heads, num_gqa_groups=groups,
            attention_dropout=self.attention_dropout, attn_mask_type=attn_mask_type,
            attn_bias_type=self.attn_bias_type, dtype=dtype,
            scale_factor=1.0 / math.sqrt(d) if self.scale_attn_logits else 1.0,
            transpose_batch_sequence=self.transpose_batch_sequence, window_size=self.window_size,
            implementation=self.attention_implementation,
        )  # fmt: skip

    def projection_configs(
        self, is_self: bool, out_features: int
    ) -> dict[str, tuple[type[nn.Module], dict[str, Any]]]:
        """The FP8 projections as ``{param scope name: (Linen class, its attributes)}``:
        ``qkv`` (self-attention with the packed kernel) or ``query`` and ``kv`` (or ``key``
        and ``value``), and ``out`` (``out_features`` wide). Shared with
        :class:`fp8jax.nnx.MultiHeadAttention`, which configures its layers from them."""
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
        layers: dict[str, tuple[type[nn.Module], dict[str, Any]]] = {}
        if self.fuse_qkv_params and groups == heads and is_self:
            layers["qkv"] = (LayerNormDenseGeneral, dict(
                features=(3, q_width), kernel_init=_concat_init([query_init, kernel_init,
                                                                 kernel_init]),
                kernel_axes=_fused_axes(kax, 1), bias_axes=_fused_axes(bax, 1),
                return_layernorm_output=self.return_layernorm_output, **ln_kwargs,
            ))  # fmt: skip
        else:
            layers["query"] = (LayerNormDenseGeneral, dict(
                features=q_width, kernel_init=query_init, kernel_axes=kax, bias_axes=bax,
                return_layernorm_output=self.return_layernorm_output or is_self, **ln_kwargs,
            ))  # fmt: skip
            if self.fuse_qkv_params:
                layers["kv"] = (DenseGeneral, dict(
                    features=(2, kv_width), kernel_init=_concat_init([kernel_init, kernel_init]),
                    kernel_axes=_fused_axes(kax, 1), bias_axes=_fused_axes(bax, 1),
                    **dense_kwargs,
                ))  # fmt: skip
            else:
                proj = dict(features=kv_width, kernel_init=kernel_init, kernel_axes=kax,
                            bias_axes=bax, **dense_kwargs)  # fmt: skip
                layers["key"] = (DenseGeneral, proj)
                layers["value"] = (DenseGeneral, dict(proj))
        layers["out"] = (DenseGeneral, dict(
            features=out_features, kernel_init=kernel_init,
            kernel_axes=tuple(self.out_kernel_axes), bias_axes=tuple(self.out_bias_axes),
            **dense_kwargs,
        ))  # fmt: skip
        return layers

    def _cache(
        self, q: jax.Array, k: jax.Array, v: jax.Array, mask: Any, bias: Any
    ) -> tuple[jax.Array, jax.Array, Any, Any]:
        """The autoregressive key/value cache (``decode=True``).

        The first call (``init``) creates ``cache`` variables ``cached_key``/``cached_value``
        shaped as the full-length keys/values and ``cache_index`` = 0, and attends normally.
        Each later call takes one token: its key/value are written at ``cache_index``, the
        query attends to the cached positions ``<= cache_index`` (the causal constraint; with
        a padding mask type also the given mask, ``(b, 1, 1, length)``), a bias is sliced at
        query row ``cache_index``, and ``cache_index`` advances."""
        is_step = self.has_variable("cache", "cached_key")
        ck = self.variable("cache", "cached_key", jnp.zeros, k.shape, k.dtype)
        cv = self.variable("cache", "cached_value", jnp.zeros, v.shape, v.dtype)
        ci = self.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32))
        if not is_step:
            return k, v, mask, bias
        idx = ci.value
        seq_axis = 0 if self.transpose_batch_sequence else 1
        k, v, mask, bias = decode_step(
            ck.value, cv.value, idx, k, v, mask, bias, seq_axis=seq_axis,
            mask_type=self.attn_mask_type,
        )  # fmt: skip
        ck.value, cv.value, ci.value = k, v, idx + 1
        return k, v, mask, bias


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
    """One decode step on a key/value cache (no Flax: shared by the Linen and NNX attention).

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
