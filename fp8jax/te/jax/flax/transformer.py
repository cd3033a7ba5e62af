"""TransformerEngine's ``transformer_engine.jax.flax.transformer``: fp8jax's Linen layers.

These are fp8jax's own modules (:mod:`fp8jax.flax`), which follow TE's Linen API; their FP8
state is in fp8jax's collections (``"fp8_meta"`` by default, or the one
:func:`fp8jax.flax.fp8_state_collection` names, e.g. for a train step that takes the state's
gradient as its next value) with a probe per call in ``"fp8_probe"`` (docs/porting-from-te.md).
:class:`DotProductAttention` is fp8jax's with the ``sequence_descriptor`` forms TE's takes
besides fp8jax's (a :class:`~fp8jax.te.jax.attention.SequenceDescriptor`, MaxText's 5-D mask).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

from fp8jax import flax as fp8_flax
from fp8jax.flax import (
    MultiHeadAttention,
    RelativePositionBiases,
    TransformerLayer,
    TransformerLayerType,
)
from fp8jax.layers.attention_core import canonical_mask_type
from fp8jax.te.jax.attention import SequenceDescriptor

__all__ = [
    "DotProductAttention",
    "MultiHeadAttention",
    "RelativePositionBiases",
    "TransformerLayer",
    "TransformerLayerType",
]


class DotProductAttention(fp8_flax.DotProductAttention):
    """TE's ``DotProductAttention``: :class:`fp8jax.flax.DotProductAttention` (its attributes,
    context parallelism included), whose ``sequence_descriptor`` (or ``mask``) may also be

    - a :class:`~fp8jax.te.jax.attention.SequenceDescriptor` of a padded batch
      (``from_seqlens``, or ``from_segment_ids_and_pos`` with one segment per row): its segment
      ids become fp8jax's ``segment_ids`` under a padding mask type (``"padding"``,
      ``"padding_causal"``), and it is ignored under ``"no_mask"``/``"causal"``, as TE ignores
      it there. ``segment_pos`` is not read (TE's BSHD path does not read it either: the causal
      mask counts positions in the row);
    - a dense mask ``[b|1, 1, 1, sq|1, skv|1]`` (True/nonzero = masked out): MaxText's layout
      for ``attention=cudnn_flash_te``, read as the ``[b|1, 1, sq|1, skv|1]`` mask it holds.

    A dense mask under a padding mask type is applied as the pattern it is (TE's unfused path);
    TE's cuDNN path reads it as right padding (the count of unmasked rows and columns), which
    is the same for the masks it supports (no padding inside a sequence).
    """

    @nn.compact
    def __call__(
        self,
        query: jax.Array,
        key: jax.Array | None,
        value: jax.Array | None,
        sequence_descriptor: Any = None,
        bias: jax.Array | None = None,
        *,
        deterministic: bool = False,
        mask: Any = None,
        segment_ids: Any = None,
        score_mod_tensors: Any = None,
        score_mod_bprop_tensors: Any = None,
    ) -> jax.Array:
        owner = "DotProductAttention"
        if mask is not None:
            if sequence_descriptor is not None:
                raise ValueError(f"{owner}: pass sequence_descriptor or mask, not both")
            sequence_descriptor, mask = mask, None
        if isinstance(sequence_descriptor, SequenceDescriptor):
            desc, sequence_descriptor = sequence_descriptor, None
            if canonical_mask_type(self.attn_mask_type) in ("padding", "padding_causal"):
                if segment_ids is not None:
                    raise ValueError(f"{owner}: pass segment_ids or a SequenceDescriptor, not both")
                segment_ids = desc.segment_ids_pair(_lengths(self, query, key))
        elif sequence_descriptor is not None:
            sequence_descriptor = _four_dims(owner, sequence_descriptor)
        return super().__call__(
            query, key, value, sequence_descriptor, bias, deterministic=deterministic,
            segment_ids=segment_ids, score_mod_tensors=score_mod_tensors,
            score_mod_bprop_tensors=score_mod_bprop_tensors,
        )  # fmt: skip


def _lengths(module: DotProductAttention, query: jax.Array, key: Any) -> tuple[int, int]:
    """``(sq, skv)`` of the call's inputs (their sequence axis per the module's layout)."""
    axis = 0 if module.transpose_batch_sequence else 1
    sq = query.shape[axis]
    packed = str(module.qkv_layout).lower() == "bs3hd"
    return sq, sq if packed or key is None else key.shape[axis]


def _four_dims(owner: str, mask: Any) -> Any:
    """A 5-D mask ``[b|1, 1, 1, sq, skv]`` as its 4-D ``[b|1, 1, sq, skv]``; others as given."""
    if jnp.ndim(mask) != 5:
        return mask
    mask = jnp.asarray(mask)
    if mask.shape[1:3] != (1, 1):
        raise ValueError(
            f"{owner}: a 5-D sequence_descriptor (mask) must be [batch|1, 1, 1, seq_q|1, "
            f"seq_kv|1] (MaxText's layout), got {mask.shape}"
        )
    return mask[:, 0]
