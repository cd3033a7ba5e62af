"""``cast_transpose``: one pass that writes an FP8 tensor and its transpose (last two dims); and
``transpose``, the transpose of codes already cast (a per-expert scale's).

Hopper's FP8 GEMM wants both operands K-major, so the backward pass needs the transposed FP8
copies of the activations and weights; producing them in the same pass as the cast saves a full
read of the high-precision tensor. Numerics are exactly those of :func:`fp8jax.ops.quantize`.

Sharding: under :func:`jax.jit` on a mesh, ``q`` keeps the sharding of ``x`` and ``q_t`` gets it
with the last two dimensions' shardings swapped (each device transposes its own block, which is
the matching block of the global transpose), so nothing is gathered; ``amax`` is the global max,
made so by one all-reduce over exactly the mesh axes that split ``x``. Inside a ``shard_map``
body ``amax`` is the local block's own, as for :func:`~fp8jax.ops.quantize`.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from fp8jax.ops.base import checks, opdef
from fp8jax.ops.casts.quantize import quantize_reference

__all__ = [
    "cast_transpose",
    "cast_transpose_dbias",
    "cast_transpose_dbias_reference",
    "cast_transpose_reference",
    "transpose",
    "transpose_reference",
]


def cast_transpose_reference(
    x: jax.Array, scale: jax.Array, fp8_dtype: Any
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Pure-jnp reference of :func:`cast_transpose`."""
    q, scale_inv, amax = quantize_reference(x, scale, fp8_dtype)
    return q, jnp.swapaxes(q, -1, -2), scale_inv, amax


def _factors(x_ndim: int, scale_ndim: int) -> tuple[list[str], list[str]]:
    """x splits as it is, q_t with its last two dims' splits swapped, the scale replicated."""
    lead, s = opdef.lead(x_ndim - 2), "s" * scale_ndim
    return [f"{lead} m n", s], [f"{lead} m n", f"{lead} n m", s, s]


# The op definition (fp8jax.ops.base.opdef): kernel call, sharding, vmap and the kernel/XLA switch.
_CAST_TRANSPOSE = opdef.OpDef(
    name="cast_transpose",
    family="cast",
    target="fp8jax_cast_transpose",
    reference=cast_transpose_reference,
    outputs=lambda x, scale, *, fp8_dtype: (
        opdef.like(x, fp8_dtype),
        opdef.like(x, fp8_dtype, transpose=True),
        opdef.like(scale, jnp.float32),
        opdef.like(scale, jnp.float32),
    ),
    factors=_factors,
    max_over={3: 0},  # amax: the max over all of x
)
_rule = _CAST_TRANSPOSE.rule  # e.g. "m n, s -> m n, n m, s, s"


def _validated_call(op_def, arg, x, rank, scale, fp8_dtype, amax_reduction, implementation):
    """Checks a cast op's arguments (``rank``: ``(predicate on x.ndim, what it needs)``) and
    runs ``op_def``; ValueError/TypeError naming the argument."""
    op = op_def.name
    x = checks.wide_array(op, arg, x)
    ok, need = rank
    if not ok(x.ndim):
        raise ValueError(f"{op}: {arg} must have {need}, got shape {x.shape}")
    scale = checks.scalar_f32(op, "scale", scale)
    dt = checks.fp8_dtype_arg(op, "fp8_dtype", fp8_dtype)
    reduction = checks.amax_reduction_arg(op, amax_reduction)
    return op_def(x, scale, fp8_dtype=dt, amax_reduction=reduction, implementation=implementation)


