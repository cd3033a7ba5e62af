"""The FP8 casts of a mixture of experts' ragged operands: rows sorted by group (expert), with
``group_sizes [G]`` on the device (rows past their sum belong to no group).

Two granularities, one per recipe family:

- **One scale per group** (DelayedScaling, Float8CurrentScaling): :func:`grouped_quantize`
  casts each row with its group's scale and returns one amax per group, so each expert's tokens
  get the scale of their own magnitude (an expert that sees a few large tokens does not coarsen
  the others). Rows past the sum get the code 0 and stay out of every amax. Such a tensor's
  transposed copy (the wgrad's operand) is the transpose of its codes: each element keeps its
  scale.
- **Segment blocks** (Float8BlockScaling's 1 x 128, MXFP8's 1 x 32, along the ragged dim):
  the wgrad contracts over the tokens, so its operands ``[R, M]`` have blocks *along* the
  ragged dim. :func:`segment_block_quantize` restarts the blocks at each group's first column, so
  a block never mixes two experts' tokens: group ``g``'s columns ``[start_g, start_g + s_g)``
  are blocks ``b_g, b_g + 1, ...`` of ``width`` columns (the last one partial), ``b_g`` the
  count of blocks before it. The scale grid is ``[R, segment_grid_size(M, G, width)]``, the most
  blocks any sizes summing to at most ``M`` can need; unused entries are those of an all-zero
  block (1, or E8M0's 2**-127).

A segment-block cast is the ordinary block cast of a *padded layout* in which each group starts
at a multiple of ``width`` (:func:`segment_layout`): the columns are scattered there, cast with
:func:`~fp8jax.ops.block_quantize` or :func:`~fp8jax.ops.mxfp8_quantize` (kernel or XLA, as
chosen), and gathered back, so its numerics are exactly those of the block casts (a partial
block's amax over the elements that exist).
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fp8jax.ops.base import checks, opdef
from fp8jax.ops.block.block_scaling import block_dequantize, block_quantize, mxfp8_quantize
from fp8jax.ops.casts.quantize import to_fp8

__all__ = [
    "grouped_quantize",
    "grouped_quantize_reference",
    "segment_block_dequantize",
    "segment_block_quantize",
    "transpose_padded",
    "transpose_padded_reference",
]


def check_group_sizes(op: str, group_sizes: Any, groups: int | None = None) -> jax.Array:
    """``group_sizes`` as an int32 ``[G]`` array (``G == groups`` when given), else a
    TypeError/ValueError naming it. Concrete sizes are also checked for negative values (their
    sum is checked by the caller, which knows the rows)."""
    group_sizes = checks.array_arg(op, "group_sizes", group_sizes)
    if group_sizes.dtype != jnp.int32:
        raise TypeError(f"{op}: group_sizes must be int32, got dtype {group_sizes.dtype}")
    if group_sizes.ndim != 1 or group_sizes.shape[0] < 1:
        raise ValueError(
            f"{op}: group_sizes must be a non-empty vector [G], got shape {group_sizes.shape}"
        )
    if groups is not None and group_sizes.shape[0] != groups:
        raise ValueError(
            f"{op}: group_sizes must have one entry per group ({groups}), got shape "
            f"{group_sizes.shape}"
        )
    concrete = concrete_sizes(group_sizes)
    if concrete is not None and (concrete < 0).any():
        raise ValueError(f"{op}: group_sizes must be >= 0, got {concrete.tolist()}")
    return group_sizes


def concrete_sizes(group_sizes: jax.Array) -> np.ndarray | None:
    """The values of ``group_sizes`` when they are known while tracing, else ``None``."""
    try:
        return np.asarray(group_sizes)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def check_sum(op: str, group_sizes: jax.Array, rows: int, what: str) -> None:
    """Concrete ``group_sizes`` must sum to at most ``rows`` (ValueError naming them); traced
    ones cannot be checked while tracing and are clamped (:func:`clamped`), by the kernels as by
    the reference."""
    concrete = concrete_sizes(group_sizes)
    if concrete is not None and int(concrete.astype(np.int64).sum()) > rows:
        raise ValueError(
            f"{op}: group_sizes sum to {int(concrete.astype(np.int64).sum())}, more than the "
            f"{rows} {what}"
        )


def clamped(group_sizes: jax.Array, rows: int) -> jax.Array:
    """Sizes whose running sum never passes ``rows`` (negative sizes as 0): what the reference
    computes with, so that its result is defined for any input; the kernels clamp the sizes they
    read on the device alike (cpp/common/grouped_gemm.h), so no size makes them read or write
    out of bounds."""
    ends = jnp.minimum(jnp.cumsum(jnp.maximum(group_sizes, 0)), rows)
    return jnp.diff(ends, prepend=0).astype(jnp.int32)


def group_ids(group_sizes: jax.Array, rows: int) -> jax.Array:
    """int32 ``[rows]``: each row's group, ``G`` for the rows past the sum."""
    ends = jnp.cumsum(clamped(group_sizes, rows))
    return jnp.searchsorted(ends, jnp.arange(rows, dtype=jnp.int32), side="right").astype(jnp.int32)


