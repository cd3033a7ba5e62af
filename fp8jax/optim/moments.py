"""Optimizer moments stored block-scaled in 8 bits: the formats, their round trip and their
sharding rule.

A moment of a parameter of shape ``[..., K]`` is kept as 8-bit codes of the same shape and one
float32 inverse scale per block of ``block`` consecutive elements along the last dim: a grid
``[..., ceil(K / block)]`` of the same rank as the parameter, so the parameter's
``PartitionSpec`` applies to both unchanged. Two formats (docs/numerics.md, "FP8 optimizer
state", has the measurements behind them):

- ``"e4m3"``, the first moment: FP8 E4M3 codes with Float8BlockScaling's scale rule,
  :func:`fp8jax.ops.block.block_scaling.block_scale`, with float32 (not power-of-two) scales, so the
  block's largest value comes back to float32 precision every step;
- ``"sqrt_uint8"``, the second moment: uint8 codes of ``sqrt(v)``, linear from 0 to the block's
  largest (code 255). An EMA with ``b2 = 0.999`` moves 0.1% a step: E4M3's 6-12% steps hold it
  still (rounding back to the same code), a linear code's 0.4-1.6% steps near the top of the
  block, where the second moments of a block lie, let it follow. The square root halves the
  range a block must span; a nonzero value never gets code 0 (a denominator rounded to 0 would
  make the next update ``m / eps``).

Non-finite values survive the round trip, as in a float32 moment: a block holding one is
flagged by the sign of its float32 inverse scale, takes its scale from its finite values, and
keeps its top codes for inf and NaN (:func:`quantize_moment`). Blocks of finite values are
unchanged by this.

Pure ``jnp``, left to XLA to fuse with the update. (XLA:CPU writes a parameter's float32
moments out between the update and the block maximum of the re-quantize, 8 bytes per element:
:func:`fp8jax.optim.scale_by_adam` updates one parameter at a time so that only one
parameter's are held; docs/performance.md, "Memory per parameter".)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding

from fp8jax.ops.base.partition import entry_axes, explicit_mesh, whole_blocks
from fp8jax.ops.block.block_scaling import block_scale

__all__ = [
    "BLOCK",
    "E4M3_FLAGGED_MAX",
    "E4M3_MAX",
    "MOMENT_FORMATS",
    "SQRT_FLAGGED_MAX",
    "SQRT_INF",
    "SQRT_NAN",
    "BlockScaled",
    "check_blocks",
    "dequantize_moment",
    "from_blocks",
    "quantize_moment",
    "scale_grid_shape",
    "sharding_of",
    "to_blocks",
]

#: Elements per block along a parameter's last dim (1 x 128, DeepSeek-V3's activation blocks).
BLOCK = 128
#: The moment formats: signed FP8 E4M3 codes, and uint8 codes of a square root.
MOMENT_FORMATS = ("e4m3", "sqrt_uint8")
#: E4M3's largest code; in a block flagged non-finite, +-448 are +-inf and finite values
#: saturate at +-416 (the next code down).
E4M3_MAX, E4M3_FLAGGED_MAX = 448, 416
#: ``"sqrt_uint8"`` in a block flagged non-finite: code 255 is inf, 254 NaN, 0..253 finite.
SQRT_INF, SQRT_NAN, SQRT_FLAGGED_MAX = 255, 254, 253
_F32_MAX = np.float32(np.finfo(np.float32).max)


class BlockScaled(NamedTuple):
    """One moment of every parameter: two trees shaped like the params (a struct of trees, so
    each is a params-like tree that ``optax.tree_map_params`` and ``nnx.Optimizer`` map
    parameter metadata, e.g. shardings, onto).

    Attributes:
      codes: per parameter, FP8 codes of its shape.
      scale_inv: per parameter, float32 inverse scales ``[..., ceil(K / block)]`` (a scalar
        parameter: one scalar).
    """

    codes: Any
    scale_inv: Any


def scale_grid_shape(shape: Sequence[int], block: int = BLOCK) -> tuple[int, ...]:
    """The shape of the inverse-scale grid of a moment of ``shape``: the last dim counted in
    blocks (``()`` for a scalar)."""
    shape = tuple(shape)
    if not shape:
        return ()
    return (*shape[:-1], -(-shape[-1] // block))


def to_blocks(x: jax.Array, block: int) -> jax.Array:
    """``x`` [..., K] as ``[..., ceil(K / block), block]``, the last block zero-padded."""
    if x.ndim == 0:
        x = x.reshape(1)
    k = x.shape[-1]
    nb = -(-k // block)
    if nb * block != k:
        x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, nb * block - k)])
    return x.reshape(*x.shape[:-1], nb, block)


def from_blocks(xb: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """The inverse of :func:`to_blocks`: ``[..., nb, block]`` back to ``shape``."""
    flat = xb.reshape(*xb.shape[:-2], xb.shape[-2] * xb.shape[-1])
    if not shape:
        return flat[..., 0].reshape(())
    return flat[..., : shape[-1]]


def _float_scale(amax: jax.Array, limit: jax.Array) -> jax.Array:
    """``limit / amax`` in float32 by ``block_scale``'s rule (``power_2_scale=False``): an
    overflow gives float32's largest, an amax of 0 or below float32's smallest normal scale 1."""
    scale = limit / amax
    scale = jnp.where(jnp.isinf(scale), _F32_MAX, scale)
    return jnp.where(amax < np.float32(np.finfo(np.float32).smallest_normal), np.float32(1), scale)


def _finite_amax(xb: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Per block: the largest finite ``|x|`` (0 if none), and whether the block holds a
    non-finite element."""
    finite = jnp.isfinite(xb)
    amax = jnp.max(jnp.where(finite, jnp.abs(xb), np.float32(0)), axis=-1)
    return amax, ~jnp.all(finite, axis=-1)


