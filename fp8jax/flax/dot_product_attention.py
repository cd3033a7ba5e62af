"""Flax Linen ``DotProductAttention`` with TransformerEngine's argument names, computed with
:func:`jax.nn.dot_product_attention`.

The attention core runs in high precision (the input dtype, logits and softmax in float32);
FP8 applies to the projections around it (:class:`~fp8jax.flax.MultiHeadAttention`). Masks
follow TE's convention: ``True`` means *masked out* (the opposite of
:func:`jax.nn.dot_product_attention`'s ``mask``).

>>> import jax, jax.numpy as jnp
>>> from fp8jax.flax import DotProductAttention
>>> q = k = v = jnp.ones((2, 5, 4, 8))                       # (batch, seq, heads, head_dim)
>>> lengths = jnp.array([5, 3])                              # the second sequence is padded
>>> valid = jnp.arange(5)[None, :] < lengths[:, None]       # (batch, seq): True = a real token
>>> mask = ~(valid[:, None, :, None] & valid[:, None, None, :])  # True = masked out
>>> mask.shape                                               # (batch, 1, seq_q, seq_kv)
(2, 1, 5, 5)
>>> attn = DotProductAttention(head_dim=8, num_attention_heads=4, attn_mask_type="padding")
>>> attn.apply({}, q, k, v, mask).shape
(2, 5, 4, 8)
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax

from fp8jax.layers.attention_core import attention_core
from fp8jax.layers.checks import check_no_score_mod, check_off

__all__ = ["DotProductAttention"]


# TE arguments accepted only at their defaults.
_TE_OFF = (
    "max_segments_per_seq", "context_parallel_causal_load_balanced", "context_parallel_axis",
    "context_parallel_strategy", "softmax_type", "score_mod", "score_mod_bprop",
)  # fmt: skip


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
    always float32); the ``THD`` layouts, ``SequenceDescriptor`` objects, context parallelism
    and ``max_segments_per_seq`` are not supported (use ``segment_ids``; their TE arguments,
    and ``softmax_type``, ``score_mod``, ``score_mod_bprop``, are accepted at TE's defaults
    only, ValueError otherwise); fully masked rows
    average the values; the dropout mask layout differs from TE's kernels (same distribution).
    ``recipe.fp8_dpa`` is rejected by :class:`~fp8jax.recipe.DelayedScaling` (no FP8 attention
    core yet).

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
      max_segments_per_seq, context_parallel_causal_load_balanced, context_parallel_axis,
        context_parallel_strategy, softmax_type, score_mod, score_mod_bprop: TE's, at its
        defaults only (see above).
      implementation: ``None`` (cuDNN where it can run, else XLA; see above), ``"xla"`` or
        ``"cudnn"``: the :func:`jax.nn.dot_product_attention` implementation (fp8jax's).
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
        )  # fmt: skip
