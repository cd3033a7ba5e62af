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

The plan (:class:`ExchangePlan`, :func:`exchange_plan`) is made from the routing by
:func:`fp8jax.moe` (it needs the per-expert counts of every device: one small ``all_to_all`` of
``[E]`` int32). :func:`expert_parallel` runs an MoE block's steps in the ``shard_map`` over the
tokens and experts, laying its inputs and output out on either kind of mesh.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fp8jax.ops.base.partition import explicit_mesh, varying
from fp8jax.state import Fp8Meta

__all__ = [
    "Exchange",
    "ExchangePlan",
    "earlier_counts",
    "exchange_plan",
    "expert_parallel",
    "fan_out",
    "global_max",
    "nan_max",
    "to_experts",
    "to_tokens",
]


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


def earlier_counts(experts, e, axes):
    """Per expert, the assignments of the devices whose tokens come before this one's in the
    global token order (``axes``: the token-splitting mesh axes, major first)."""
    counts = jnp.zeros((e,), jnp.int32).at[experts.reshape(-1)].add(1)
    every = jax.lax.all_gather(counts, tuple(axes))  # [P, E], in the tokens' device order
    me = jax.lax.axis_index(tuple(axes))
    before = jnp.arange(every.shape[0]) < me
    return jnp.sum(jnp.where(before[:, None], every, 0), axis=0).astype(jnp.int32)


def exchange_plan(
    axis: str,
    data_axes: tuple[str, ...],
    sizes: jax.Array,
    rows: int,
    capacity: int | None,
) -> tuple[Exchange, ExchangePlan]:
    """The exchange of this device's ``rows`` sorted rows (``sizes [E]`` per global expert)
    with the other devices of the expert ``axis``; ``capacity``: rows kept per expert."""
    p = jax.lax.axis_size(axis)
    e = sizes.shape[0]
    e_local = e // p
    bucket = rows if capacity is None else min(rows, e_local * capacity)
    # each sorted row's destination and slot in its destination's bucket
    per_dest = sizes.reshape(p, e_local).sum(axis=1)
    dest_start = jnp.cumsum(per_dest) - per_dest
    ends = jnp.cumsum(sizes)
    r = jnp.arange(rows, dtype=jnp.int32)
    expert_of = jnp.searchsorted(ends, r, side="right")
    dest = expert_of // e_local
    slot = r - jnp.take(dest_start, dest, mode="clip")
    valid = (expert_of < e) & (slot < bucket)
    send_pos = jnp.where(valid, dest * bucket + slot, p * bucket).astype(jnp.int32)
    # what arrives: per source, per local expert
    recv = jax.lax.all_to_all(sizes.reshape(p, e_local), axis, 0, 0, tiled=False)
    recv_ends = jnp.cumsum(recv, axis=1)  # [P, E_local]
    i = jnp.arange(bucket, dtype=jnp.int32)
    local_e = jax.vmap(lambda ends_s: jnp.searchsorted(ends_s, i, side="right"))(recv_ends)
    recv_order = jnp.argsort(local_e.reshape(-1), stable=True).astype(jnp.int32)
    plan = ExchangePlan(
        send_pos,
        recv_order,
        sizes,
        recv.sum(axis=0).astype(jnp.int32),
        (jax.lax.axis_index(axis) * e_local).astype(jnp.int32),
    )
    return Exchange((axis,), p, bucket, tuple(data_axes)), plan


@jax.custom_vjp
def fan_out(probe: jax.Array, n: jax.Array) -> jax.Array:
    """``probe`` repeated once per entry of ``n`` (one row per device); its gradient is the
    max of the rows', never their sum."""
    return jnp.broadcast_to(probe, (n.shape[0], *probe.shape))


def _fan_out_fwd(probe, n):
    return fan_out(probe, n), n


def _fan_out_bwd(n, ct):
    # each device's observations: the step's amax is their max (never their sum)
    return nan_max(ct), jnp.zeros_like(n)


def nan_max(x: jax.Array) -> jax.Array:
    """The max over the leading dim, NaN where any is NaN (XLA:CPU's max reduction may drop
    NaNs, e.g. the forward pass's "not observed")."""
    return jnp.where(jnp.any(jnp.isnan(x), axis=0), jnp.float32(jnp.nan), jnp.max(x, axis=0))


fan_out.defvjp(_fan_out_fwd, _fan_out_bwd)


def _is_spec(x: Any) -> bool:
    return x is None or isinstance(x, jax.sharding.PartitionSpec)