def _signed_e4m3(x: jax.Array, block: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Block-scaled E4M3 codes of ``x`` (Float8BlockScaling's float32 scales), the scales and
    the non-finite blocks' flags. A flagged block maps its finite values onto +-416 and keeps
    +-448 for +-inf; NaN is E4M3's NaN code."""
    xb = to_blocks(x, block)
    amax, flagged = _finite_amax(xb)
    scale = jnp.where(
        flagged,
        _float_scale(amax, np.float32(E4M3_FLAGGED_MAX)),
        block_scale(amax, jnp.float8_e4m3fn, power_2_scale=False),
    )
    limit = jnp.where(flagged, np.float32(E4M3_FLAGGED_MAX), np.float32(E4M3_MAX))[..., None]
    codes = jnp.clip(xb * scale[..., None], -limit, limit)
    codes = jnp.where(jnp.isinf(xb), jnp.copysign(np.float32(E4M3_MAX), xb), codes)
    codes = jnp.where(jnp.isnan(xb), np.float32(np.nan), codes)
    return codes.astype(jnp.float8_e4m3fn), scale, flagged


def _sqrt_uint8(x: jax.Array, block: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """uint8 codes of ``sqrt(x)``, linear from 0 to the block's largest finite value (255, or
    253 in a flagged block, whose codes 255 and 254 are inf and NaN); a nonzero value never
    gets code 0. Also the scales and the non-finite blocks' flags."""
    yb = to_blocks(jnp.sqrt(x), block)
    amax, flagged = _finite_amax(yb)
    limit = jnp.where(flagged, np.float32(SQRT_FLAGGED_MAX), np.float32(255))
    ok = amax >= np.float32(np.finfo(np.float32).smallest_normal)
    scale = jnp.where(ok, limit / jnp.where(ok, amax, 1), np.float32(1))
    codes = jnp.clip(jnp.round(yb * scale[..., None]), 0, limit[..., None])
    codes = jnp.where((codes == 0) & (yb > 0), 1, codes)
    codes = jnp.where(jnp.isnan(yb), SQRT_NAN, jnp.where(jnp.isinf(yb), SQRT_INF, codes))
    return codes.astype(jnp.uint8), scale, flagged


def quantize_moment(x: jax.Array, fmt: str, *, block: int = BLOCK) -> tuple[jax.Array, jax.Array]:
    """``(codes, scale_inv)`` of float32 ``x`` in moment format ``fmt``, one float32 scale per
    ``block`` elements along the last dim (``scale_inv`` shaped :func:`scale_grid_shape`):

    - ``"e4m3"`` (signed; Adam's first moment): ``codes = saturate(round_to_nearest_even(x *
      scale))`` as ``float8_e4m3fn``, ``scale = block_scale(amax, power_2_scale=False)`` =
      ``448 / amax`` in float32 (a block of zeros: 1);
    - ``"sqrt_uint8"`` (``x >= 0``; the second moment): ``codes = round(sqrt(x) * scale)`` as
      ``uint8``, ``scale = 255 / max(sqrt(x))`` over the block; a nonzero value whose code would
      be 0 gets 1 (a denominator never rounds to 0).

    Non-finite values come back as they were (as in a float32 moment): a block holding one is
    flagged by a negative ``scale_inv`` (``-1 / scale``), its ``amax`` is over its finite
    values, which saturate one or two codes lower (E4M3: at +-416, scale ``416 / amax``; uint8:
    at 253, scale ``253 / max``), and the top codes are reserved: E4M3 +-448 for +-inf and its
    NaN code for NaN; uint8 255 for inf and 254 for NaN (``sqrt(x)`` of a negative ``x`` is
    NaN). A block of finite values is stored as before (positive ``scale_inv``).

    >>> import jax.numpy as jnp
    >>> from fp8jax.optim import quantize_moment, dequantize_moment
    >>> q, s = quantize_moment(jnp.array([[4.0, 1.0, 0.0]]), "sqrt_uint8")
    >>> q.tolist(), s.shape, dequantize_moment(q, s, "sqrt_uint8").round(4).tolist()
    ([[255, 128, 0]], (1, 1), [[4.0, 1.0078999996185303, 0.0]])
    >>> q, s = quantize_moment(jnp.array([[4.0, jnp.inf, jnp.nan]]), "sqrt_uint8")
    >>> q.tolist(), float(s[0, 0]) < 0, dequantize_moment(q, s, "sqrt_uint8").tolist()
    ([[253, 255, 254]], True, [[4.0, inf, nan]])
    """
    if fmt not in MOMENT_FORMATS:
        raise ValueError(f"quantize_moment: fmt must be one of {MOMENT_FORMATS}, got {fmt!r}")
    shape = jnp.shape(x)
    x = jnp.asarray(x, jnp.float32)
    if fmt == "e4m3":
        codes, scale, flagged = _signed_e4m3(x, block)
    else:
        codes, scale, flagged = _sqrt_uint8(x, block)
    scale_inv = (np.float32(1) / scale).astype(jnp.float32)
    scale_inv = jnp.where(flagged, -scale_inv, scale_inv)
    return from_blocks(codes, shape), scale_inv.reshape(scale_grid_shape(shape, block))


def dequantize_moment(
    codes: jax.Array, scale_inv: jax.Array, fmt: str, *, block: int = BLOCK
) -> jax.Array:
    """The float32 moment of ``(codes, scale_inv)`` in format ``fmt``: ``codes * |scale_inv|``
    per block (squared for ``"sqrt_uint8"``), at most float32's largest in magnitude, and in a
    block flagged non-finite (``scale_inv < 0``) the reserved codes as +-inf and NaN
    (:func:`quantize_moment`)."""
    if fmt not in MOMENT_FORMATS:
        raise ValueError(f"dequantize_moment: fmt must be one of {MOMENT_FORMATS}, got {fmt!r}")
    shape = jnp.shape(codes)
    qb = to_blocks(codes.astype(jnp.float32), block)
    s = jnp.reshape(scale_inv, qb.shape[:-1])[..., None]
    flagged = jnp.signbit(s)
    y = qb * jnp.abs(s)
    if fmt == "e4m3":
        y = jnp.clip(y, -_F32_MAX, _F32_MAX)
        inf = flagged & (jnp.abs(qb) == np.float32(E4M3_MAX))
        y = jnp.where(inf, jnp.copysign(np.float32(np.inf), qb), y)
    else:
        y = jnp.minimum(y * y, _F32_MAX)
        y = jnp.where(flagged & (qb == SQRT_INF), np.float32(np.inf), y)
        y = jnp.where(flagged & (qb == SQRT_NAN), np.float32(np.nan), y)
    return from_blocks(y, shape)


def sharding_of(x: Any) -> NamedSharding | None:
    """The ``NamedSharding`` of ``x`` where it is known: a concrete array's, or a tracer's under
    a mesh with explicit axes; ``None`` otherwise."""
    if isinstance(x, jax.core.Tracer):
        if not explicit_mesh():
            return None
        sharding = getattr(jax.typeof(x), "sharding", None)
    else:
        sharding = getattr(x, "sharding", None)
    return sharding if isinstance(sharding, NamedSharding) else None


def check_blocks(owner: str, path: str, x: Any, block: int = BLOCK) -> None:
    """ValueError if the known sharding of parameter ``x`` (at ``path``) splits its last dim so
    that a block would straddle two devices: its moments are sharded like it, so each device
    must hold whole blocks of the last dim."""
    sharding = sharding_of(x)
    shape = tuple(jnp.shape(x))
    if sharding is None or not shape:
        return
    spec = tuple(sharding.spec) + (None,) * (len(shape) - len(tuple(sharding.spec)))
    axes = entry_axes(spec[len(shape) - 1])
    if not whole_blocks(sharding.mesh, axes, shape[-1], block):
        shards = int(np.prod([sharding.mesh.shape[a] for a in axes]))
        raise ValueError(
            f"{owner}: parameter {path} of shape {shape} has its last dim (size {shape[-1]}) "
            f"split {shards} ways (mesh axes {axes}), so a device's part is not a multiple of "
            f"the moment's block ({block}) and a block would straddle two devices. Split the "
            f"last dim so each device holds a multiple of {block} elements, keep it whole, or "
            "pass a block_size that divides each device's part."
        )
