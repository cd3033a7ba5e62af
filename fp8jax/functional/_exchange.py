"""How a mixture of experts' rows move between the devices that hold the tokens and those that
hold the experts (expert parallelism), as plain data movement that any array of rows can take:
FP8 codes, their row scales, or high-precision values.

The *token side* of a device holds its rows sorted by global expert (``sizes_tokens [E]``);
expert ``e`` lives on device ``e // E_local`` of the mesh axes ``axes``. :func:`to_experts`
packs the rows for each device into a bucket of ``capacity`` rows (rows past it are dropped:
only with a capacity factor; dropless, ``capacity`` is all the rows), exchanges the buckets
with one ``all_to_all``, and sorts what arrived by local expert (sources in mesh order, each
source's rows in its order: for experts that see tokens of several devices this is the
tokens' global order); the *expert side* then holds ``sizes_experts [E_local]`` rows per local
expert, followed by rows past their sum. :func:`to_tokens` is its inverse (for the outputs and
the input gradient). On one device with no mesh axes the exchange is not used at all.

The plan (:class:`ExchangePlan`) is made from the routing by :func:`fp8jax.moe` (it needs the
per-expert counts of every device: one small ``all_to_all`` of ``[E]`` int32).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

__all__ = ["Exchange", "ExchangePlan", "global_max", "to_experts", "to_tokens"]


class Exchange(NamedTuple):
    """The static side of an expert-parallel exchange (hashable: part of a layer's config)."""

    axes: tuple[str, ...]  # the mesh axes the experts are split over (the all_to_all's)
    devices: int  # their device count
    capacity: int  # rows per (source, destination) bucket
    data_axes: tuple[str, ...] = ()  # the other token axes (each expert replicated over them)


class ExchangePlan(NamedTuple):
    """The dynamic side: where each row goes, and the group sizes on both sides."""

    send_pos: jax.Array  # int32 [A]: each token-side row's slot in the [devices * capacity]
    # send buffer (devices * capacity: dropped)
    recv_order: jax.Array  # int32 [devices * capacity]: the received slots in expert order
    sizes_tokens: jax.Array  # int32 [E]: token-side rows per global expert
    sizes_experts: jax.Array  # int32 [E_local]: expert-side rows per local expert
    first_expert: jax.Array  # int32 []: this device's first expert


def _all_to_all(ex: Exchange, x: jax.Array) -> jax.Array:
    buckets = x.reshape(ex.devices, ex.capacity, *x.shape[1:])
    out = jax.lax.all_to_all(buckets, ex.axes, 0, 0, tiled=False)
    return out.reshape(ex.devices * ex.capacity, *x.shape[1:])


def to_experts(ex: Exchange, plan: ExchangePlan, rows: jax.Array) -> jax.Array:
    """Token-side rows ``[A, ...]`` -> expert-side rows ``[devices * capacity, ...]``."""
    buf = jnp.zeros((ex.devices * ex.capacity, *rows.shape[1:]), rows.dtype)
    buf = buf.at[plan.send_pos].set(rows, mode="drop", unique_indices=True)
    return jnp.take(_all_to_all(ex, buf), plan.recv_order, axis=0)


def to_tokens(ex: Exchange, plan: ExchangePlan, rows: jax.Array) -> jax.Array:
    """Expert-side rows ``[devices * capacity, ...]`` -> token-side rows ``[A, ...]`` (a
    dropped row: 0)."""
    buf = jnp.zeros_like(rows).at[plan.recv_order].set(rows, unique_indices=True)
    back = _all_to_all(ex, buf)
    return jnp.take(back, plan.send_pos, axis=0, mode="fill", fill_value=0)


def global_max(ex: Exchange | None, x: Any, side: str = "tokens") -> Any:
    """``x`` max-reduced over the devices that hold parts of the same global tensor (``x``
    itself without an exchange): on the token side every token axis (data axes and the
    experts'); on the expert side the data axes, over which each expert is replicated with
    other tokens."""
    if ex is None:
        return x
    axes = (*ex.data_axes, *ex.axes) if side == "tokens" else ex.data_axes
    return jax.lax.pmax(x, axes) if axes else x
