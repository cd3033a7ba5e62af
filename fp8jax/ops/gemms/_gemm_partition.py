"""The sharding rule of the FP8 GEMM (``fp8jax.ops.gemm``), kept apart from the kernel binding.

``gemm`` computes ``out[M, N] = a[M, K] . b[N, K]^T * a_scale_inv * b_scale_inv (+ bias[N])``.
Under :func:`jax.jit` on a mesh, :func:`partitioned_gemm` splits it the way XLA splits its own
dot, with no gather that a BF16 dot would not do:

* M stays split as ``a``'s rows are (data parallel, sequence parallel): local.
* N stays split as ``b``'s rows (and ``bias``) are (column-parallel tensor parallelism): local.
* K split (row-parallel tensor parallelism, or both operands split along K): each device
  multiplies its K block into a float32 partial product (scales applied, no bias), the partials
  are summed with one all-reduce (``psum``) over the K axes, then the bias is added in float32
  and the result rounded once to ``out_dtype``, as the single-device GEMM does. The sum order
  differs from one device's, so the result equals it within float32 reduction-order tolerance.
  Without a K split each output element is the same sum, but a GEMM of another block shape may
  order it differently (XLA:CPU in JAX 0.12 does, by one rounding; so may cuBLASLt's heuristic).
* Conflicts are resolved towards ``a`` (the activations), whose layout is never changed:
  ``a``'s K split wins over ``b``'s, and a mesh axis that splits ``a``'s M is taken off ``b``'s
  N and K (FSDP: the weight is gathered, as XLA does for its own dot).

Dims that their axes do not divide evenly are not split (see :mod:`fp8jax.ops.base.partition`).

FSDP and the backward pass. A layer needs its FP8 weight in both layouts: ``w_t`` [N, K] as the
forward GEMM's ``b`` and ``w_q`` [K, N] as the dgrad GEMM's ``b``. Under FSDP each GEMM would
gather its own layout: two all-gathers of one weight per step, one of them on the backward
critical path, where XLA's own dot gathers the weight once and keeps it. The dgrad GEMM
therefore takes ``reuse = (w_t, x_t)``, the forward GEMM's ``b`` and its ``a`` transposed
(read for its sharding only): when the forward GEMM gathered ``w_t``, the dgrad GEMM asks for
``w_t`` with exactly the same sharding (XLA's partitioner reshards a value to a given sharding
once and reuses it, so no second all-gather is emitted; the multi-device tests count the
gathers, in JAX 0.10.2 and the newest) and transposes the gathered copy locally; otherwise it
uses ``w_q`` as usual. These operands get their own Shardy factors, so
nothing propagates through them.

``local`` is the single-device 2-D GEMM, ``local(a, b, a_scale_inv, b_scale_inv, bias, *,
out_dtype, accumulate)`` (``gemm._gemm_2d``): this module does not import ``gemm`` itself.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding

from fp8jax.ops.base import partition

__all__ = []  # internal to fp8jax.ops: none of its names is public API


def gemm_sharding_rule(
    a_scale_ndim: int, b_scale_ndim: int, has_bias: bool, has_reuse: bool = False
) -> str:
    """The Shardy rule, e.g. ``"m k, n k, sa, sb, n -> m n"``; with ``reuse``, two more operands
    with factors of their own (``..., r0 r1, r2 r3 -> m n``).

    ``k`` is deliberately not declared a reduction factor: the partition function does the K
    reduction itself (``psum``), and a declared one would invite Shardy to add its own. (With
    JAX 0.10.2 declaring it changes nothing, measured.)
    """
    operands = ["m k", "n k", "sa" * a_scale_ndim, "sb" * b_scale_ndim]
    if has_bias:
        operands.append("n")
    if has_reuse:
        operands += ["r0 r1", "r2 r3"]
    return ", ".join(operands) + " -> m n"


def divisible_axes(mesh, axes: tuple[str, ...], size: int) -> tuple[str, ...]:
    """``axes`` if they divide a dim of ``size`` evenly, else ``()`` (not split)."""
    return axes if size % math.prod(mesh.shape[a] for a in axes) == 0 else ()


def operand_dims(arg) -> tuple[tuple[str, ...], ...]:
    if isinstance(arg.sharding, NamedSharding):
        return partition.dim_axes(arg.sharding, arg.shape)
    return ((),) * arg.ndim  # not known yet (GSPMD): take it as replicated


def _as_is(mesh, arg) -> NamedSharding:
    """An operand's own sharding (for operands the kernel does not read: never resharded)."""
    if isinstance(arg.sharding, NamedSharding):
        return arg.sharding
    return partition.named(mesh, ((),) * arg.ndim)


def plan_mnk(mesh, a, b, a_dims, b_dims):
    """The axes that split M, N and K of ``a [M, K] . b [N, K]^T`` (see the module docstring)."""
    (am, ak), (bn, bk) = a_dims, b_dims
    m = am  # the activations keep their rows' split (DP, SP); never re-laid out
    k = ak or tuple(x for x in bk if x not in m)
    k = divisible_axes(mesh, divisible_axes(mesh, k, a.shape[1]), b.shape[1])
    n = divisible_axes(mesh, tuple(x for x in bn if x not in k and x not in m), b.shape[0])
    return m, n, k


