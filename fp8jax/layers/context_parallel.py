"""TransformerEngine's context-parallel arguments of the attention core
(``context_parallel_axis``, ``context_parallel_strategy``,
``context_parallel_causal_load_balanced``): checked, resolved against the current mesh, and run
by :func:`fp8jax.functional.context_parallel.context_parallel_attention`.

``context_parallel_axis=""`` (TE's default) is off; so is an axis of size 1 (the plain path
runs). Under context parallelism the attention core takes causal and padding masks (padding as
``segment_ids``), sliding windows and grouped-query attention; it refuses what it cannot split
(a bias, an active attention dropout, a dense ``[b, 1, s, s]`` mask, cross-attention and
``fp8_dpa`` with FP8 on) with a ValueError naming the argument.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax

from fp8jax.functional.context_parallel import canonical_strategy, context_parallel_attention

__all__ = ["ContextParallel", "context_parallel_core", "resolve_context_parallel"]


class ContextParallel(NamedTuple):
    """A resolved context-parallel setting: the mesh axis (of size > 1), ``"all_gather"`` or
    ``"ring"``, and whether the sequence is in TE's DualChunkSwap order."""

    axis: str
    strategy: str
    load_balanced: bool


def resolve_context_parallel(
    owner: str, axis: Any, strategy: Any, load_balanced: Any
) -> ContextParallel | None:
    """The context parallelism TE's three arguments ask for, or ``None`` (off: no axis, or an
    axis of size 1 in the current mesh).

    Raises:
      TypeError: ``context_parallel_axis`` is not a str, ``context_parallel_causal_load_balanced``
        not a bool, ``context_parallel_strategy`` neither a str nor a ``CPStrategy``.
      ValueError: an unknown strategy, or an axis that the current mesh (``jax.set_mesh``)
        does not have.
    """
    strategy = canonical_strategy(strategy)
    if not isinstance(load_balanced, bool):
        raise TypeError(f"{owner}: context_parallel_causal_load_balanced must be a bool, got "
                        f"{load_balanced!r}")  # fmt: skip
    if not isinstance(axis, str):
        raise TypeError(f"{owner}: context_parallel_axis must be a mesh axis name (str; '' for "
                        f"none), got {axis!r}")  # fmt: skip
    if not axis:
        return None
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or axis not in mesh.axis_names:
        raise ValueError(
            f"{owner}: context_parallel_axis={axis!r} must name an axis of the current mesh "
            f"(set with jax.set_mesh(mesh) around init and apply); mesh axes: "
            f"{() if mesh.empty else mesh.axis_names}"
        )
    if mesh.shape[axis] == 1:
        return None
    return ContextParallel(axis, strategy, load_balanced)


def context_parallel_core(
    owner: str,
    cp: ContextParallel,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    is_causal: bool,
    window: tuple[int, int] | None,
    scale: float,
    dtype: Any,
    segment_ids: Any,
    refusals: dict[str, bool],
) -> jax.Array:
    """The attention core's output under context parallelism ``cp``; ``refusals`` maps each
    argument the core was given that context parallelism cannot split (``"bias"``,
    ``"attention_dropout"``, ``"sequence_descriptor"``, ``"fp8_dpa"``) to whether it is active.

    Raises:
      ValueError: an active refusal, or cross-attention (query and key lengths differ).
    """
    why = {
        "bias": "a bias (the [b, h, s, s] tensor is not split)",
        "attention_dropout": "an active attention dropout",
        "sequence_descriptor": "a dense mask; pass padding as segment_ids",
        "fp8_dpa": "FP8 attention (fp8_dpa=True with FP8 on); the FP8 GEMMs around it are fine",
    }
    for name, active in refusals.items():
        if active:
            raise ValueError(f"{owner}: context parallelism (context_parallel_axis="
                             f"{cp.axis!r}) does not support {name}: {why[name]}")  # fmt: skip
    if q.shape[1] != k.shape[1]:
        raise ValueError(f"{owner}: context parallelism needs self-attention (equal query and "
                         f"key lengths), got {q.shape[1]} and {k.shape[1]}")  # fmt: skip
    ids = None
    if segment_ids is not None:
        ids = tuple(segment_ids) if isinstance(segment_ids, (tuple, list)) else (segment_ids,) * 2
    return context_parallel_attention(
        q, k, v, axis=cp.axis, strategy=cp.strategy, load_balanced=cp.load_balanced,
        is_causal=is_causal, window=window, segment_ids=ids, scale=scale, dtype=dtype,
    )  # fmt: skip
