"""TransformerEngine's ``transformer_engine.jax.cpp_extensions``: the collective-GEMM types.

TE overlaps a tensor-parallel GEMM with its all-gather or reduce-scatter ("collective GEMM")
when a dense call gets a :class:`CollectiveOpSet` other than :data:`noop_collective_op_set`.
fp8jax does not implement that overlap (XLA schedules the collectives of its sharded layers):
the no-op set works everywhere, and any other set is a ``NotImplementedError`` when a layer
is called with it (not when it is built).

>>> CollectiveOpSet.create(CollectiveOp.ALL_GATHER).backward
<CollectiveOp.REDUCE_SCATTER: 'reduce_scatter'>
>>> noop_collective_op_set.is_noop
True
"""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

__all__ = [
    "CollectiveOp",
    "CollectiveOpSet",
    "check_no_collective",
    "collective_gemm_bootstrap",
    "noop_collective_op_set",
]


class CollectiveOp(enum.Enum):
    """The collective a GEMM is overlapped with (TE's names)."""

    NONE = "none"
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"

    @property
    def is_all_gather(self) -> bool:
        """Whether this is ``ALL_GATHER``."""
        return self is CollectiveOp.ALL_GATHER

    @property
    def is_reduce_scatter(self) -> bool:
        """Whether this is ``REDUCE_SCATTER``."""
        return self is CollectiveOp.REDUCE_SCATTER

    @property
    def is_none(self) -> bool:
        """Whether this is ``NONE``."""
        return self is CollectiveOp.NONE


@dataclasses.dataclass(frozen=True)
class CollectiveOpSet:
    """The collectives of a dense layer's forward and backward GEMMs."""

    forward: CollectiveOp
    backward: CollectiveOp

    @staticmethod
    def create(forward_collective_op: CollectiveOp) -> CollectiveOpSet:
        """The set whose backward is the forward's complement (as TE builds it)."""
        if not isinstance(forward_collective_op, CollectiveOp):
            raise TypeError(
                "CollectiveOpSet.create: forward_collective_op must be a CollectiveOp, got "
                f"{forward_collective_op!r}"
            )
        backward = {
            CollectiveOp.ALL_GATHER: CollectiveOp.REDUCE_SCATTER,
            CollectiveOp.REDUCE_SCATTER: CollectiveOp.ALL_GATHER,
        }.get(forward_collective_op, CollectiveOp.NONE)
        return CollectiveOpSet(forward=forward_collective_op, backward=backward)

    @property
    def is_noop(self) -> bool:
        """Whether neither GEMM is overlapped with a collective."""
        return self.forward.is_none and self.backward.is_none


#: No collective overlap: what every fp8jax.te layer runs with.
noop_collective_op_set: CollectiveOpSet = CollectiveOpSet.create(CollectiveOp.NONE)


def check_no_collective(value: Any, argname: str) -> None:
    """Refuses a collective-GEMM request: ``NotImplementedError`` naming ``argname`` unless
    ``value`` is a no-op :class:`CollectiveOpSet`; ``TypeError`` for anything else."""
    if not isinstance(value, CollectiveOpSet):
        raise TypeError(f"{argname} must be a CollectiveOpSet, got {type(value).__name__}")
    if not value.is_noop:
        raise NotImplementedError(
            f"{argname}={value!r}: collective GEMM (a GEMM overlapped with its "
            f"{value.forward.value} / {value.backward.value}) is not implemented by fp8jax; "
            "pass noop_collective_op_set (XLA schedules the collectives of fp8jax's sharded "
            "layers)"
        )


def collective_gemm_bootstrap(*args: Any, **kwargs: Any) -> None:
    """TE's set-up of the communicators of collective GEMM, which fp8jax does not implement:
    always ``NotImplementedError``."""
    del args, kwargs
    raise NotImplementedError(
        "collective_gemm_bootstrap: collective GEMM (communication overlapped with GEMMs) is "
        "not implemented by fp8jax; run without it (MaxText: te_comm_gemm_overlap disabled)"
    )