def reused_plan(mesh, a, w_t, x_t):
    """For the dgrad GEMM ``a [M, N] . w_q [K, N]^T``: ``(m, n, k)`` of the GEMM run on the
    transpose of the gathered ``w_t`` the forward GEMM ``x [M, K] . w_t [N, K]^T`` made, or
    ``None`` when the forward GEMM did not gather ``w_t``."""
    x_dims = operand_dims(x_t)[::-1]
    x = jax.ShapeDtypeStruct(x_t.shape[::-1], x_t.dtype)
    _, fwd_n, fwd_k = plan_mnk(mesh, x, w_t, x_dims, operand_dims(w_t))
    if (fwd_n, fwd_k) == operand_dims(w_t):
        return None  # w_t ran as it lives: nothing was gathered, nothing to reuse
    m = operand_dims(a)[0]
    if set(m) & set(fwd_n + fwd_k):
        return None  # the gradient's rows are split otherwise than x's: the plain plan
    # dgrad's N is the forward's K (output columns), its K is the forward's N (contracted).
    return m, fwd_k, fwd_n


@functools.cache
def partitioned_gemm(
    local: Callable[..., jax.Array],
    out_dtype: Any,
    accumulate: str,
    has_bias: bool,
    a_scale_ndim: int,
    b_scale_ndim: int,
    has_reuse: bool = False,
) -> Callable[..., jax.Array]:
    """The 2-D GEMM ``(a, b, a_scale_inv, b_scale_inv, bias=None, reuse=None) -> out`` with its
    sharding rule; ``has_bias``/``has_reuse`` say whether ``bias``/``reuse`` are given.
    ``reuse = (w_t, x_t)``: for a dgrad GEMM ``a = g [M, N]``, ``b = w_q [K, N]``, the forward
    GEMM's ``b = w_t = b^T`` and ``a^T = x_t`` (see the module docstring). Cached, so a jit cache
    sees one partitioned function per configuration."""

    def unpack(args, from_reuse):
        a, b, a_scale_inv, b_scale_inv = args[:4]
        bias = args[4] if has_bias else None
        if from_reuse:
            b = jnp.swapaxes(args[-2], 0, 1)  # the gathered w_t, transposed on each device
        return a, b, a_scale_inv, b_scale_inv, bias

    def kernel(from_reuse, *args):
        a, b, a_scale_inv, b_scale_inv, bias = unpack(args, from_reuse)
        y = local(a, b, a_scale_inv, b_scale_inv, bias, out_dtype=out_dtype, accumulate=accumulate)
        return (y,)

    def k_split(k_axes, from_reuse, *args):
        a, b, a_scale_inv, b_scale_inv, bias = unpack(args, from_reuse)
        part = local(
            a, b, a_scale_inv, b_scale_inv, None, out_dtype=jnp.float32, accumulate=accumulate
        )
        y = jax.lax.psum(part, k_axes)
        if bias is not None:
            y = y + bias.astype(jnp.float32)
        return (y.astype(out_dtype),)

    def plan(mesh, arg_shapes):
        a, b = arg_shapes[0], arg_shapes[1]
        reused = reused_plan(mesh, a, *arg_shapes[-2:]) if has_reuse else None
        m, n, k = reused or plan_mnk(mesh, a, b, operand_dims(a), operand_dims(b))
        ins = [
            partition.named(mesh, (m, k)),
            _as_is(mesh, b) if reused else partition.named(mesh, (n, k)),
            partition.named(mesh, ((),) * a_scale_ndim),
            partition.named(mesh, ((),) * b_scale_ndim),
        ] + ([partition.named(mesh, (n,))] if has_bias else [])
        if has_reuse:
            w_t, x_t = arg_shapes[-2:]
            # w_t: the very sharding the forward GEMM gave it (one all-gather, shared).
            ins += [partition.named(mesh, (k, n)) if reused else _as_is(mesh, w_t)]
            ins += [_as_is(mesh, x_t)]
        out = partition.named(mesh, (m, n))
        k_axes = partition.splitting_axes(mesh, (k,))
        from_reuse = reused is not None
        if k_axes:
            return ins, (out,), functools.partial(k_split, k_axes, from_reuse)
        return ins, (out,), functools.partial(kernel, from_reuse)

    rule = gemm_sharding_rule(a_scale_ndim, b_scale_ndim, has_bias, has_reuse)
    op = partition.partitioned(functools.partial(kernel, False), plan, rule)

    def call(a, b, a_scale_inv, b_scale_inv, bias=None, reuse=None):
        args = (a, b, a_scale_inv, b_scale_inv) + ((bias,) if has_bias else ())
        args += tuple(reuse) if has_reuse else ()
        if not partition.explicit_mesh():
            return op(*args)[0]
        # Explicit sharding: the sharding of the result is part of its type, and the rule above
        # is the one to give it. Inside, the mesh axes are automatic, as custom_partitioning
        # wants them; the result is typed with the sharding the rule gives it.
        out_spec = partition.explicit_matmul_spec(a, b, b_rows_are_n=True)
        return jax.sharding.auto_axes(lambda *xs: op(*xs)[0], out_sharding=out_spec)(*args)

    return call
