"""TransformerEngine's ``transformer_engine.jax.attention``: ``SequenceDescriptor`` and the
mask/layout enums, for the layouts fp8jax's attention supports (padded ``BSHD``/``SBHD``
batches, with or without segment ids; packed ``THD`` is not implemented), and the context
parallelism names (``CPStrategy``, ``ReorderStrategy``, ``reorder_causal_load_balancing``,
``inverse_reorder_causal_load_balancing``: fp8jax's, with TE's members and arguments).

:class:`fp8jax.te.jax.flax.transformer.DotProductAttention` takes a ``SequenceDescriptor`` as
its ``sequence_descriptor``, as TE's does; fp8jax's own :class:`~fp8jax.flax.DotProductAttention`
takes segment ids as an array: :meth:`SequenceDescriptor.segment_ids_pair` gives its
``segment_ids`` argument.

>>> import jax.numpy as jnp
>>> d = SequenceDescriptor.from_seqlens((jnp.array([2, 3]), jnp.array([2, 3])))
>>> d.segment_ids_pair(max_len=4)[0].tolist()
[[1, 1, 0, 0], [1, 1, 1, 0]]
"""

from __future__ import annotations

import enum
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from fp8jax.functional.context_parallel import CPStrategy
from fp8jax.functional.load_balancing import (
    ReorderStrategy,
    inverse_reorder_causal_load_balancing,
    reorder_causal_load_balancing,
)

__all__ = [
    "AttnBiasType",
    "AttnMaskType",
    "CPStrategy",
    "QKVLayout",
    "ReorderStrategy",
    "SequenceDescriptor",
    "inverse_reorder_causal_load_balancing",
    "reorder_causal_load_balancing",
]


class AttnMaskType(enum.Enum):
    """TE's mask types (fp8jax's attention takes them as the strings, e.g. ``"causal"``)."""

    NO_MASK = "no_mask"
    PADDING_MASK = "padding"
    CAUSAL_MASK = "causal"
    PADDING_CAUSAL_MASK = "padding_causal"
    CAUSAL_BOTTOM_RIGHT_MASK = "causal_bottom_right"
    PADDING_CAUSAL_BOTTOM_RIGHT_MASK = "padding_causal_bottom_right"


class AttnBiasType(enum.Enum):
    """TE's bias types."""

    NO_BIAS = "no_bias"
    PRE_SCALE_BIAS = "pre_scale_bias"
    POST_SCALE_BIAS = "post_scale_bias"


class QKVLayout(enum.Enum):
    """TE's layouts; the ``T*`` (packed) ones are not implemented by fp8jax."""

    BS3HD = "BS3HD"
    BSHD_BS2HD = "BSHD_BS2HD"
    BSHD_BSHD_BSHD = "BSHD_BSHD_BSHD"
    T3HD = "T3HD"
    THD_T2HD = "THD_T2HD"
    THD_THD_THD = "THD_THD_THD"


def _pair(value: Any, name: str) -> tuple[jax.Array, jax.Array] | None:
    if value is None:
        return None
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise ValueError(f"SequenceDescriptor: {name} must be (q, kv), got {len(value)} items")
        return jnp.asarray(value[0]), jnp.asarray(value[1])
    return jnp.asarray(value), jnp.asarray(value)


@flax.struct.dataclass
class SequenceDescriptor:
    """The sequences of a padded batch: lengths, or segment ids (and positions), each a pair
    ``(q, kv)``."""

    seqlens: tuple[jax.Array, jax.Array] | None = None
    segment_ids: tuple[jax.Array, jax.Array] | None = None
    segment_pos: tuple[jax.Array, jax.Array] | None = None

    @classmethod
    def from_seqlens(cls, seqlens: Any) -> SequenceDescriptor:
        """From the valid lengths ``[batch]`` (one array for both, or ``(q, kv)``)."""
        return cls(seqlens=_pair(seqlens, "seqlens"))

    @classmethod
    def from_segment_ids_and_pos(
        cls,
        segment_ids: Any,
        segment_pos: Any = None,
        *,
        is_thd: bool = False,
        is_segment_ids_reordered: bool = False,
    ) -> SequenceDescriptor:
        """From segment ids ``[batch, seq]`` (0 = padding) and optional positions. Packed
        (``is_thd=True``) and load-balance-reordered ids are ``NotImplementedError``."""
        if is_thd or is_segment_ids_reordered:
            raise NotImplementedError(
                "SequenceDescriptor.from_segment_ids_and_pos: packed (THD) and reordered "
                "segment ids are not implemented by fp8jax; use a padded BSHD batch with "
                "segment ids"
            )
        return cls(
            segment_ids=_pair(segment_ids, "segment_ids"),
            segment_pos=_pair(segment_pos, "segment_pos"),
        )

    def segment_ids_pair(self, max_len: int | tuple[int, int]) -> tuple[jax.Array, jax.Array]:
        """``(q_ids, kv_ids)``, ``int32[batch, len]`` (0 = padding), for fp8jax attention's
        ``segment_ids``; ``max_len`` (or ``(q_len, kv_len)``) is used with ``seqlens``."""
        if self.segment_ids is not None:
            return self.segment_ids
        if self.seqlens is None:
            raise ValueError("SequenceDescriptor: neither seqlens nor segment_ids is set")
        q_len, kv_len = max_len if isinstance(max_len, tuple) else (max_len, max_len)
        return tuple(
            (jnp.arange(n)[None, :] < lens[:, None]).astype(jnp.int32)
            for lens, n in zip(self.seqlens, (q_len, kv_len), strict=True)
        )
