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
  differs from one device's, so the result equals it within float32 reduction-order tolerance;
  without a K split the result is the single-device one bit for bit.
* Conflicts are resolved towards ``a`` (the activations), whose layout is never changed:
  ``a``'s K split wins over ``b``'s, and a mesh axis that splits ``a``'s M is taken off ``b``'s
  N and K (FSDP: the weight is gathered, as XLA does for its own dot).

Dims that their axes do not divide evenly are not split (see :mod:`fp8jax.ops._partition`).

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

from fp8jax.ops import _partition

__all__ = ["gemm_sharding_rule", "partitioned_gemm"]


def gemm_sharding_rule(a_scale_ndim: int, b_scale_ndim: int, has_bias: bool) -> str:
    """The Shardy rule, e.g. ``"m k, n k, sa, sb, n -> m n"``.

    ``k`` is deliberately not declared a reduction factor: the partition function does the K
    reduction itself (``psum``), and a declared one would invite Shardy to add its own. (With
    JAX 0.10.2 declaring it changes nothing, measured.)
    """
    operands = ["m k", "n k", "sa" * a_scale_ndim, "sb" * b_scale_ndim]
    if has_bias:
        operands.append("n")
    return ", ".join(operands) + " -> m n"


def _split(mesh, axes: tuple[str, ...], size: int) -> tuple[str, ...]:
    """``axes`` if they divide a dim of ``size`` evenly, else ``()`` (not split)."""
    return axes if size % math.prod(mesh.shape[a] for a in axes) == 0 else ()


def _dims(arg) -> tuple[tuple[str, ...], ...]:
    if isinstance(arg.sharding, NamedSharding):
        return _partition.dim_axes(arg.sharding, arg.shape)
    return ((),) * arg.ndim  # not known yet (GSPMD): take it as replicated


@functools.cache
def partitioned_gemm(
    local: Callable[..., jax.Array],
    out_dtype: Any,
    accumulate: str,
    has_bias: bool,
    a_scale_ndim: int,
    b_scale_ndim: int,
) -> Callable[..., jax.Array]:
    """The 2-D GEMM ``(a, b, a_scale_inv, b_scale_inv, bias=None) -> out`` with its sharding
    rule; ``has_bias`` says whether ``bias`` is given. Cached, so a jit cache sees one
    partitioned function per configuration."""

    def kernel(a, b, a_scale_inv, b_scale_inv, *bias):
        y = local(
            a,
            b,
            a_scale_inv,
            b_scale_inv,
            bias[0] if bias else None,
            out_dtype=out_dtype,
            accumulate=accumulate,
        )
        return (y,)

    def k_split(k_axes, a, b, a_scale_inv, b_scale_inv, *bias):
        part = local(
            a, b, a_scale_inv, b_scale_inv, None, out_dtype=jnp.float32, accumulate=accumulate
        )
        y = jax.lax.psum(part, k_axes)
        if bias:
            y = y + bias[0].astype(jnp.float32)
        return (y.astype(out_dtype),)

    def plan(mesh, arg_shapes):
        a, b = arg_shapes[0], arg_shapes[1]
        (am, ak), (bn, bk) = _dims(a), _dims(b)
        m = am  # the activations keep their rows' split (DP, SP); never re-laid out
        k = ak or tuple(x for x in bk if x not in m)
        k = _split(mesh, _split(mesh, k, a.shape[1]), b.shape[1])
        n = _split(mesh, tuple(x for x in bn if x not in k and x not in m), b.shape[0])
        ins = [
            _partition.named(mesh, (m, k)),
            _partition.named(mesh, (n, k)),
            _partition.named(mesh, ((),) * a_scale_ndim),
            _partition.named(mesh, ((),) * b_scale_ndim),
        ] + ([_partition.named(mesh, (n,))] if has_bias else [])
        out = _partition.named(mesh, (m, n))
        k_axes = _partition.splitting_axes(mesh, (k,))
        return ins, (out,), functools.partial(k_split, k_axes) if k_axes else kernel

    rule = gemm_sharding_rule(a_scale_ndim, b_scale_ndim, has_bias)
    op = _partition.partitioned(kernel, plan, rule)

    def call(a, b, a_scale_inv, b_scale_inv, bias=None):
        args = (a, b, a_scale_inv, b_scale_inv) + ((bias,) if has_bias else ())
        return op(*args)[0]

    return call