def expert_parallel(
    local: Callable[..., tuple[Any, ...]],
    cfg: Any,
    x: jax.Array,
    params: dict[str, Any],
    fp8: Any,
    where: str,
) -> tuple[jax.Array, Any, Any, jax.Array | None]:
    """An MoE block's steps on each device's tokens of an expert-parallel mesh: one
    ``shard_map`` over the tokens (split over ``cfg.data_parallelism_axes + (cfg.expert_axis,)``)
    and the experts (over ``cfg.expert_axis``), ``local(x, params, fp8, token_axes) -> (out,
    aux_loss, z_loss, observed)`` run in it; ``fp8`` is the block's (meta, recipe, enabled,
    probe) NamedTuple. Returns ``(out, aux_loss, z_loss, observed)``, the observations
    max-merged over the devices (``None`` with FP8 off).

    Jitted even when the caller is not (an eager ``shard_map`` cannot run the layers'
    ``custom_vjp``: JAX's "custom_vjp symbolic_zeros support with shard_map is not
    implemented"); under an outer jit it is inlined."""
    mesh = jax.sharding.get_abstract_mesh()
    axis = cfg.expert_axis
    if mesh.empty or axis not in mesh.axis_names:
        raise ValueError(
            f"{where}: expert_axis={axis!r} needs a mesh with that axis, set with "
            "jax.set_mesh(mesh) (or jax.sharding.use_mesh) around the call"
        )
    p = mesh.shape[axis]
    if cfg.num_experts % p:
        raise ValueError(
            f"{where}: num_experts={cfg.num_experts} must be a multiple of the {axis!r} axis's "
            f"{p} devices"
        )
    token_axes = (*cfg.data_parallelism_axes, axis)
    shards = math.prod(mesh.shape[a] for a in token_axes)
    if x.shape[0] % shards:
        raise ValueError(
            f"{where}: the {x.shape[0]} tokens must split evenly over {token_axes} ({shards} "
            "devices)"
        )
    P = jax.sharding.PartitionSpec
    expert_names = ("wi_0", "wi_1", "wo", "wi_0_bias", "wi_1_bias", "wo_bias")
    present = {n: v for n, v in params.items() if v is not None}
    specs = {n: P(axis) if n in expert_names else P() for n in present}
    meta = fp8.meta
    tiles = None
    if fp8.probe is not None:
        tiles = fan_out(fp8.probe, jnp.zeros((shards,), jnp.float32))

    def body(x, params, meta, tiles):
        # the experts' params marked as varying over the data axes: their gradients are then
        # summed over them by the shard_map, outside the layers' custom_vjp
        params = {
            n: varying(v, cfg.data_parallelism_axes)
            if n in expert_names and cfg.data_parallelism_axes
            else v
            for n, v in params.items()
        }
        probe = None if tiles is None else tiles[0]
        out, aux, z, seen = local(x, params, fp8._replace(meta=meta, probe=probe), token_axes)
        if seen is None:
            seen = jnp.zeros((), jnp.float32)
        return out, aux, z, seen[None]

    meta_spec = None if meta is None else Fp8Meta(P(), P())
    tile_spec = None if tiles is None else P(token_axes)
    in_specs = (P(token_axes), specs, meta_spec, tile_spec)
    tokens = P(cfg.data_parallelism_axes or None)
    mapped = jax.shard_map(
        body, mesh=mesh, in_specs=in_specs, out_specs=(P(token_axes), P(), P(), P(token_axes))
    )

    def exchange(*args):
        x = args[0]
        if explicit_mesh():
            # explicit axes (jax.make_mesh's default): a shard_map's inputs must already have
            # its in_specs' sharding, so the tokens and experts are laid out here (a no-op when
            # the caller has placed them so); the output is laid out as the input was
            args = jax.tree.map(jax.sharding.reshard, args, in_specs, is_leaf=_is_spec)
            out, *rest = mapped(*args)
            return jax.sharding.reshard(out, jax.typeof(x).sharding.spec), *rest
        # the tokens arrive split over the data axes only (what data_parallelism_axes says):
        # pinned so on the way in and out, XLA splits them over the expert axis inside rather
        # than propagating that split into the layers around (where a block-scaled cast may
        # not take it)
        out, *rest = mapped(jax.lax.with_sharding_constraint(x, tokens), *args[1:])
        return jax.lax.with_sharding_constraint(out, tokens), *rest

    out, aux, z, seen = jax.jit(exchange)(x, present, meta, tiles)
    observed = nan_max(seen) if seen.ndim == 2 else None  # FP8 on: [devices, n_roles]
    return out, aux, z, observed