def local_group_sizes(group_sizes: jax.Array, start: jax.Array, rows: int) -> jax.Array:
    """The sizes of the groups within rows ``[start, start + rows)`` of the global layout that
    ``group_sizes`` describes (how a device that holds those rows sees it)."""
    ends = jnp.cumsum(jnp.maximum(group_sizes, 0))
    begins = ends - jnp.maximum(group_sizes, 0)
    lo = jnp.clip(begins - start, 0, rows)
    hi = jnp.clip(ends - start, 0, rows)
    return (hi - lo).astype(jnp.int32)


def grouped_quantize_reference(
    x: jax.Array, group_sizes: jax.Array, scale: jax.Array, fp8_dtype: Any
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Pure-jnp definition of :func:`grouped_quantize`."""
    rows = x.shape[0]
    gid = group_ids(group_sizes, rows)
    g = scale.shape[0]
    row_scale = jnp.take(scale, gid, mode="fill", fill_value=1.0)
    shape = (rows,) + (1,) * (x.ndim - 1)
    # rows past the sum are zeroed before the cast (a select on the codes after it would go
    # through float32 on XLA:CPU, which changes E5M2's NaN code 0x7E into 0x7F)
    xf = jnp.where((gid < g).reshape(shape), x.astype(jnp.float32), jnp.float32(0))
    q = to_fp8(xf, row_scale.reshape(shape), fp8_dtype)
    # NaN-propagating amax per group: a max over the unsigned bits of |x| (NaN sorts above inf)
    mag = jax.lax.bitcast_convert_type(jnp.abs(x.astype(jnp.float32)), jnp.uint32)
    row_max = jnp.max(mag.reshape(rows, -1), axis=1, initial=jnp.uint32(0))
    group_max = jax.ops.segment_max(row_max, gid, num_segments=g)
    group_max = jnp.maximum(group_max, jnp.uint32(0))  # an empty group: 0
    amax = jax.lax.bitcast_convert_type(group_max, jnp.float32)
    return q, (1.0 / scale).astype(jnp.float32), amax


_grouped_quantize = jax.jit(grouped_quantize_reference, static_argnames="fp8_dtype")


def grouped_quantize(
    x: jax.Array, group_sizes: jax.Array, scale: jax.Array, fp8_dtype: Any
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Per-group FP8 cast of ``x [M, ...]`` (rows sorted by group): ``(q, scale_inv [G], amax
    [G])``.

    Row ``r`` of group ``g`` is ``saturate(round(x[r] * scale[g]))`` (the rounding, saturation and
    special values of :func:`~fp8jax.ops.quantize`); rows past the sum of ``group_sizes`` are
    the code 0. ``amax[g]`` is the NaN-propagating max of ``|x|`` over group ``g``'s rows (0 for an
    empty group), ``scale_inv = 1 / scale``. XLA fuses it with its neighbours (no kernel).

    >>> import jax.numpy as jnp
    >>> x = jnp.array([[1.0], [2.0], [4.0]])
    >>> q, sinv, amax = grouped_quantize(x, jnp.array([1, 1], jnp.int32),
    ...                                  jnp.array([1.0, 2.0]), jnp.float8_e4m3fn)
    >>> q.astype(jnp.float32).ravel().tolist(), amax.tolist()  # row 2: past the sum
    ([1.0, 4.0, 0.0], [1.0, 2.0])
    """
    op = "grouped_quantize"
    x = checks.wide_array(op, "x", x)
    if x.ndim < 1:
        raise ValueError(f"{op}: x must have a row dim, got a scalar")
    group_sizes = check_group_sizes(op, group_sizes)
    check_sum(op, group_sizes, x.shape[0], "rows of x")
    scale = checks.array_arg(op, "scale", scale)
    if scale.dtype != jnp.float32 or scale.shape != group_sizes.shape:
        raise ValueError(
            f"{op}: scale must be float32 {list(group_sizes.shape)} (one per group), got "
            f"{scale.dtype}{list(scale.shape)}"
        )
    dt = checks.fp8_dtype_arg(op, "fp8_dtype", fp8_dtype)
    return _grouped_quantize(x, group_sizes, scale, fp8_dtype=dt)


# ------------------------------------------------------------------ segment blocks


def segment_grid_size(rows: int, groups: int, width: int) -> int:
    """The most ``width``-blocks that ``groups`` segments summing to at most ``rows`` can
    need: ``ceil(rows / width) + groups - 1`` (each segment adds at most one partial block)."""
    return max(1, -(-rows // width) + groups - 1)


def segment_layout(group_sizes: jax.Array, rows: int, width: int) -> tuple[jax.Array, int]:
    """Where each of ``rows`` positions goes in the padded layout whose segments start at
    multiples of ``width``: int32 ``[rows]`` (``nb * width``, out of range, for the positions
    past the sum) and ``nb``, the padded layout's block count."""
    sizes = clamped(group_sizes, rows)
    g = sizes.shape[0]
    nb = segment_grid_size(rows, g, width)
    blocks = (sizes + width - 1) // width
    block_start = jnp.cumsum(blocks) - blocks
    begins = jnp.cumsum(sizes) - sizes
    gid = group_ids(sizes, rows)
    r = jnp.arange(rows, dtype=jnp.int32)
    pos = jnp.take(block_start, gid, mode="clip") * width + r - jnp.take(begins, gid, mode="clip")
    return jnp.where(gid < g, pos, nb * width).astype(jnp.int32), nb


def segment_padded(x: jax.Array, group_sizes: jax.Array, width: int) -> jax.Array:
    """``x [R, M]`` (any dtype, FP8 codes included) with its columns moved into the padded
    layout of :func:`segment_layout`: ``[R, nb * width]``, each group's columns starting at a
    multiple of ``width``, zeros between and after. A gather (each padded column reads its
    source), which XLA fuses into the producer's pass (a scatter would be a pass of its own)."""
    m = x.shape[1]
    sizes = clamped(group_sizes, m)
    nb = segment_grid_size(m, sizes.shape[0], width)
    blocks = (sizes + width - 1) // width
    starts = (jnp.cumsum(blocks) - blocks) * width  # each group's first padded column
    begins = jnp.cumsum(sizes) - sizes
    p = jnp.arange(nb * width, dtype=jnp.int32)
    # the group of a padded column: the last whose start is at or before it (an empty group
    # shares its start with the next one, which this picks)
    g = jnp.searchsorted(starts, p, side="right").astype(jnp.int32) - 1
    offset = p - jnp.take(starts, g)
    src = jnp.where(offset < jnp.take(sizes, g), jnp.take(begins, g) + offset, m)
    narrow = jnp.dtype(x.dtype).itemsize == 1
    bits = jax.lax.bitcast_convert_type(x, jnp.uint8) if narrow else x
    out = jnp.take(bits, src, axis=1, mode="fill", fill_value=0)
    return jax.lax.bitcast_convert_type(out, x.dtype) if narrow else out


def transpose_padded_reference(x: jax.Array, group_sizes: jax.Array, *, width: int) -> jax.Array:
    """Pure-jnp reference of :func:`transpose_padded`: :func:`segment_padded` of each matrix's
    transpose (leading dims matched with ``group_sizes``' rows)."""
    lead = x.shape[:-2]
    # on the codes' bits: XLA:CPU moves FP8 values through float32, which changes NaN codes
    xs = jax.lax.bitcast_convert_type(x, jnp.uint8).reshape(-1, *x.shape[-2:])
    gs = group_sizes.reshape(-1, group_sizes.shape[-1])
    out = jax.vmap(lambda m, g: segment_padded(m.T, g, width))(xs, gs)
    return jax.lax.bitcast_convert_type(out.reshape(*lead, *out.shape[-2:]), x.dtype)


def _transpose_padded_outputs(x, group_sizes, *, width):
    p = segment_grid_size(x.shape[-2], group_sizes.shape[-1], width) * width
    t = opdef.like(x, x.dtype, transpose=True)  # under explicit sharding: x's, swapped
    shape = (*x.shape[:-2], x.shape[-1], p)
    if t.sharding is None:
        return (jax.ShapeDtypeStruct(shape, x.dtype),)
    spec = jax.sharding.PartitionSpec(*t.sharding.spec[:-1], None)  # the padded dim: whole
    sharding = jax.sharding.NamedSharding(t.sharding.mesh, spec)
    return (jax.ShapeDtypeStruct(shape, x.dtype, sharding=sharding),)


_TRANSPOSE_PADDED = opdef.OpDef(
    name="transpose_padded",
    family="cast",
    target="fp8jax_transpose_padded",
    reference=transpose_padded_reference,
    outputs=_transpose_padded_outputs,
    factors=lambda x_ndim, g_ndim: (
        [f"{opdef.lead(x_ndim - 2)} m n", f"{opdef.lead(g_ndim - 1)} groups"],
        [f"{opdef.lead(x_ndim - 2)} n p"],
    ),
    attrs=lambda *, width: {"width": np.int64(width)},
    need_replication=("m", "groups"),
)

_ONE_BYTE = tuple(jnp.dtype(d) for d in (jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.uint8))


def transpose_padded(
    x: jax.Array, group_sizes: jax.Array, width: int, *, implementation: str | None = None
) -> jax.Array:
    """The transpose of FP8 codes ``x [..., M, N]`` whose rows are ragged groups, each group's
    columns of the result starting at a multiple of ``width`` (the padded layout of
    :func:`segment_layout`, zeros between and after): ``[..., N, segment_grid_size(M, G, width)
    * width]``. One pass, where a transpose and then :func:`segment_padded` would be two: the
    wgrad operands of the grouped GEMM on the tensor cores, whose groups must start at 16-byte
    aligned columns (:func:`~fp8jax.ops.grouped_gemm`'s ``padded``).

    Args:
      x: rank >= 2, ``float8_e4m3fn``, ``float8_e5m2`` or ``uint8``; its rows sorted by group.
      group_sizes: int32 ``[..., G]``, one row per matrix of ``x`` (``x``'s leading dims), each
        summing to at most ``M`` (clamped as :func:`clamped` clamps, when traced).
      width: the segment width, ``>= 1``.
      implementation: ``"kernel"`` or ``"xla"`` (:func:`transpose_padded_reference`); default:
        the enclosing :func:`fp8jax.ops.implementation` choice for ``"cast"``.

    >>> import jax.numpy as jnp
    >>> x = jnp.arange(3, dtype=jnp.uint8).reshape(3, 1)  # rows 0 | 1, 2
    >>> transpose_padded(x, jnp.array([1, 2], jnp.int32), 2).tolist()
    [[0, 0, 1, 2, 0, 0]]
    """
    op = "transpose_padded"
    x = checks.array_arg(op, "x", x)
    if jnp.dtype(x.dtype) not in _ONE_BYTE:
        raise TypeError(f"{op}: x must be float8_e4m3fn, float8_e5m2 or uint8 codes, got {x.dtype}")
    if x.ndim < 2:
        raise ValueError(f"{op}: x must have rank >= 2 to be transposed, got shape {x.shape}")
    if not isinstance(width, (int, np.integer)) or isinstance(width, bool) or width < 1:
        raise ValueError(f"{op}: width must be a positive int, got {width!r}")
    group_sizes = checks.array_arg(op, "group_sizes", group_sizes)
    if group_sizes.dtype != jnp.int32:
        raise TypeError(f"{op}: group_sizes must be int32, got dtype {group_sizes.dtype}")
    if group_sizes.ndim < 1 or group_sizes.shape[:-1] != x.shape[:-2] or group_sizes.shape[-1] < 1:
        raise ValueError(
            f"{op}: group_sizes must be [..., G] with x's leading dims {x.shape[:-2]}, G >= 1, got "
            f"shape {group_sizes.shape}"
        )
    if group_sizes.ndim == 1:
        check_group_sizes(op, group_sizes)
        check_sum(op, group_sizes, x.shape[-2], "rows of x")
    return _TRANSPOSE_PADDED(x, group_sizes, width=int(width), implementation=implementation)[0]


def _check_segment(op: str, x: Any, group_sizes: Any, block: Any) -> tuple[int, int]:
    if jnp.ndim(x) != 2:
        raise ValueError(f"{op}: x must be a matrix [R, M], got shape {jnp.shape(x)}")
    if not (isinstance(block, tuple) and len(block) == 2 and block[0] == 1 and block[1] >= 1):
        raise ValueError(f"{op}: block must be (1, width), got {block!r}")
    check_group_sizes(op, group_sizes)
    check_sum(op, group_sizes, jnp.shape(x)[1], "columns of x")
    return int(block[1]), jnp.shape(x)[1]


def _scatter(x: jax.Array, pos: jax.Array, width: int, nb: int) -> jax.Array:
    pad = jnp.zeros((x.shape[0], nb * width), x.dtype)
    return pad.at[:, pos].set(x, mode="drop", unique_indices=True)


def _gather(x: jax.Array, pos: jax.Array) -> jax.Array:
    return jnp.take(x, pos, axis=1, mode="fill", fill_value=0)


def segment_block_quantize(
    x: jax.Array,
    group_sizes: jax.Array,
    fp8_dtype: Any,
    block: tuple[int, int] = (1, 128),
    *,
    mxfp8: bool = False,
    power_2_scale: bool = True,
    amax_epsilon: float = 0.0,
    implementation: str | None = None,
    padded: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """Block-scaled cast of ``x [R, M]`` whose columns are ragged groups: ``(q [R, M], scale_inv
    [R, segment_grid_size(M, G, width)])`` with ``1 x width`` blocks that restart at each
    group's first column (see the module docstring). ``mxfp8``: E8M0 scales
    (:func:`~fp8jax.ops.mxfp8_quantize`'s rule), else Float8BlockScaling's float32 ones
    (``power_2_scale``, ``amax_epsilon``); ``implementation`` chooses the block cast's. Columns
    past the sum are the code 0. ``padded``: ``q`` in the padded layout the cast runs in,
    ``[R, segment_grid_size(M, G, width) * width]`` (each group's columns from its first block's,
    zeros between), as :func:`~fp8jax.ops.grouped_gemm` takes it with ``padded=width``.

    >>> import jax.numpy as jnp
    >>> x = jnp.array([[1.0, 8.0, 2.0]])  # groups [1.0] and [8.0, 2.0]: two blocks
    >>> q, s = segment_block_quantize(x, jnp.array([1, 2], jnp.int32), jnp.float8_e4m3fn)
    >>> s.tolist()  # 448 / 1 -> 256, 448 / 8 -> 32 (powers of two): their inverses
    [[0.00390625, 0.03125]]
    """
    op = "segment_block_quantize"
    width, m = _check_segment(op, x, group_sizes, block)
    x = checks.wide_array(op, "x", x)
    pos, nb = segment_layout(group_sizes, m, width)
    laid_out = _scatter(x, pos, width, nb)
    if mxfp8:
        q, s = mxfp8_quantize(laid_out, fp8_dtype, (1, width), implementation=implementation)
    else:
        q, s = block_quantize(
            laid_out,
            fp8_dtype,
            (1, width),
            power_2_scale=power_2_scale,
            amax_epsilon=amax_epsilon,
            implementation=implementation,
        )
    if padded:
        return q, s
    bits = _gather(jax.lax.bitcast_convert_type(q, jnp.uint8), pos)
    return jax.lax.bitcast_convert_type(bits, q.dtype), s


def segment_block_dequantize(
    q: jax.Array,
    scale_inv: jax.Array,
    group_sizes: jax.Array,
    block: tuple[int, int] = (1, 128),
    out_dtype: Any = jnp.float32,
) -> jax.Array:
    """The inverse of :func:`segment_block_quantize`: each element times its segment block's
    inverse scale, in float32, then ``out_dtype``; columns past the sum are 0."""
    op = "segment_block_dequantize"
    width, m = _check_segment(op, q, group_sizes, block)
    pos, nb = segment_layout(group_sizes, m, width)
    if scale_inv.shape != (q.shape[0], nb):
        raise ValueError(
            f"{op}: scale_inv must have shape {(q.shape[0], nb)}, got {tuple(scale_inv.shape)}"
        )
    bits = _scatter(jax.lax.bitcast_convert_type(q, jnp.uint8), pos, width, nb)
    padded = block_dequantize(jax.lax.bitcast_convert_type(bits, q.dtype), scale_inv, (1, width))
    return _gather(padded, pos).astype(out_dtype)
