"""Context parallelism: attention over a sequence split along a mesh axis (TE's
``context_parallel_axis``), by the all-gather or the ring strategy (TE's ``CPStrategy``).

Each device holds ``S / n`` consecutive tokens of the query, key and value (or, with
``load_balanced``, those that
:func:`~fp8jax.functional.load_balancing.reorder_causal_load_balancing` with
``ReorderStrategy.DualChunkSwap`` gives it). Masks are built per block from the tokens'
global positions and segment ids, so a causal mask, a sliding window and padding (segment id 0)
hold across the split, and grouped-query attention (fewer key/value heads) works as in one
piece.

- ``"all_gather"`` (TE's ``ALL_GATHER``, and its ``DEFAULT``): the keys and values are gathered
  over the axis; each device's queries attend to all of them (backward: autodiff, the gather's
  transpose is a reduce-scatter of their gradients).
- ``"ring"`` (TE's ``RING``): a ``jax.lax.ppermute`` passes the key/value blocks around the
  ring, ``n`` steps; each step's exchange is issued before that step's block attention, so the
  two can overlap. The blocks are merged by the online softmax in float32. The backward pass is
  the ring again in a ``jax.custom_vjp``: every step recomputes its block's probabilities from
  the saved softmax statistics (row max and sum), adds its query gradient locally and its
  key/value gradients to accumulators that travel with the blocks and arrive home after the
  last step. Nothing ``[S, S]`` exists on any device; the residuals are the local q, k, v,
  output and softmax statistics.

Numerics: logits and softmax in float32 like :func:`jax.nn.dot_product_attention`'s XLA path
(masked logits set to ``-0.7 * float32 max``, so a query with no allowed key averages all
values, as there); the sum over blocks runs in another order than one device's softmax, so the
results agree within float32 rounding, not bit for bit.

>>> import jax, jax.numpy as jnp
>>> from fp8jax.functional.context_parallel import context_parallel_attention
>>> q = jnp.ones((1, 8, 2, 4))
>>> with jax.set_mesh(jax.make_mesh((1,), ("cp",))):
...     context_parallel_attention(q, q, q, axis="cp", strategy="ring", is_causal=True).shape
(1, 8, 2, 4)
"""

from __future__ import annotations

import enum
import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fp8jax.functional.load_balancing import ReorderStrategy, reorder_permutation
from fp8jax.ops.base.partition import explicit_mesh

__all__ = [
    "CPStrategy",
    "block_attention",
    "canonical_strategy",
    "context_parallel_attention",
]

_PRESETS = {
    jnp.dtype(jnp.bfloat16): jax.lax.DotAlgorithmPreset.BF16_BF16_F32,
    jnp.dtype(jnp.float16): jax.lax.DotAlgorithmPreset.F16_F16_F32,
}


_Opt = jax.Array | None
_Stats = tuple[jax.Array, jax.Array, jax.Array]  # (o, m, l) of the online softmax


class CPStrategy(enum.Enum):
    """TE's context-parallel strategies (its member names and values); ``DEFAULT`` is
    all-gather, as in TE."""

    DEFAULT = 0
    ALL_GATHER = 1
    RING = 2


_SPELLINGS = {"DEFAULT": "all_gather", "ALL_GATHER": "all_gather", "ALLGATHER": "all_gather",
              "RING": "ring"}  # fmt: skip


def canonical_strategy(value: Any, name: str = "context_parallel_strategy") -> str:
    """``"all_gather"`` or ``"ring"`` from TE's spellings (``"DEFAULT"``, ``"ALL_GATHER"``,
    ``"ALLGATHER"``, ``"RING"``, any case) or a :class:`CPStrategy`.

    Raises:
      TypeError: ``value`` is neither a str nor a :class:`CPStrategy`.
      ValueError: an unknown spelling (the message names ``name``).
    """
    if isinstance(value, CPStrategy):
        value = value.name
    if not isinstance(value, str):
        raise TypeError(f"{name} must be a str or a CPStrategy, got {value!r}")
    out = _SPELLINGS.get(value.upper().strip())
    if out is None:
        raise ValueError(f"{name} must be one of {tuple(_SPELLINGS)} (any case), got {value!r}")
    return out


