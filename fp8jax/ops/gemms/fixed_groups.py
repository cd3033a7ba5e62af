"""FP8 GEMMs whose kernel has a small group dim of its own, ``(hidden, g, N)``, kept as such so
that tensor parallelism splits them without resharding: the gated MLP's first GEMM (``g = 2``,
the activation pair) and the fused QKV (``g = 3``) and KV (``g = 2``) projections.

A gated ``LayerNormMLP`` has ``kernel_1`` ``(hidden, 2, inter)``; its GEMMs run on the 2-D view
``(hidden, 2 * inter)``. Under tensor parallelism ``inter`` is split, and the merged dim
``2 * inter`` then has no block split (each device holds two separate column blocks), so a
global reshape makes the partitioner gather the kernel, its bias and, in the backward, the
activation gradient. Here the pair stays a separate, never split dim ``g`` of the global
operands, and each device reshapes its own block to 2-D (``g * inter_local``, a free view) for
the 2-D kernel, which is therefore run exactly as on one device:

* :func:`gemm_n` ``out[M, g, N] = a[M, K] . b[g, N, K]^T (+ bias[g, N])``: the forward GEMM
  (``b`` the kernel's transposed FP8 copy) and the wgrad (``a`` the norm output's transposed
  copy ``[hidden, M]``, ``b`` the activation gradient's ``[g, inter, M]``);
* :func:`gemm_k` ``out[M, N] = a[M, g, K] . b[N, g, K]^T``, contracting ``(g, K)``: the dgrad;

Splits are decided as :mod:`fp8jax.ops.gemms._gemm_partition` decides them for the 2-D GEMM (M as
the activations' rows, N column parallel, K split: float32 partial products summed with one psum,
then the bias), with ``g`` never split; the dgrad reuses the forward's gathered kernel under
FSDP, as the 2-D dgrad does. Under explicit sharding (``AxisType.Explicit``) the results are
typed with the plan's split (there the 2-D form's reshape is not even allowed). Under ``vmap``
they batch as the 2-D form; with the ``"xla"`` GEMM implementation the layer keeps its 2-D
GEMMs (:func:`usable`), which XLA partitions itself. A layer's GEMM on them (kernel cast,
output-gradient cast with its bias gradient, dgrad and wgrad) is in :mod:`fp8jax.functional._core`
(``grouped_forward``, ``grouped_cast_grad``, ``grouped_backward``).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from fp8jax.ops.base import partition
from fp8jax.ops.gemms._gemm_partition import operand_dims, plan_mnk
from fp8jax.ops.gemms.gemm import gemm_codes, local_gemm
from fp8jax.ops.gemms.gemm_options import get_gemm_options

__all__ = []  # internal to fp8jax.ops: none of its names is public API


def usable(implementation: str) -> bool:
    """Whether the grouped GEMMs apply: with the kernel GEMM."""
    return implementation == "kernel"


def _axes(x: jax.Array, dim: int) -> tuple[str, ...]:
    spec = (*jax.typeof(x).sharding.spec, *(None,) * x.ndim)
    return partition.entry_axes(spec[dim])


def _typed(call, out_dims):
    """``call`` under explicit sharding (``AxisType.Explicit``), where the result's sharding is
    part of its type: run with automatic axes inside, the result typed ``out_dims`` (the
    split the plan gives it), as ``_gemm_partition`` does for the 2-D GEMM."""
    if not partition.explicit_mesh():
        return call
    return jax.sharding.auto_axes(call, out_sharding=partition.spec(out_dims))


def _fake(shape, dtype) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(tuple(shape), dtype)


def _local_2d(local, k_axes, out_dtype, accumulate, a, b, sa, sb, bias):
    """The 2-D GEMM on this device's blocks; with a K split, the float32 partials are summed
    over ``k_axes`` before the bias and the one rounding to ``out_dtype``."""
    if not k_axes:
        return local(a, b, sa, sb, bias, out_dtype=out_dtype, accumulate=accumulate)
    part = local(a, b, sa, sb, None, out_dtype=jnp.float32, accumulate=accumulate)
    y = jax.lax.psum(part, k_axes)
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(out_dtype)


@functools.cache
def _gemm_n(codes, out_dtype, accumulate, has_bias, sa_ndim, sb_ndim, autotune):
    local = local_gemm(codes, autotune)

    def kernel(k_axes, a, b, sa, sb, *bias):
        g, n, k = b.shape
        bias2 = bias[0].reshape(g * n) if has_bias else None
        y = _local_2d(local, k_axes, out_dtype, accumulate, a, b.reshape(g * n, k), sa, sb, bias2)
        return (y.reshape(a.shape[0], g, n),)

    def plan(mesh, args):
        a, b = args[0], args[1]
        _, bn, bk = operand_dims(b)
        m, n, k = plan_mnk(mesh, a, _fake(b.shape[1:], b.dtype), operand_dims(a), (bn, bk))
        ins = [
            partition.named(mesh, (m, k)),
            partition.named(mesh, ((), n, k)),
            partition.named(mesh, ((),) * sa_ndim),
            partition.named(mesh, ((),) * sb_ndim),
        ] + ([partition.named(mesh, ((), n))] if has_bias else [])
        out = partition.named(mesh, (m, (), n))
        k_axes = partition.splitting_axes(mesh, (k,))
        return ins, (out,), functools.partial(kernel, k_axes)

    operands = ["m k", "g n k", "sa" * sa_ndim, "sb" * sb_ndim] + (["g n"] if has_bias else [])
    rule = ", ".join(operands) + " -> m g n"
    return partition.partitioned(functools.partial(kernel, ()), plan, rule, need_replication=("g",))


def _reused(mesh, a, w_t, x_t):
    """The dgrad's ``(m, n, k)`` on the forward GEMM's gathered ``w_t [g, N_fwd, K_fwd]`` (see
    ``_gemm_partition.reused_plan``), or ``None`` when the forward gathered nothing."""
    x_dims = operand_dims(x_t)[::-1]
    x = _fake(x_t.shape[::-1], x_t.dtype)
    _, wn, wk = operand_dims(w_t)
    _, fwd_n, fwd_k = plan_mnk(mesh, x, _fake(w_t.shape[1:], w_t.dtype), x_dims, (wn, wk))
    if (fwd_n, fwd_k) == (wn, wk):
        return None
    m = operand_dims(a)[0]
    if set(m) & set(fwd_n + fwd_k):
        return None
    return m, fwd_k, fwd_n


@functools.cache
def _gemm_k(codes, out_dtype, accumulate, sa_ndim, sb_ndim, autotune):
    local = local_gemm(codes, autotune)

    def kernel(k_axes, from_reuse, a, b, sa, sb, w_t, x_t):
        del x_t
        if from_reuse:  # the gathered [g, N_fwd, K_fwd] forward kernel -> [K_fwd, g, N_fwd]
            b = jnp.transpose(w_t, (2, 0, 1))
        m, g, k = a.shape
        b2 = b.reshape(b.shape[0], g * k)
        return (_local_2d(local, k_axes, out_dtype, accumulate, a.reshape(m, g * k), b2, sa, sb,
                          None),)  # fmt: skip

    def plan(mesh, args):
        a, b, w_t, x_t = args[0], args[1], args[-2], args[-1]
        reused = _reused(mesh, a, w_t, x_t)
        if reused:
            m, n, k = reused
        else:
            (am, _, ak), (bn, _, bk) = operand_dims(a), operand_dims(b)
            a2, b2 = (
                _fake((a.shape[0], a.shape[2]), a.dtype),
                _fake((b.shape[0], b.shape[2]), b.dtype),
            )
            m, n, k = plan_mnk(mesh, a2, b2, (am, ak), (bn, bk))
        as_is = lambda v: v.sharding if isinstance(v.sharding, jax.sharding.NamedSharding) else (
            partition.named(mesh, ((),) * v.ndim))  # fmt: skip
        ins = [
            partition.named(mesh, (m, (), k)),
            as_is(b) if reused else partition.named(mesh, (n, (), k)),
            partition.named(mesh, ((),) * sa_ndim),
            partition.named(mesh, ((),) * sb_ndim),
            partition.named(mesh, ((), k, n)) if reused else as_is(w_t),
            as_is(x_t),
        ]
        out = partition.named(mesh, (m, n))
        k_axes = partition.splitting_axes(mesh, (k,))
        return ins, (out,), functools.partial(kernel, k_axes, reused is not None)

    rule = f"m g k, n g k, {'sa' * sa_ndim}, {'sb' * sb_ndim}, r0 r1 r2, r3 r4 -> m n"
    return partition.partitioned(
        functools.partial(kernel, (), False), plan, rule, need_replication=("g",)
    )


def _codes(dtypes) -> tuple[np.dtype, np.dtype]:
    return tuple(np.dtype(d) for d in dtypes)


def _batchable(op, fallback):
    """``op`` with a vmap rule: under ``vmap`` the layer's 2-D form, ``fallback``, batched."""

    @jax.custom_batching.custom_vmap
    def call(*args):
        return op(*args)

    @call.def_vmap
    def rule(axis_size, in_batched, *args):
        del axis_size
        axes = tuple(0 if b else None for b in in_batched)
        return jax.vmap(fallback, in_axes=axes)(*args), True

    return call