def cast_transpose(
    x: jax.Array,
    scale: jax.Array,
    fp8_dtype: Any,
    *,
    amax_reduction: str = "split",
    implementation: str | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Quantizes ``x`` and also returns the transpose; ``(q, q_t, scale_inv, amax)``.

    Args:
      x: float32, bfloat16 or float16 array of rank >= 2; ``q_t`` swaps its last two dims.
      scale: float32, shape ``()`` or ``(1,)``; one scale for the whole tensor.
      fp8_dtype: ``jnp.float8_e4m3fn`` or ``jnp.float8_e5m2``.
      amax_reduction: ``"split"`` (default) or ``"mesh"``, as for
        :func:`~fp8jax.ops.quantize`.
      implementation: ``"kernel"`` or ``"xla"`` (:func:`cast_transpose_reference` compiled by
        XLA); default: the enclosing :func:`fp8jax.ops.implementation` choice for ``"cast"``.

    Returns:
      ``q`` (``x.shape``), ``q_t`` (``x.shape[:-2] + (x.shape[-1], x.shape[-2])``), both
      ``fp8_dtype``, and float32 ``scale_inv`` and ``amax`` of ``scale.shape``.
    """
    rank = (lambda n: n >= 2, "rank >= 2 to be transposed")
    return _validated_call(
        _CAST_TRANSPOSE, "x", x, rank, scale, fp8_dtype, amax_reduction, implementation
    )


# ------------------------------------------------------------------ cast_transpose_dbias


def cast_transpose_dbias_reference(
    g: jax.Array, scale: jax.Array, fp8_dtype: Any
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """Pure-jnp reference of :func:`cast_transpose_dbias`: :func:`cast_transpose_reference`
    and the float32 column sums of ``g``."""
    q, q_t, scale_inv, amax = cast_transpose_reference(g, scale, fp8_dtype)
    return q, q_t, scale_inv, amax, jnp.sum(g.astype(jnp.float32), axis=-2)


DBIAS_TILE_ROWS = 128
"""Rows per tile of the kernels' dbias order (``plan::kBigTile`` in cpp/common/launch_plan.h)."""


def dbias_workspace(g: jax.Array, cols: int) -> jax.ShapeDtypeStruct:
    """The kernels' dbias workspace for ``g[..., m, :]`` summed over ``m`` into ``cols`` columns:
    float32 ``[..., row_tiles, cols]``, one partial sum per 128-row tile and column."""
    m = g.shape[-2]
    return jax.ShapeDtypeStruct((*g.shape[:-2], -(-m // DBIAS_TILE_ROWS), cols), jnp.float32)


_CAST_TRANSPOSE_DBIAS = opdef.OpDef(
    name="cast_transpose_dbias",
    family="cast",
    target="fp8jax_cast_transpose_dbias",
    reference=cast_transpose_dbias_reference,
    outputs=lambda g, scale, *, fp8_dtype: (
        opdef.like(g, fp8_dtype),
        opdef.like(g, fp8_dtype, transpose=True),
        opdef.like(scale, jnp.float32),
        opdef.like(scale, jnp.float32),
        opdef.like(g, jnp.float32, dims=(-1,), core=2),
    ),
    factors=lambda g_ndim, scale_ndim: (
        ["m n", "s" * scale_ndim],
        ["m n", "n m", "s" * scale_ndim, "s" * scale_ndim, "n"],
    ),
    max_over={3: 0},  # amax: the max over all of g
    sum_over={4: 0},  # dbias: the sum over g's rows, psum-ed over the axes that split them
    workspace=lambda g, scale, *, fp8_dtype: dbias_workspace(g, g.shape[-1]),
)


def cast_transpose_dbias(
    g: jax.Array,
    scale: jax.Array,
    fp8_dtype: Any,
    *,
    amax_reduction: str = "split",
    implementation: str | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """:func:`cast_transpose` of a gradient ``g[m, n]`` plus its bias gradient, in one pass.

    Returns ``(q, q_t, scale_inv, amax, dbias)``: the first four exactly as
    :func:`cast_transpose` returns them (bit for bit), and ``dbias``, float32 ``[n]``, the
    column sums of ``g`` (each element converted to float32 first). The kernels add in a fixed
    order that does not depend on the number of threads or blocks (docs/numerics.md), so
    repeated runs give the same bits; the ``"xla"`` implementation's order is XLA's.

    Args:
      g: float32, bfloat16 or float16, shape ``[m, n]`` (:func:`jax.vmap` adds leading dims).
      scale, fp8_dtype, amax_reduction, implementation: as for :func:`cast_transpose`.

    Under :func:`jax.jit` on a mesh ``dbias`` is split like ``g``'s columns and summed with
    one ``psum`` over the mesh axes that split ``g``'s rows.
    """
    rank = (lambda n: n == 2, "rank 2 ([m, n])")
    return _validated_call(
        _CAST_TRANSPOSE_DBIAS, "g", g, rank, scale, fp8_dtype, amax_reduction, implementation
    )


# ------------------------------------------------------- grouped cast_transpose_dbias


def grouped_cast_transpose_dbias_reference(
    g: jax.Array, scale: jax.Array, fp8_dtype: Any
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """Pure-jnp reference of :func:`grouped_cast_transpose_dbias` for ``g[m, k, n]``."""
    q, scale_inv, amax = quantize_reference(g, scale, fp8_dtype)
    dbias = jnp.sum(g.astype(jnp.float32), axis=-3)
    return q, jnp.moveaxis(q, -3, -1), scale_inv, amax, dbias


def _grouped_view(g, scale, **_):
    return g.reshape(*g.shape[:-2], g.shape[-2] * g.shape[-1]), scale


def _grouped_unview(operands, results, **_):
    g = operands[0]
    *lead, m, k, n = g.shape
    q, q_t, scale_inv, amax, dbias = results
    return q.reshape(g.shape), q_t.reshape(*lead, k, n, m), scale_inv, amax, dbias.reshape(
        *lead, k, n)  # fmt: skip


_GROUPED_CAST_TRANSPOSE_DBIAS = opdef.OpDef(
    name="grouped_cast_transpose_dbias",
    family="cast",
    target="fp8jax_cast_transpose_dbias",  # the 2-D kernel, on each device's [m, k * n] view
    reference=grouped_cast_transpose_dbias_reference,
    outputs=_CAST_TRANSPOSE_DBIAS.outputs,
    factors=lambda g_ndim, scale_ndim: (
        ["m k n", "s" * scale_ndim],
        ["m k n", "k n m", "s" * scale_ndim, "s" * scale_ndim, "k n"],
    ),
    max_over={3: 0},
    sum_over={4: 0},
    need_replication=("k",),
    workspace=_CAST_TRANSPOSE_DBIAS.workspace,
    view=_grouped_view,
    unview=_grouped_unview,
)


def grouped_cast_transpose_dbias(
    g: jax.Array,
    scale: jax.Array,
    fp8_dtype: Any,
    *,
    amax_reduction: str = "split",
    implementation: str | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, jax.Array]:
    """:func:`cast_transpose_dbias` of a gradient ``g[m, k, n]`` with a small group dim ``k``
    (the fused QKV projection's ``k = 3``): ``(q [m, k, n], q_t [k, n, m], scale_inv, amax,
    dbias [k, n])``, the same bits as :func:`cast_transpose_dbias` of ``g.reshape(m, k * n)``
    reshaped back. On a mesh ``n`` may be split (tensor parallelism) without a gather: each
    device runs the 2-D kernel on its own block's ``[m, k * n_local]`` view (``k`` is never
    split); ``dbias`` is summed over the axes that split ``m``.
    """
    rank = (lambda n: n == 3, "rank 3 ([m, k, n])")
    return _validated_call(
        _GROUPED_CAST_TRANSPOSE_DBIAS, "g", g, rank, scale, fp8_dtype, amax_reduction,
        implementation,
    )  # fmt: skip


# ------------------------------------------------------------------ transpose


def transpose_reference(x: jax.Array) -> jax.Array:
    """Pure-jnp reference of :func:`transpose`: on the codes' bits (XLA:CPU moves FP8 values
    through float32, which changes NaN codes)."""
    bits = jax.lax.bitcast_convert_type(x, jnp.uint8)
    return jax.lax.bitcast_convert_type(jnp.swapaxes(bits, -1, -2), x.dtype)


_TRANSPOSE = opdef.OpDef(
    name="transpose",
    family="cast",
    target="fp8jax_transpose",
    reference=transpose_reference,
    outputs=lambda x: (opdef.like(x, x.dtype, transpose=True),),
    factors=lambda x_ndim: (
        [f"{opdef.lead(x_ndim - 2)} m n"],
        [f"{opdef.lead(x_ndim - 2)} n m"],
    ),
)

_ONE_BYTE = tuple(jnp.dtype(d) for d in (jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.uint8))


def transpose(x: jax.Array, *, implementation: str | None = None) -> jax.Array:
    """The last two dims of FP8 codes (or their ``uint8`` bits) swapped: a GEMM's K-major
    operand from a row-major tensor already cast, e.g. a mixture of experts' wgrad operands,
    whose scales are per expert (so no per-tensor :func:`cast_transpose` makes them). On CUDA
    a tiled kernel moving 4-byte words where the dims allow; XLA's own transposes of such codes
    measured a third of a copy's bandwidth on an H100 (docs/performance.md).

    Args:
      x: rank >= 2, ``float8_e4m3fn``, ``float8_e5m2`` or ``uint8``.
      implementation: ``"kernel"`` or ``"xla"`` (:func:`transpose_reference`); default: the
        enclosing :func:`fp8jax.ops.implementation` choice for ``"cast"``.

    Returns:
      ``x.shape[:-2] + (x.shape[-1], x.shape[-2])``, ``x``'s dtype.
    """
    x = checks.array_arg("transpose", "x", x)
    if jnp.dtype(x.dtype) not in _ONE_BYTE:
        raise TypeError(
            f"transpose: x must be float8_e4m3fn, float8_e5m2 or uint8 codes, got {x.dtype}"
        )
    if x.ndim < 2:
        raise ValueError(f"transpose: x must have rank >= 2 to be transposed, got shape {x.shape}")
    return _TRANSPOSE(x, implementation=implementation)[0]