class _Mask(NamedTuple):
    is_causal: bool
    window: tuple[int, int] | None  # (left, right), each >= 0: no unbounded side here


def _allowed(
    mask: _Mask, qpos: jax.Array, kpos: jax.Array, qseg: _Opt, kseg: _Opt
) -> jax.Array | None:
    """``[b|1, 1, 1, sq, skv]`` True where a query may attend a key, or ``None`` (all)."""
    keep = None

    def conj(a, b):
        return b if a is None else a & b

    qp, kp = qpos[:, None], kpos[None, :]
    if mask.is_causal:
        keep = conj(keep, kp <= qp)
    if mask.window is not None:
        keep = conj(keep, (kp >= qp - mask.window[0]) & (kp <= qp + mask.window[1]))
    if keep is not None:
        keep = keep[None, None, None]
    if qseg is not None:
        seg = (qseg[:, :, None] == kseg[:, None, :]) & (kseg[:, None, :] != 0)
        keep = conj(keep, seg[:, None, None])
    return keep


def _logits(q: jax.Array, k: jax.Array, scale: float, keep: _Opt) -> jax.Array:
    """Masked float32 logits ``[b, g, r, sq, skv]`` (``r`` query heads per group)."""
    b, sq, h, d = q.shape
    g = k.shape[2]
    qg = q.reshape(b, sq, g, h // g, d)
    s = jnp.einsum("bqgrd,bkgd->bgrqk", qg, k, precision=_PRESETS.get(jnp.dtype(q.dtype)),
                   preferred_element_type=jnp.float32)  # fmt: skip
    s = s * jnp.float32(scale)
    if keep is not None:
        s = jnp.where(keep, s, jnp.float32(-0.7 * float(np.finfo(np.float32).max)))
    return s


def block_attention(
    q: jax.Array, k: jax.Array, v: jax.Array, scale: float, keep: _Opt
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One block of the online softmax: ``(o, m, l)``, ``o`` the float32 unnormalized output
    ``[b, sq, h, d]``, ``m`` the rows' max logit and ``l`` their sum of ``exp(s - m)``
    (``[b, g, r, sq]``). ``keep`` as :func:`_allowed` makes it (True = attend)."""
    b, sq, h, d = q.shape
    s = _logits(q, k, scale, keep)
    m = jnp.max(s, axis=-1)
    p = jnp.exp(s - m[..., None])
    l_ = jnp.sum(p, axis=-1)
    o = jnp.einsum("bgrqk,bkgd->bqgrd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o.reshape(b, sq, h, d), m, l_


def _merge(acc: _Stats, blk: _Stats) -> _Stats:
    """Two online-softmax partials ``(o, m, l)`` merged (float32)."""
    o1, m1, l1 = acc
    o2, m2, l2 = blk
    m = jnp.maximum(m1, m2)
    a1, a2 = jnp.exp(m1 - m), jnp.exp(m2 - m)
    return o1 * _rows(a1) + o2 * _rows(a2), m, l1 * a1 + l2 * a2


def _rows(a: jax.Array) -> jax.Array:
    """``[b, g, r, sq]`` row statistics as ``[b, sq, h, 1]``, to scale an output."""
    b, g, r, sq = a.shape
    return jnp.moveaxis(a, 3, 1).reshape(b, sq, g * r, 1)


class _Ring(NamedTuple):
    axis: str
    size: int
    mask: _Mask
    scale: float
    dtype: Any


def _shift(cfg: _Ring, tree: Any) -> Any:
    """``tree`` sent one device along the ring (device ``i`` to ``i + 1``)."""
    perm = [(i, (i + 1) % cfg.size) for i in range(cfg.size)]
    return jax.tree.map(lambda x: jax.lax.ppermute(x, cfg.axis, perm), tree)


def _ring_forward(cfg: _Ring, q, k, v, qpos, kpos, qseg, kseg) -> tuple[jax.Array, Any]:
    """The ring's forward on one device's blocks: ``(out, (row max, row sum))``."""
    acc = None
    kv = (k, v, kpos, kseg)
    for step in range(cfg.size):
        # the next block's exchange is issued before this block's attention: they can overlap
        nxt = _shift(cfg, kv) if step < cfg.size - 1 else None
        kb, vb, kp, ks = kv
        blk = block_attention(q, kb, vb, cfg.scale, _allowed(cfg.mask, qpos, kp, qseg, ks))
        acc = blk if acc is None else _merge(acc, blk)
        kv = nxt
    o, m, l_ = acc
    out = (o / _rows(l_)).astype(cfg.dtype)
    return out, (m, l_)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _ring(cfg: _Ring, q, k, v, qpos, kpos, qseg, kseg) -> jax.Array:
    """Ring attention on one device's blocks (inside the ``shard_map``), its backward the
    ring reversed (:func:`_ring_bwd`)."""
    return _ring_forward(cfg, q, k, v, qpos, kpos, qseg, kseg)[0]


def _ring_fwd(cfg: _Ring, q, k, v, qpos, kpos, qseg, kseg) -> tuple[jax.Array, tuple]:
    """The forward, saving the local blocks, the output and the softmax statistics."""
    out, stats = _ring_forward(cfg, q, k, v, qpos, kpos, qseg, kseg)
    return out, (q, k, v, qpos, kpos, qseg, kseg, out, stats)


def _ring_bwd(cfg: _Ring, res: tuple, g_out: jax.Array) -> tuple:
    """The flash-attention backward, block by block around the ring; the key/value gradients
    travel with their blocks."""
    q, k, v, qpos, kpos, qseg, kseg, out, (m, l_) = res
    b, sq, h, d = q.shape
    grp = k.shape[2]
    do = g_out.astype(jnp.float32)
    dog = do.reshape(b, sq, grp, h // grp, d)
    # D_i = sum_d dO_i O_i: the softmax backward's row term
    delta = jnp.einsum("bqgrd,bqgrd->bgrq", dog, out.astype(jnp.float32).reshape(dog.shape))
    qg = q.reshape(b, sq, grp, h // grp, d).astype(jnp.float32)
    dq = jnp.zeros(qg.shape, jnp.float32)
    kv = (k, v, kpos, kseg)
    dkv = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    for step in range(cfg.size):
        nxt = _shift(cfg, kv) if step < cfg.size - 1 else None
        kb, vb, kp, ks = kv
        keep = _allowed(cfg.mask, qpos, kp, qseg, ks)
        # exp(s - m) / l, not exp(s - lse): a row with no allowed key has m = -0.7 * max,
        # which absorbs log(l) in float32
        p = jnp.exp(_logits(q, kb, cfg.scale, keep) - m[..., None]) / l_[..., None]
        dv = jnp.einsum("bgrqk,bqgrd->bkgd", p, dog)
        dp = jnp.einsum("bqgrd,bkgd->bgrqk", dog, vb.astype(jnp.float32))
        ds = p * (dp - delta[..., None]) * jnp.float32(cfg.scale)
        if keep is not None:
            ds = jnp.where(keep, ds, 0.0)
        dq = dq + jnp.einsum("bgrqk,bkgd->bqgrd", ds, kb.astype(jnp.float32))
        dk = jnp.einsum("bgrqk,bqgrd->bkgd", ds, qg)
        # the accumulators travel with their block: after the last step they are home
        dkv = _shift(cfg, (dkv[0] + dk, dkv[1] + dv))
        kv = nxt
    zeros = [None if t is None else np.zeros(t.shape, jax.dtypes.float0)
             for t in (qpos, kpos, qseg, kseg)]  # fmt: skip
    return (dq.reshape(q.shape).astype(q.dtype), dkv[0].astype(k.dtype),
            dkv[1].astype(v.dtype), *zeros)  # fmt: skip


_ring.defvjp(_ring_fwd, _ring_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _gather_tokens(t: jax.Array, axis: str) -> jax.Array:
    """The keys or values of every device along ``axis`` (their dim 1, tokens), in order."""
    return jax.lax.all_gather(t, axis, axis=1, tiled=True)


def _gather_tokens_fwd(t: jax.Array, axis: str) -> tuple[jax.Array, None]:
    return _gather_tokens(t, axis), None


def _gather_tokens_bwd(axis: str, _: None, g: jax.Array) -> tuple[jax.Array]:
    # Each device's share of the gathered gradient, summed over the axis in float32 (as the
    # ring's travelling dK/dV): a bfloat16 reduce-scatter, what autodiff of all_gather gives,
    # also aborts XLA:CPU's compiler (AllReducePromotion: "Invalid binary instruction opcode
    # copy", JAX 0.12).
    part = jax.lax.psum_scatter(g.astype(jnp.float32), axis, scatter_dimension=1, tiled=True)
    return (part.astype(g.dtype),)


_gather_tokens.defvjp(_gather_tokens_fwd, _gather_tokens_bwd)


def _all_gather(cfg: _Ring, q, k, v, qpos, kpos, qseg, kseg) -> jax.Array:
    """All-gather attention on one device's queries (inside the ``shard_map``)."""
    k, v = _gather_tokens(k, cfg.axis), _gather_tokens(v, cfg.axis)
    if kseg is not None:
        kseg = jax.lax.all_gather(kseg, cfg.axis, axis=1, tiled=True)
    kpos = jax.lax.all_gather(kpos, cfg.axis, axis=0, tiled=True)
    o, _, l_ = block_attention(q, k, v, cfg.scale, _allowed(cfg.mask, qpos, kpos, qseg, kseg))
    return (o / _rows(l_)).astype(cfg.dtype)


def _window(window: tuple[int, int] | None, seq_len: int) -> tuple[int, int] | None:
    """TE's ``(left, right)`` (negative: unbounded) as bounds >= 0, or ``None``."""
    if window is None:
        return None
    left, right = (seq_len if w < 0 else min(int(w), seq_len) for w in window)
    return None if left >= seq_len and right >= seq_len else (left, right)


def context_parallel_attention(
    query: jax.Array,
    key: jax.Array,
    value: jax.Array,
    *,
    axis: str,
    strategy: Any = "all_gather",
    load_balanced: bool = False,
    is_causal: bool = False,
    window: tuple[int, int] | None = None,
    segment_ids: tuple[jax.Array, jax.Array] | None = None,
    scale: float | None = None,
    dtype: Any = None,
) -> jax.Array:
    """Attention of ``query`` ``[b, s, heads, d]`` on ``key``/``value`` ``[b, s, groups, d]``
    (global arrays) with the sequence split over the mesh axis ``axis`` of the current mesh
    (``jax.set_mesh``), the other axes left to XLA (a ``shard_map`` manual over ``axis``
    only). An axis of size 1 runs the same block formula on the whole sequence (the layers
    run their plain path instead).

    Args:
      axis: the context-parallel mesh axis.
      strategy: ``"all_gather"`` or ``"ring"`` (TE's spellings, :func:`canonical_strategy`).
      load_balanced: the sequence is in ``ReorderStrategy.DualChunkSwap`` order over the
        axis's devices (causal load balancing).
      is_causal: a query attends to keys at or before its position (original order).
      window: TE's sliding window ``(left, right)``, negative meaning unbounded.
      segment_ids: ``(q_ids, kv_ids)`` ``int[b, s]``: a query attends to keys of its own
        segment; id 0 is padding.
      scale: the logits' scale (default ``1 / sqrt(d)``).
      dtype: the output's dtype (default the inputs' promoted one).

    Raises:
      ValueError: no current mesh with ``axis``, the sequence not a multiple of the axis size
        (twice it with ``load_balanced``), query and key lengths differ, or bad shapes.
    """
    where = "context_parallel_attention"
    strategy = canonical_strategy(strategy, "strategy")
    q, k, v = (jnp.asarray(t) for t in (query, key, value))
    if q.ndim != 4 or k.ndim != 4 or k.shape != v.shape or q.shape[0] != k.shape[0]:
        raise ValueError(f"{where}: query [b, s, h, d] and key = value [b, s, g, d] expected, "
                         f"got {q.shape}, {k.shape}, {v.shape}")  # fmt: skip
    if q.shape[1] != k.shape[1] or q.shape[2] % k.shape[2] or q.shape[3] != k.shape[3]:
        raise ValueError(f"{where}: context parallelism needs self-attention shapes (equal "
                         f"sequence lengths and head widths, groups dividing heads), got "
                         f"query {q.shape} and key {k.shape}")  # fmt: skip
    mesh = jax.sharding.get_abstract_mesh()
    if not isinstance(axis, str) or mesh.empty or axis not in mesh.axis_names:
        raise ValueError(
            f"{where}: axis={axis!r} must name an axis of the current mesh (set with "
            f"jax.set_mesh(mesh) around the call), got mesh axes "
            f"{() if mesh.empty else mesh.axis_names}"
        )
    b, s, _, d = q.shape
    n = mesh.shape[axis]
    dtype = jnp.dtype(dtype if dtype is not None else jnp.result_type(q, k, v))
    scale = 1.0 / float(np.sqrt(d)) if scale is None else float(scale)
    mask = _Mask(bool(is_causal), _window(window, s))
    if s % (2 * n if load_balanced and n > 1 else n):
        twice = "2 * " if load_balanced else ""
        raise ValueError(f"{where}: the sequence length {s} must be a multiple of {twice}the "
                         f"{axis!r} axis's size {n}")  # fmt: skip
    pos = np.arange(s, dtype=np.int32)
    if load_balanced:
        pos = reorder_permutation(s, ReorderStrategy.DualChunkSwap, n)
    qseg = kseg = None
    if segment_ids is not None:
        qseg, kseg = (jnp.asarray(t, jnp.int32) for t in segment_ids)
        if qseg.shape != (b, s) or kseg.shape != (b, s):
            raise ValueError(f"{where}: segment_ids must be two int [b, s] = {(b, s)} arrays, "
                             f"got {qseg.shape}, {kseg.shape}")  # fmt: skip
    cfg = _Ring(axis, n, mask, scale, dtype)
    q, k, v = (t.astype(dtype) for t in (q, k, v))
    if n == 1:
        keep = _allowed(mask, jnp.asarray(pos), jnp.asarray(pos), qseg, kseg)
        o, _, l_ = block_attention(q, k, v, scale, keep)
        return (o / _rows(l_)).astype(dtype)
    P = jax.sharding.PartitionSpec
    body = functools.partial(_ring if strategy == "ring" else _all_gather, cfg)
    seq, tok = P(None, axis), P(axis)
    seg_spec = None if qseg is None else seq

    def mapped(*args):
        return jax.shard_map(
            body, mesh=jax.sharding.get_abstract_mesh(), in_specs=(seq, seq, seq, tok, tok,
            seg_spec, seg_spec), out_specs=seq, axis_names={axis},
        )(*args)  # fmt: skip

    args = (q, k, v, jnp.asarray(pos), jnp.asarray(pos), qseg, kseg)
    if not explicit_mesh():
        return jax.jit(mapped)(*args)
    # explicit axes (jax.make_mesh's default): the shard_map runs with automatic axes inside
    # (JAX's all_gather in a shard_map manual over only some explicit axes fails to trace);
    # the output is laid out as the query was
    spec = jax.typeof(q).sharding.spec
    return jax.jit(jax.sharding.auto_axes(mapped, out_sharding=spec))(*args)