def gemm_n(a, b, a_sinv, b_sinv, *, dtypes, out_dtype, bias=None, accumulate="fast"):
    """``out[M, g, N] = a[M, K] . b[g, N, K]^T * a_sinv * b_sinv (+ bias[g, N])`` on ``uint8``
    codes of FP8 ``dtypes = (a's, b's)``."""
    op = _gemm_n(
        _codes(dtypes), jnp.dtype(out_dtype), accumulate, bias is not None, jnp.ndim(a_sinv),
        jnp.ndim(b_sinv), get_gemm_options().autotune,
    )  # fmt: skip

    def fallback(a, b, a_sinv, b_sinv, *bias):
        g, n, k = b.shape
        y = gemm_codes(
            a, b.reshape(g * n, k), a_sinv, b_sinv, dtypes=dtypes, out_dtype=out_dtype,
            bias=bias[0].reshape(g * n) if bias else None, accumulate=accumulate,
            implementation="kernel",
        )  # fmt: skip
        return y.reshape(a.shape[0], g, n)

    call = _batchable(lambda *args: op(*args)[0], fallback)
    if partition.explicit_mesh():
        m = _axes(a, 0)
        call = _typed(call, (m, (), tuple(x for x in _axes(b, 1) if x not in m)))
    return call(a, b, a_sinv, b_sinv, *(() if bias is None else (bias,)))


