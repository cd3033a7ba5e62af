"""Block-scaled FP8: one scale per block of a tensor instead of one per tensor (issue 21).

Two families, both with TransformerEngine's scale rules (docs/numerics.md, "Block scaling"):

- ``Float8BlockScaling`` (DeepSeek-V3's recipe): 1 x 128 blocks (128 consecutive elements of a
  row, along the contraction dim) for activations and gradients, 128 x 128 blocks for weights;
  float32 scales ``fp8_max / amax``, by default rounded down to a power of two.
- MXFP8: 1 x 32 blocks with E8M0 (power-of-two) scales, ``2**ceil(log2(amax / fp8_max))``.

This module is the ``jnp`` definition of their numerics: the block amax, the scale rules, the
block quantization in both layouts (a 1 x 128 tensor's transposed copy is quantized again from
the high-precision values along the other dim; a 128 x 128 tensor's is a transpose of its
codes and of its scale grid) and the block-scaled GEMM (dequantize per block, float32
accumulation). The casts are also ops (``block_quantize``, ``block_cast_transpose``): CPU and
CUDA kernels bit-identical to :func:`block_quantize_reference` and
:func:`block_cast_transpose_reference`, with vmap, the ``"cast"`` family's kernel/XLA switch and
a sharding rule (each device casts its part; a split dim must hold whole blocks on each device).

Ragged edges: a dim need not be a multiple of the block. The last block along it is partial;
its amax is taken over the elements that exist (the same as zero padding), and the scale grid
has ``ceil(dim / block)`` entries along it.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fp8jax.ops.base import checks, opdef, partition
from fp8jax.ops.casts.quantize import SPECIAL_CODES, to_fp8
from fp8jax.recipe import fp8_max

__all__ = [
    "block_cast_transpose",
    "block_cast_transpose_reference",
    "block_dequantize",
    "block_quantize",
    "block_quantize_reference",
    "block_scaled_matmul",
    "mxfp8_cast_transpose",
    "mxfp8_quantize",
]

#: 128 consecutive elements of a row: Float8BlockScaling's activations and gradients.
BLOCK_1D: tuple[int, int] = (1, 128)
#: 128 x 128 tiles: Float8BlockScaling's weights.
BLOCK_2D: tuple[int, int] = (128, 128)
#: 32 consecutive elements of a row, E8M0 scales: MXFP8.
MXFP8_BLOCK: tuple[int, int] = (1, 32)

_F32_MAX = np.float32(np.finfo(np.float32).max)


def check_block(owner: str, block: Any) -> tuple[int, int]:
    ok = (
        isinstance(block, tuple)
        and len(block) == 2
        and all(isinstance(b, (int, np.integer)) and not isinstance(b, bool) for b in block)
        and all(b >= 1 for b in block)
    )
    if not ok:
        raise ValueError(
            f"{owner}: block must be a pair of positive ints (rows, cols), got {block!r}"
        )
    return int(block[0]), int(block[1])


def _check_rank(owner: str, x: Any, block: tuple[int, int]) -> None:
    """A cast takes any rank >= 1 with 1-row blocks, rank >= 2 (leading dims: separate
    matrices) with taller blocks."""
    need = 1 if block[0] == 1 else 2
    if jnp.ndim(x) < need:
        raise ValueError(
            f"{owner}: x must have at least {need} dims for {block[0]} x {block[1]} blocks, got "
            f"shape {jnp.shape(x)}"
        )


def _as_matrix(owner: str, x: jax.Array, block: tuple[int, int]) -> jax.Array:
    """``x`` as the 2-D matrix its blocks tile: 1-row blocks see every leading dim as rows;
    taller blocks need a matrix."""
    if jnp.ndim(x) < 1:
        raise ValueError(f"{owner}: x must have at least one dim, got a scalar")
    if block[0] == 1:
        return jnp.reshape(x, (-1, jnp.shape(x)[-1]))
    if jnp.ndim(x) != 2:
        raise ValueError(
            f"{owner}: x must be a matrix for {block[0]} x {block[1]} blocks, got shape "
            f"{jnp.shape(x)}"
        )
    return x


def _grid(shape: tuple[int, int], block: tuple[int, int]) -> tuple[int, int]:
    return -(-shape[0] // block[0]), -(-shape[1] // block[1])


def block_amax(x: jax.Array, block: tuple[int, int]) -> jax.Array:
    """The amax of each ``block`` of matrix ``x``: float32 ``[ceil(rows / block[0]),
    ceil(cols / block[1])]``. NaNs are left out (as TransformerEngine's ``fmaxf`` reduction
    does: one NaN does not decide its block's scale); an inf makes the amax inf."""
    block = check_block("block_amax", block)
    x = _as_matrix("block_amax", x, block)
    mag = jnp.abs(x.astype(jnp.float32))
    mag = jnp.where(jnp.isnan(mag), jnp.float32(0), mag)
    (r, c), (gr, gc) = mag.shape, _grid(mag.shape, block)
    mag = jnp.pad(mag, ((0, gr * block[0] - r), (0, gc * block[1] - c)))
    return jnp.max(mag.reshape(gr, block[0], gc, block[1]), axis=(1, 3), initial=jnp.float32(0))


def block_scale(
    amax: jax.Array,
    fp8_dtype: Any,
    *,
    power_2_scale: bool = True,
    amax_epsilon: float = 0.0,
    input_dtype: Any = jnp.float32,
) -> jax.Array:
    """Float8BlockScaling's scale from a block amax (TransformerEngine's rule):

    1. ``amax = max(amax, amax_epsilon)``;
    2. an amax of 0, inf or NaN gives scale 1, and so does a subnormal one (below float32's
       smallest normal: fp8jax's rule, the same on every backend, where TE's GPU kernels would
       divide by it);
    3. ``scale = fp8_max / amax`` in float32 (round to nearest); an overflow to inf becomes the
       largest finite value of ``input_dtype``;
    4. with ``power_2_scale``, the scale keeps only its exponent: ``2**floor(log2(scale))``.

    The inverse scale stored beside the codes is ``1 / scale`` (exact for a power of two).
    """
    amax = jnp.asarray(amax, jnp.float32)
    amax = jnp.where(amax < np.float32(amax_epsilon), np.float32(amax_epsilon), amax)
    scale = np.float32(fp8_max(fp8_dtype)) / amax
    scale = jnp.where(jnp.isinf(scale), np.float32(jnp.finfo(input_dtype).max), scale)
    if power_2_scale:
        bits = jax.lax.bitcast_convert_type(scale, jnp.uint32) & jnp.uint32(0xFF800000)
        scale = jax.lax.bitcast_convert_type(bits, jnp.float32)
    tiny = amax < np.float32(np.finfo(np.float32).smallest_normal)
    special = tiny | jnp.isinf(amax) | jnp.isnan(amax)
    return jnp.where(special, jnp.float32(1), scale)


def e8m0_exponent(amax: jax.Array, fp8_dtype: Any) -> jax.Array:
    """MXFP8's scale from a block amax: the biased E8M0 exponent ``e`` (``uint8``; the scale is
    ``2**(e - 127)``) of ``v = amax * (1 / fp8_max)`` (float32 product) rounded up to a power of
    two, ``clip(ceil(log2(v)) + 127, 0, 254)``. NaN gives 255 (E8M0's NaN), inf 254, and an
    amax of 0 or below float32's smallest normal 0. This is TransformerEngine's
    ``float_to_e8m0`` and cuBLAS's documented rule, except where ``v`` is subnormal: there ``v``
    is kept to 24 bits (computed as ``amax * (2**64 / fp8_max)``, so XLA:CPU's flush of
    subnormals does not zero it) where TE's GPU product would round it to fewer. XLA's own
    conversion to ``float8_e8m0fnu`` rounds to nearest instead, so it is not used."""
    rcp = np.float32(1.0) / np.float32(fp8_max(fp8_dtype))
    amax = jnp.asarray(amax, jnp.float32)
    small = amax < np.float32(1.0)  # v may be subnormal: compute it 2**64 higher
    w = amax * jnp.where(small, rcp * np.float32(2.0**64), rcp)
    bits = jax.lax.bitcast_convert_type(w, jnp.uint32)
    e = ((bits >> 23) & jnp.uint32(0xFF)).astype(jnp.int32)
    m = bits & jnp.uint32(0x7FFFFF)
    # ceil(log2(v)) + 127 for a normal w: its biased exponent, + 1 if any mantissa bit is set
    biased = e + (m > 0).astype(jnp.int32) - jnp.where(small, 64, 0)
    out = jnp.clip(biased, 0, 254)
    out = jnp.where(amax < np.float32(np.finfo(np.float32).smallest_normal), 0, out)
    out = jnp.where(jnp.isinf(amax), 254, out)
    out = jnp.where(jnp.isnan(amax), 255, out)
    return out.astype(jnp.uint8)


def _pow2(k: jax.Array) -> jax.Array:
    """``2**k`` (int32 ``k`` in [-126, 127]) as float32, from its bits."""
    return jax.lax.bitcast_convert_type(((k + 127) << 23).astype(jnp.uint32), jnp.float32)


def _expand(grid: jax.Array, block: tuple[int, int], shape: tuple[int, int]) -> jax.Array:
    """A per-block array broadcast to every element of a ``shape`` matrix."""
    (gr, gc), (br, bc) = grid.shape, block
    full = jnp.broadcast_to(grid[:, None, :, None], (gr, br, gc, bc))
    # under explicit sharding each merged dim keeps the grid dim's split (whole blocks a device)
    spec = jax.typeof(grid).sharding.spec if partition.explicit_mesh() else None
    full = jax.lax.reshape(full, (gr * br, gc * bc), out_sharding=spec)
    return full[: shape[0], : shape[1]]


# Scale modes, as the kernels' "scale_mode" attribute (common/block_scale.h).
SCALE_F32, SCALE_POW2, SCALE_E8M0 = 0, 1, 2


def _quantize_matrix(m, fp8_dtype, block, scale_mode, amax_epsilon):
    """``(q, scale grid)`` of matrix ``m``: float32 inverse scales, or E8M0 scales."""
    amax = block_amax(m, block)
    if scale_mode == SCALE_E8M0:
        e = e8m0_exponent(amax, fp8_dtype)
        # The multiplier 2**(127 - e) as two normal factors (2**-127, for e = 254, is subnormal,
        # which XLA:CPU flushes): each product by a power of two is exact unless it underflows.
        k = 127 - e.astype(jnp.int32)
        lo = k // 2
        xf = m.astype(jnp.float32) * _expand(_pow2(lo), block, m.shape)
        q = to_fp8(xf, _expand(_pow2(k - lo), block, m.shape), fp8_dtype)
        # A NaN scale (e = 255) makes its block's codes the format's NaN. Selected as bits: a
        # select on FP8 values goes through float32 on XLA:CPU, which turns E5M2's NaN 0x7E
        # (and -NaN) into 0x7F.
        bits = jax.lax.bitcast_convert_type(q, jnp.uint8)
        nan = np.uint8(SPECIAL_CODES[jnp.dtype(fp8_dtype)][1])
        bits = jnp.where(_expand(e == 0xFF, block, m.shape), nan, bits)
        q = jax.lax.bitcast_convert_type(bits, q.dtype)
        return q, jax.lax.bitcast_convert_type(e, jnp.float8_e8m0fnu)
    scale = block_scale(
        amax, fp8_dtype, power_2_scale=scale_mode == SCALE_POW2, amax_epsilon=amax_epsilon,
        input_dtype=m.dtype,
    )  # fmt: skip
    q = to_fp8(m.astype(jnp.float32), _expand(scale, block, m.shape), fp8_dtype)
    return q, (np.float32(1) / scale).astype(jnp.float32)


def grid_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, ...]:
    """The scale grid of an array of ``shape`` (its leading dims are separate matrices; a
    vector is one row)."""
    if len(shape) == 1:
        return (-(-shape[0] // block[1]),)
    return (*shape[:-2], *_grid(shape[-2:], block))


def block_quantize_reference(
    x: jax.Array, *, fp8_dtype: Any, block: tuple[int, int], scale_mode: int,
    amax_epsilon: float,
) -> tuple[jax.Array, jax.Array]:  # fmt: skip
    """Pure-jnp reference of the block-scaled cast of ``x`` [..., M, K] (each leading index a
    separate matrix; a vector is one row): ``(q, scale)``, ``scale`` the float32 inverse scales
    (``scale_mode`` 0: ``fp8_max / amax``, 1: that rounded down to a power of two) or the E8M0
    scales (2), shaped ``[..., ceil(M / block[0]), ceil(K / block[1])]``."""
    shape = jnp.shape(x)
    m = jnp.reshape(x, (1, 1, -1) if len(shape) == 1 else (-1, *shape[-2:]))
    q, s = jax.vmap(lambda a: _quantize_matrix(a, fp8_dtype, block, scale_mode, amax_epsilon))(m)
    return q.reshape(shape), s.reshape(grid_shape(shape, block))


def block_cast_transpose_reference(
    x: jax.Array, *, fp8_dtype: Any, block: tuple[int, int], scale_mode: int,
    amax_epsilon: float,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:  # fmt: skip
    """Pure-jnp reference of the both-layouts cast of ``x`` [..., M, K]: ``(q, scale, q_t,
    scale_t)``, ``(q_t, scale_t)`` the cast of ``x``'s transpose [..., K, M] with the same
    blocks (for square blocks, the transposes of ``q`` and ``scale``)."""
    kw = dict(fp8_dtype=fp8_dtype, block=block, scale_mode=scale_mode, amax_epsilon=amax_epsilon)
    return (*block_quantize_reference(x, **kw),
            *block_quantize_reference(jnp.swapaxes(x, -1, -2), **kw))  # fmt: skip


def block_attrs(*, fp8_dtype, block, scale_mode, amax_epsilon):
    del fp8_dtype
    return {
        "block_rows": np.int64(block[0]),
        "block_cols": np.int64(block[1]),
        "scale_mode": np.int64(scale_mode),
        "epsilon": np.float32(amax_epsilon),
    }


def scale_dtype(scale_mode: int) -> Any:
    return jnp.float8_e8m0fnu if scale_mode == SCALE_E8M0 else jnp.float32


def _quantize_outputs(x, *, fp8_dtype, block, scale_mode, amax_epsilon):
    del amax_epsilon
    dims = (-1,) if x.ndim == 1 else (-2, -1)
    grid = grid_shape(x.shape, block)
    return (opdef.like(x, fp8_dtype),
            opdef.like(x, scale_dtype(scale_mode), shape=grid, dims=dims))  # fmt: skip


def cast_transpose_outputs(x, *, fp8_dtype, block, scale_mode, amax_epsilon):
    del amax_epsilon
    grid_t = grid_shape((*x.shape[:-2], x.shape[-1], x.shape[-2]), block)
    kw = dict(fp8_dtype=fp8_dtype, block=block, scale_mode=scale_mode, amax_epsilon=0.0)
    return (
        *_quantize_outputs(x, **kw),
        opdef.like(x, fp8_dtype, transpose=True),
        opdef.like(x, scale_dtype(scale_mode), shape=grid_t, dims=(-1, -2)),
    )


def _quantize_factors(x_ndim: int) -> tuple[list[str], list[str]]:
    if x_ndim == 1:
        return ["k"], ["k", "kb"]
    x = f"{opdef.lead(x_ndim - 2)} m k"
    return [x], [x, f"{opdef.lead(x_ndim - 2)} mb kb"]


def cast_transpose_factors(x_ndim: int) -> tuple[list[str], list[str]]:
    lead = opdef.lead(x_ndim - 2)
    x = f"{lead} m k"
    return [x], [x, f"{lead} mb kb", f"{lead} k m", f"{lead} kt mt"]


def _quantize_coarse(*, block, **_):
    return {"mb": ("m", block[0]), "kb": ("k", block[1])}


def cast_transpose_coarse(*, block, **_):
    # q_t's grid counts x's K in blocks of block[0] and x's M in blocks of block[1]
    return {**_quantize_coarse(block=block), "kt": ("k", block[0]), "mt": ("m", block[1])}


# The block-scaled casts as ops (fp8jax.ops.base.opdef): their kernels, vmap, the kernel/XLA switch
# ("cast" family), and sharding: every dim may be split, a scale grid's dims like the dims whose
# blocks they count, provided each device holds whole blocks (else a ValueError). No collective.
_BLOCK_QUANTIZE = opdef.OpDef(
    name="block_quantize",
    family="cast",
    target="fp8jax_block_quantize",
    reference=block_quantize_reference,
    outputs=_quantize_outputs,
    factors=_quantize_factors,
    attrs=block_attrs,
    coarse=_quantize_coarse,
)
_BLOCK_CAST_TRANSPOSE = opdef.OpDef(
    name="block_cast_transpose",
    family="cast",
    target="fp8jax_block_cast_transpose",
    reference=block_cast_transpose_reference,
    outputs=cast_transpose_outputs,
    factors=cast_transpose_factors,
    attrs=block_attrs,
    coarse=cast_transpose_coarse,
)


def kernel_block(block: tuple[int, int]) -> bool:
    """Whether the block-scaled cast kernels take ``block``: both dims powers of two up to 128,
    at least 32 elements (every block the recipes use). Other blocks run the reference."""
    return all(0 < b <= 128 and b & (b - 1) == 0 for b in block) and block[0] * block[1] >= 32


def run_cast(op, owner, x, fp8_dtype, block, scale_mode, amax_epsilon, implementation, arg="x",
         extra_operands=(), **extra):  # fmt: skip
    """Checks the arguments of a block-scaled cast op and calls it on ``x`` and
    ``extra_operands`` (``extra``: the op's other static parameters)."""
    x = checks.wide_array(owner, arg, x)
    dt = checks.fp8_dtype_arg(owner, "fp8_dtype", fp8_dtype)
    eps = float(amax_epsilon)
    if not (np.isfinite(eps) and eps >= 0):
        raise ValueError(f"{owner}: amax_epsilon must be a finite float >= 0, got {amax_epsilon!r}")
    if not kernel_block(block):
        if implementation == "kernel":
            raise ValueError(
                f"{owner}: the kernel takes blocks whose dims are powers of two up to 128, of "
                f"at least 32 elements; got block {block} (use implementation='xla')"
            )
        implementation = "xla"
    return op(
        x, *extra_operands, fp8_dtype=dt, block=block, scale_mode=scale_mode, amax_epsilon=eps,
        implementation=implementation, **extra,
    )  # fmt: skip


def block_quantize(
    x: jax.Array,
    fp8_dtype: Any,
    block: tuple[int, int] = BLOCK_1D,
    *,
    power_2_scale: bool = True,
    amax_epsilon: float = 0.0,
    implementation: str | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Float8BlockScaling quantization of ``x``: ``(q, scale_inv)``.

    ``q = saturate(round(x * scale))`` with each element's block scale (:func:`block_scale`
    of :func:`block_amax`), in ``x``'s shape; ``scale_inv`` float32, one per block. With
    1-row blocks (``BLOCK_1D``) ``x`` may have any rank >= 1 and ``scale_inv`` has shape
    ``x.shape[:-1] + (ceil(x.shape[-1] / block[1]),)``; otherwise ``x`` has rank >= 2, its
    leading dims index separate matrices, and ``scale_inv`` is each matrix's block grid,
    ``[..., ceil(M / block[0]), ceil(K / block[1])]``. ``implementation``: ``"kernel"`` or ``"xla"``
    (:func:`block_quantize_reference`), as for :func:`fp8jax.ops.quantize` (family
    ``"cast"``); blocks the kernel does not take (:func:`kernel_block`) run the reference.

    >>> import jax.numpy as jnp
    >>> q, sinv = block_quantize(jnp.arange(256.0).reshape(1, 256), jnp.float8_e4m3fn)
    >>> sinv  # amax 127 -> scale 2**floor(log2(448 / 127)) = 2; amax 255 -> 1
    Array([[0.5, 1. ]], dtype=float32)
    """
    block = check_block("block_quantize", block)
    _check_rank("block_quantize", x, block)
    mode = SCALE_POW2 if power_2_scale else SCALE_F32
    return run_cast(_BLOCK_QUANTIZE, "block_quantize", x, fp8_dtype, block, mode, amax_epsilon,
                implementation)  # fmt: skip


def mxfp8_quantize(
    x: jax.Array,
    fp8_dtype: Any = jnp.float8_e4m3fn,
    block: tuple[int, int] = MXFP8_BLOCK,
    *,
    implementation: str | None = None,
) -> tuple[jax.Array, jax.Array]:
    """MXFP8 quantization of ``x``: ``(q, scale)`` with ``scale`` of dtype ``float8_e8m0fnu``,
    one per block (:func:`e8m0_exponent` of :func:`block_amax`) and
    ``q = saturate(round(x / scale))``; shapes as :func:`block_quantize`'s (``(32, 32)`` blocks:
    MXFP8BlockScaling's 2-D weight option); ``implementation`` as there.

    >>> import jax.numpy as jnp
    >>> q, s = mxfp8_quantize(jnp.full((1, 32), 3.0))
    >>> s.astype(jnp.float32)  # 3 / 448 rounded up to a power of two
    Array([[0.0078125]], dtype=float32)
    """
    block = check_block("mxfp8_quantize", block)
    _check_rank("mxfp8_quantize", x, block)
    return run_cast(_BLOCK_QUANTIZE, "mxfp8_quantize", x, fp8_dtype, block, SCALE_E8M0, 0.0,
                implementation)  # fmt: skip


def _scale_values(scale: jax.Array) -> jax.Array:
    """Float32 values of an inverse-scale grid (float32, or E8M0 from its bits)."""
    if scale.dtype == jnp.float8_e8m0fnu:
        e = jax.lax.bitcast_convert_type(scale, jnp.uint8).astype(jnp.uint32)
        bits = jnp.where(e == 0, jnp.uint32(0x00400000), e << 23)
        value = jax.lax.bitcast_convert_type(bits, jnp.float32)
        return jnp.where(e == 0xFF, jnp.float32(jnp.nan), value)
    return scale.astype(jnp.float32)


def block_dequantize(
    q: jax.Array, scale_inv: jax.Array, block: tuple[int, int], out_dtype: Any = jnp.float32
) -> jax.Array:
    """``q * scale_inv`` per block, in float32, then ``out_dtype``: the inverse of
    :func:`block_quantize` and :func:`mxfp8_quantize` (``scale_inv`` float32 or E8M0).
    An inverse scale below float32's normal range (a block amax under about 1e-36) dequantizes
    to 0 on XLA:CPU, which flushes subnormal products."""
    block = check_block("block_dequantize", block)
    _as_matrix("block_dequantize", q, block)
    return _block_dequantize(q, scale_inv, block, jnp.dtype(out_dtype))


@functools.partial(jax.jit, static_argnums=(2, 3))
def _block_dequantize(q, scale_inv, block, out_dtype):
    m = _as_matrix("block_dequantize", q, block)
    grid = _grid(m.shape, block)
    s = _scale_values(jnp.reshape(scale_inv, grid))
    out = m.astype(jnp.float32) * _expand(s, block, m.shape)
    return out.reshape(jnp.shape(q)).astype(out_dtype)


def _both_layouts(owner, x, fp8_dtype, block, scale_mode, amax_epsilon, implementation):
    block = check_block(owner, block)
    if jnp.ndim(x) < 2:
        raise ValueError(f"{owner}: x must have at least 2 dims, got shape {jnp.shape(x)}")
    if block[0] != 1 and block[0] != block[1]:
        raise ValueError(f"{owner}: block must be 1 x n or square, got {block}")
    return run_cast(_BLOCK_CAST_TRANSPOSE, owner, x, fp8_dtype, block, scale_mode, amax_epsilon,
                implementation)  # fmt: skip


def block_cast_transpose(
    x: jax.Array,
    fp8_dtype: Any,
    block: tuple[int, int] = BLOCK_1D,
    *,
    power_2_scale: bool = True,
    amax_epsilon: float = 0.0,
    implementation: str | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """``x`` [..., M, K] (leading dims: separate matrices) quantized for a GEMM in both
    layouts: ``(q, scale_inv, q_t, scale_inv_t)``, ``q`` [M, K] with blocks along K and ``q_t``
    [K, M] with blocks along M.
    1-row blocks: ``q_t`` is quantized again from ``x``'s high-precision values (its blocks
    run down ``x``'s columns), never transposed from ``q``; square blocks: ``q_t`` and
    ``scale_inv_t`` are the transposes of ``q`` and ``scale_inv``. One op (one read of ``x``
    per layout on a GPU); ``implementation`` as for :func:`block_quantize`."""
    mode = SCALE_POW2 if power_2_scale else SCALE_F32
    return _both_layouts("block_cast_transpose", x, fp8_dtype, block, mode, amax_epsilon,
                         implementation)  # fmt: skip


def mxfp8_cast_transpose(
    x: jax.Array,
    fp8_dtype: Any = jnp.float8_e4m3fn,
    block: tuple[int, int] = MXFP8_BLOCK,
    *,
    implementation: str | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """:func:`block_cast_transpose` for MXFP8: both layouts quantized from ``x`` (E8M0
    scales), or transposed for square (32 x 32) blocks."""
    return _both_layouts(
        "mxfp8_cast_transpose", x, fp8_dtype, block, SCALE_E8M0, 0.0, implementation
    )


def block_scaled_matmul(
    a_q: jax.Array,
    a_scale_inv: jax.Array,
    a_block: tuple[int, int],
    b_q: jax.Array,
    b_scale_inv: jax.Array,
    b_block: tuple[int, int],
    out_dtype: Any = jnp.float32,
) -> jax.Array:
    """The block-scaled GEMM ``a @ b.T`` of ``a_q`` [M, K] and ``b_q`` [N, K] (both K-major,
    as cuBLASLt's FP8 GEMM takes them), each with its blocks' inverse scales: every element
    dequantized with its block's scale in float32, products accumulated in float32
    (``precision=HIGHEST``), then ``out_dtype``. The blocks of both operands must tile K alike
    (the same block size along K), so that each 128-element slice of K has one scale per row
    of each operand, as the GPU applies them. Two 2-D (square) operands are refused, as
    cuBLASLt and TransformerEngine refuse them."""
    a_block = check_block("block_scaled_matmul", a_block)
    b_block = check_block("block_scaled_matmul", b_block)
    if jnp.ndim(a_q) != 2 or jnp.ndim(b_q) != 2 or jnp.shape(a_q)[1] != jnp.shape(b_q)[1]:
        raise ValueError(
            "block_scaled_matmul: a_q [M, K] and b_q [N, K] must be matrices with the same K, "
            f"got {jnp.shape(a_q)} and {jnp.shape(b_q)}"
        )
    if a_block[1] != b_block[1]:
        raise ValueError(
            f"block_scaled_matmul: a_block {a_block} and b_block {b_block} must have the same "
            "size along K"
        )
    if a_block[0] > 1 and b_block[0] > 1:
        raise ValueError(
            "block_scaled_matmul: both operands have 2-D blocks "
            f"(a_block {a_block}, b_block {b_block}); at most one may (as in cuBLASLt)"
        )
    a = block_dequantize(a_q, a_scale_inv, a_block)
    b = block_dequantize(b_q, b_scale_inv, b_block)
    # under explicit sharding, the output sharded as the GEMM's rule gives it (a split K summed)
    spec = partition.explicit_matmul_spec(a_q, b_q, b_rows_are_n=True) if (
        partition.explicit_mesh()) else None  # fmt: skip
    out = jnp.matmul(
        a, b.T, precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32,
        out_sharding=spec,
    )  # fmt: skip
    return out.astype(out_dtype)


#: cuBLASLt's scale modes (``cublasLtMatmulMatrixScale_t``) by the block they serve.
CUBLASLT_SCALE_MODES: dict[tuple[int, int], int] = {
    (1, 128): 4,  # VEC128_32F (sm_90)
    (128, 128): 5,  # BLK128x128_32F (sm_90)
    (1, 32): 2,  # VEC32_UE8M0 (MXFP8, sm_100 and later)
}


def _cublaslt_layout(mode: int, grid: jax.Array) -> jax.Array:
    """The compact scale grid (row-major, ``[rows or row tiles, K blocks]``) in cuBLASLt's flat
    layout (common/block_scale_layout.h, ScaleIndex and ScaleCount), by reshapes, transposes
    and zero padding only (no gather or scatter, so it traces to no constants)."""
    r, kb = grid.shape
    if mode == 4:  # outer-dim-major: scale (r, j) at j * rows + r
        return grid.T.reshape(-1)
    if mode == 5:  # K-major with a column stride rounded up to 4: (r, j) at r * kb4 + j
        return jnp.pad(grid, ((0, 0), (0, -(-kb // 4) * 4 - kb))).reshape(-1)
    # MXFP8: 128 x 4 tiles of 512 scales; in a tile, (r, j) at (r % 32) * 16 + (r % 128 // 32)
    # * 4 + j % 4; tiles row-major over (r // 128, j // 4)
    rt, kt = -(-r // 128), -(-kb // 4)
    if grid.dtype == jnp.float8_e8m0fnu:  # zero padding is the bits 0 (E8M0 has no zero)
        bits = jax.lax.bitcast_convert_type(grid, jnp.uint8)
        bits = jnp.pad(bits, ((0, rt * 128 - r), (0, kt * 4 - kb)))
        g = jax.lax.bitcast_convert_type(bits, jnp.float8_e8m0fnu)
    else:
        g = jnp.pad(grid, ((0, rt * 128 - r), (0, kt * 4 - kb)))
    return g.reshape(rt, 4, 32, kt, 4).transpose(0, 3, 2, 1, 4).reshape(-1)


def cublaslt_scales(scale: jax.Array, block: tuple[int, int], rows: int, k: int) -> jax.Array:
    """An operand's compact scale grid (as :func:`block_quantize` or :func:`mxfp8_quantize`
    return it, for a [rows, k] K-major operand) in the flat layout cuBLASLt's block-scaled GEMM
    reads: 1 x 128 blocks "outer-dim-major" (the rows of a K block contiguous; rows must be a
    multiple of 4), 128 x 128 tiles K-major with a column stride rounded up to 4, MXFP8's E8M0
    scales in 128 x 4 tiles of 512 bytes; padding is zero (for E8M0, the bits 0)."""
    block = check_block("cublaslt_scales", block)
    if block not in CUBLASLT_SCALE_MODES:
        raise ValueError(
            f"cublaslt_scales: block must be one of {list(CUBLASLT_SCALE_MODES)}, got {block}"
        )
    mode = CUBLASLT_SCALE_MODES[block]
    if mode == 4 and rows % 4:
        raise ValueError(f"cublaslt_scales: 1 x 128 block scales need rows % 4 == 0, got {rows}")
    grid = (-(-rows // block[0]), -(-k // block[1]))
    if tuple(scale.shape) != grid:
        raise ValueError(f"cublaslt_scales: scale must have shape {grid}, got {scale.shape}")
    return _cublaslt_layout(mode, scale)
