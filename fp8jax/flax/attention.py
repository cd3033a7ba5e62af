"""Flax Linen attention with TransformerEngine's argument names and params.

``DotProductAttention``: the attention core, :func:`jax.nn.dot_product_attention` in high
precision (the input dtype, logits and softmax in float32); its masks follow TE's convention:
``True`` means *masked out* (the opposite of :func:`jax.nn.dot_product_attention`'s ``mask``).
``MultiHeadAttention``: the QKV projections (with the input norm fused in) and the output
projection in FP8 around that core. ``RelativePositionBiases``
(:mod:`fp8jax.flax.relative_position`) is re-exported from here.

>>> import jax, jax.numpy as jnp, fp8jax
>>> from fp8jax.flax import DotProductAttention, MultiHeadAttention
>>> q = k = v = jnp.ones((2, 5, 4, 8))                       # (batch, seq, heads, head_dim)
>>> lengths = jnp.array([5, 3])                              # the second sequence is padded
>>> valid = jnp.arange(5)[None, :] < lengths[:, None]       # (batch, seq): True = a real token
>>> mask = ~(valid[:, None, :, None] & valid[:, None, None, :])  # True = masked out
>>> mask.shape                                               # (batch, 1, seq_q, seq_kv)
(2, 1, 5, 5)
>>> attn = DotProductAttention(head_dim=8, num_attention_heads=4, attn_mask_type="padding")
>>> attn.apply({}, q, k, v, mask).shape
(2, 5, 4, 8)
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

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from fp8jax.flax._variables import fp8_call
from fp8jax.flax.dense import DenseGeneral
from fp8jax.flax.layernorm import LayerNormDenseGeneral
from fp8jax.flax.relative_position import RelativePositionBiases
from fp8jax.functional.attention import ATTENTION_ROLES
from fp8jax.layers.attention import MultiHeadAttentionConfig, decode_step
from fp8jax.layers.attention_core import attention_core
from fp8jax.layers.checks import check_no_score_mod, check_off
from fp8jax.layers.dense import DenseGeneralConfig
from fp8jax.layers.params import default_mha_kernel_init

__all__ = [
    "DotProductAttention",
    "MultiHeadAttention",
    "RelativePositionBiases",
    "default_mha_kernel_init",
]


_N_ROLES = len(ATTENTION_ROLES)

# TE arguments accepted only at their defaults.
_TE_OFF = ("max_segments_per_seq", "softmax_type", "score_mod", "score_mod_bprop")


class DotProductAttention(nn.Module):
    """Scaled dot-product attention ``softmax(scale * q k^T (+ bias), masked) v`` with
    TransformerEngine's arguments, grouped-query attention, masks, sliding windows and
    attention dropout; no params.

    The core is :func:`jax.nn.dot_product_attention` (``implementation=None``: cuDNN's fused
    flash attention where JAX can lower it, XLA's path elsewhere and on CPU, chosen while tracing
    by :func:`fp8jax.layers.attention_backend.choose_attention`; ``"xla"`` or ``"cudnn"`` force
    one, and ``"cudnn"`` raises where cuDNN's constraints do not hold). With an active
    attention dropout (``rate > 0`` and not ``deterministic``), which that function lacks, the
    same formula runs in XLA with the dropout applied to the probabilities
    (:func:`~fp8jax.layers.attention_core.attention_with_dropout`), using the
    ``dropout_rng_name`` RNG stream. The module has no variables: it calls
    :func:`~fp8jax.layers.attention_core.attention_core` (which
    :class:`fp8jax.nnx.MultiHeadAttention` calls too).

    Call: ``attn(query, key, value, sequence_descriptor=None, bias=None, *,
    deterministic=False, mask=None, segment_ids=None)``; returns the attention output with
    ``query``'s shape (``qkv_layout="bs3hd"``: ``[b, s, h, d]`` without the packed axis).

    - ``query`` ``[b, sq, h, d]``, ``key``/``value`` ``[b, skv, g, d]`` (``g`` =
      ``num_gqa_groups`` dividing ``h``), or ``[s, b, ...]`` with ``transpose_batch_sequence``;
      ``qkv_layout="bshd_bs2hd"``: ``key`` is ``[b, skv, 2, g, d]`` (k, v) and ``value`` is
      ignored; ``"bs3hd"``: ``query`` is ``[b, s, 3, h, d]``, ``key``/``value`` ignored.
    - ``sequence_descriptor`` (or its deprecated alias ``mask``): TE's mask, a bool array
      broadcastable to ``(b, h, sq, skv)``, ``True`` = masked out (the docstring example above
      builds one from sequence lengths); used by ``"padding"``/``"padding_causal"`` (without a
      mask or ``segment_ids`` they mask nothing, or only causally; TE requires one), ignored
      by ``"no_mask"``/``"causal"`` (as TE).
    - ``segment_ids`` (fp8jax's, for packed sequences): ``(b, s)`` ints, or a pair ``(q_ids,
      kv_ids)``; tokens attend within their own segment, id 0 is padding. Needs a padding mask
      type; combined (and-ed) with ``sequence_descriptor``. Windows and the causal mask count
      absolute positions, which equal positions within a segment for contiguous segments.
    - ``bias``: added to the logits, broadcastable to ``(b, h, sq, skv)`` (e.g. from
      :class:`~fp8jax.flax.RelativePositionBiases`); ``"post_scale_bias"``: ``scale * qk + bias``,
      ``"pre_scale_bias"``: ``scale * (qk + bias)``.

    A query whose keys are all masked gets the mean of the values (the masked logits are a
    large finite negative number, as in :func:`jax.nn.dot_product_attention`).

    Differences from TE: ``dtype`` is the computation/output dtype (default: ``query``'s),
    not a param dtype; ``float32_logits`` has no further effect (the logits and softmax are
    always float32); the ``THD`` layouts, ``SequenceDescriptor`` objects (which
    :class:`fp8jax.te.jax.flax.transformer.DotProductAttention` takes) and
    ``max_segments_per_seq`` are not supported (use ``segment_ids``; their TE arguments,
    and ``softmax_type``, ``score_mod``, ``score_mod_bprop``, are accepted at TE's defaults
    only, ValueError otherwise); fully masked rows
    average the values; the dropout mask layout differs from TE's kernels (same distribution).
    FP8 attention is this module's ``fp8_dpa`` (TE has it on the recipe, whose ``fp8_dpa``
    fp8jax rejects). Context parallelism (``context_parallel_axis``, TE's all-gather and ring
    strategies) splits the sequence over a mesh axis: docs/parallelism.md.

    Attributes:
      head_dim, num_attention_heads: per-head width and query heads (checked against inputs).
      num_gqa_groups: key/value heads (default: ``num_attention_heads``); must divide it.
      attention_dropout: dropout probability on the attention probabilities.
      attn_mask_type: ``"no_mask"``, ``"padding"``, ``"causal"``, ``"padding_causal"``
        (alias ``"causal_padding"``). Default ``"causal"`` (TE's).
      attn_bias_type: ``None``, ``"no_bias"``, ``"pre_scale_bias"``, ``"post_scale_bias"``.
      dtype: see above. dropout_rng_name: RNG stream of the dropout (default ``"dropout"``).
      float32_logits: accepted for TE compatibility (see above).
      qkv_layout: ``"bshd_bshd_bshd"`` (default), ``"bshd_bs2hd"`` or ``"bs3hd"``.
      scale_factor: logit scale (default ``1/sqrt(head_dim)``).
      transpose_batch_sequence: inputs are ``[seq, batch, ...]``; default ``False``
        (``[batch, seq, ...]``), TE's since v2.10.
      window_size: ``(left, right)``: query ``i`` sees keys ``i-left .. i+right`` (negative:
        unbounded); ``None``: no window.
      context_checkpoint_name: the output's :func:`jax.ad_checkpoint.checkpoint_name` (TE's).
      context_parallel_axis: the mesh axis the sequence is split over (TE's; ``""``, the
        default: none; an axis of size 1 runs the plain path). Needs the mesh set with
        ``jax.set_mesh``; causal and padding (``segment_ids``) masks, windows and GQA work,
        a bias, dropout, a dense mask and FP8 attention are refused (docs/parallelism.md).
      context_parallel_strategy: TE's ``"DEFAULT"`` (= ``"ALL_GATHER"``), ``"ALL_GATHER"``
        or ``"RING"`` (any case, or ``fp8jax.functional.context_parallel.CPStrategy``).
      context_parallel_causal_load_balanced: the sequence is in TE's DualChunkSwap order
        (``fp8jax.reorder_causal_load_balancing``); default ``False``.
      max_segments_per_seq, softmax_type, score_mod, score_mod_bprop: TE's, at its defaults
        only (see above).
      implementation: ``None`` (cuDNN where it can run, else XLA; see above), ``"xla"`` or
        ``"cudnn"``: the :func:`jax.nn.dot_product_attention` implementation (fp8jax's).
      fp8_dpa: TE's name; default ``False``. With FP8 on (``fp8jax.autocast``, a per-tensor
        recipe) the attention takes E4M3 operands (:func:`fp8jax.dot_product_attention`:
        cuDNN's FP8 flash attention on a GPU, its reference elsewhere) and, under
        DelayedScaling, keeps 15 FP8 roles (:data:`fp8jax.ATTENTION_ROLES`) in this module's
        ``fp8_meta``/``fp8_probe``. A call it cannot take (a bias, a padding mask, a window,
        dropout; on a GPU what cuDNN refuses) runs as without it, with one
        :class:`~fp8jax.layers.attention_backend.Fp8AttentionFallback` warning (a ValueError
        inside :func:`~fp8jax.layers.attention_backend.strict_fp8_attention`). Never run on a
        GPU yet: opt-in.
    """

    head_dim: int
    num_attention_heads: int
    num_gqa_groups: int | None = None
    attention_dropout: float = 0.0
    attn_mask_type: str = "causal"
    attn_bias_type: str | None = None
    dtype: Any = None
    dropout_rng_name: str = "dropout"
    float32_logits: bool = False
    qkv_layout: str = "bshd_bshd_bshd"
    scale_factor: float | None = None
    transpose_batch_sequence: bool = False
    window_size: tuple[int, int] | None = None
    max_segments_per_seq: int = 1
    context_parallel_causal_load_balanced: bool = False
    context_parallel_axis: str = ""
    context_parallel_strategy: str = "DEFAULT"
    context_checkpoint_name: str = "context"
    softmax_type: str = "vanilla"
    score_mod: Any = None
    score_mod_bprop: Any = None
    implementation: str | None = None
    fp8_dpa: bool = False

    @nn.compact
    def __call__(
        self,
        query: jax.Array,
        key: jax.Array | None,
        value: jax.Array | None,
        sequence_descriptor: jax.Array | None = None,
        bias: jax.Array | None = None,
        *,
        deterministic: bool = False,
        mask: jax.Array | None = None,
        segment_ids: Any = None,
        score_mod_tensors: Any = None,
        score_mod_bprop_tensors: Any = None,
    ) -> jax.Array:
        owner = "DotProductAttention"
        check_off(owner, self, *_TE_OFF)
        check_no_score_mod(owner, score_mod_tensors, score_mod_bprop_tensors)
        if mask is not None:
            if sequence_descriptor is not None:
                raise ValueError(f"{owner}: pass sequence_descriptor or mask, not both")
            sequence_descriptor = mask
        return attention_core(
            query, key, value, sequence_descriptor, bias, head_dim=self.head_dim,
            num_attention_heads=self.num_attention_heads, num_gqa_groups=self.num_gqa_groups,
            attention_dropout=self.attention_dropout, attn_mask_type=self.attn_mask_type,
            attn_bias_type=self.attn_bias_type, dtype=self.dtype, qkv_layout=self.qkv_layout,
            scale_factor=self.scale_factor, transpose_batch_sequence=self.transpose_batch_sequence,
            window_size=self.window_size, context_checkpoint_name=self.context_checkpoint_name,
            implementation=self.implementation, segment_ids=segment_ids,
            dropout_rng=None if deterministic else lambda: self.make_rng(self.dropout_rng_name),
            fp8_dpa=self.fp8_dpa, fp8=fp8_call(self, _N_ROLES) if self.fp8_dpa else None,
            context_parallel_axis=self.context_parallel_axis,
            context_parallel_strategy=self.context_parallel_strategy,
            context_parallel_causal_load_balanced=self.context_parallel_causal_load_balanced,
        )  # fmt: skip


class _Cache:
    """The ``"cache"`` collection of a :class:`MultiHeadAttention` as the config's forward uses
    it (:class:`fp8jax.layers.attention.KVCache`): the first call with ``decode=True`` (``init``)
    creates ``cached_key``/``cached_value`` shaped as the full-length keys/values and
    ``cache_index`` = 0 and attends normally; each later call is a step."""

    def __init__(self, module: nn.Module, step: bool) -> None:
        self.module, self.step = module, step

    def index(self) -> jax.Array | None:
        return self.module.get_variable("cache", "cache_index") if self.step else None

    def update(self, k, v, mask, bias):
        m = self.module
        ck = m.variable("cache", "cached_key", jnp.zeros, k.shape, k.dtype)
        cv = m.variable("cache", "cached_value", jnp.zeros, v.shape, v.dtype)
        ci = m.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32))
        if not self.step:
            return k, v, mask, bias
        idx = ci.value
        k, v, mask, bias = decode_step(
            ck.value, cv.value, idx, k, v, mask, bias, seq_axis=0 if m.transpose_batch_sequence
            else 1, mask_type=m.attn_mask_type,
        )  # fmt: skip
        ck.value, cv.value, ci.value = k, v, idx + 1
        return k, v, mask, bias


class MultiHeadAttention(MultiHeadAttentionConfig, nn.Module):
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
    and ``segment_ids`` are rejected; FP8 attention is the ``fp8_dpa`` field, not the
    recipe's (``recipe.fp8_mha``/``fp8_dpa`` are rejected); rotary embeddings are applied in
    float32 and cast back (as TE).

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
      fp8_dpa: FP8 attention in the core (:class:`DotProductAttention`'s ``fp8_dpa``; its FP8
        state is the ``attention`` submodule's). Default ``False``.
      context_parallel_axis, context_parallel_strategy, context_parallel_causal_load_balanced:
        context parallelism in the core, as :class:`DotProductAttention`'s (fp8jax's
        addition: TE's ``MultiHeadAttention`` lacks them). Self-attention only.
      low_rank_adaptation_scope, low_rank_adaptation_dim, low_rank_adaptation_alpha,
        enable_sequence_parallel, softmax_type, score_mod, score_mod_bprop, num_heads,
        dropout_rate, output_layernorm, apply_residual_connection_post_layernorm, fuse_qkv:
        TE's (see above).
    """

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
        project = {name: _linen(name, c) for name, c in configs.items()}

        def core(q, k, v, mask, bias, mask_type):
            attention = DotProductAttention(
                **self.core_config(mask_type, jnp.result_type(q, k, v)),
                dropout_rng_name=self.dropout_rng_name, float32_logits=self.float32_logits,
                name="attention",
            )  # fmt: skip
            return attention(q, k, v, mask, bias, deterministic=deterministic,
                             segment_ids=segment_ids)  # fmt: skip

        cache = _Cache(self, step) if decode else None
        return self.forward(project, core, inputs_q, inputs_kv, is_self, mask, bias, cache)


def _linen(name: str, config: Any) -> nn.Module:
    """The Linen module of a projection's config."""
    cls = DenseGeneral if type(config) is DenseGeneralConfig else LayerNormDenseGeneral
    return cls(**{f: getattr(config, f) for f in config.__dataclass_fields__}, name=name)