def gemm_k(a, b, a_sinv, b_sinv, *, dtypes, out_dtype, reuse, accumulate="split"):
    """``out[M, N] = sum over (g, K) of a[M, g, K] b[N, g, K] * a_sinv * b_sinv`` on codes;
    ``reuse = (w_t [g, K, N], x_t)``: the forward GEMM's ``b`` and its ``a`` transposed (read
    for their shardings: under FSDP the forward's gathered kernel is transposed locally)."""
    op = _gemm_k(
        _codes(dtypes),
        jnp.dtype(out_dtype),
        accumulate,
        jnp.ndim(a_sinv),
        jnp.ndim(b_sinv),
        get_gemm_options().autotune,
    )

    def fallback(a, b, a_sinv, b_sinv, w_t, x_t):
        del w_t, x_t
        m, g, k = a.shape
        return gemm_codes(
            a.reshape(m, g * k), b.reshape(b.shape[0], g * k), a_sinv, b_sinv, dtypes=dtypes,
            out_dtype=out_dtype, accumulate=accumulate, implementation="kernel",
        )  # fmt: skip

    call = _batchable(lambda *args: op(*args)[0], fallback)
    if partition.explicit_mesh():
        m = _axes(a, 0)
        call = _typed(call, (m, tuple(x for x in _axes(b, 0) if x not in m)))
    return call(a, b, a_sinv, b_sinv, *reuse)
