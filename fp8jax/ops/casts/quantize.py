"""``quantize`` and ``dequantize``: the FP8 casts, as FFI kernels beside their jnp references.

Numerics contract (docs/numerics.md): ``q = saturate(round_to_nearest_even(x * scale))``,
computed in float32. Finite values beyond the format's largest value saturate to +-max; NaN stays
NaN with its sign (E4M3 ``sign|0x7F``, E5M2 ``sign|0x7E``); +-inf stays non-finite (E5M2 +-inf
``0x7C``/``0xFC``; E4M3, which has no inf, NaN ``0x7F``/``0xFF``), so a diverging step shows up
as a non-finite loss; signed zeros keep their sign. ``amax = max(|x|)`` of the *unscaled* input,
NaN-propagating (like :func:`jnp.max`). ``scale_inv = 1 / scale`` travels with ``q``.

The kernels are bit-identical to the references on CPU and GPU. Under :func:`jax.vmap` each
batch element is its own tensor with its own scale and amax; the kernels take a leading group
dimension natively, so a vmapped call is still one launch.

Sharding (see :mod:`fp8jax.ops.base.partition`): under :func:`jax.jit` on a mesh, ``quantize`` and
``dequantize`` run where ``x`` lives: ``q`` keeps the sharding of ``x`` (of ``q`` for
``dequantize``), nothing is gathered, and ``quantize``'s ``amax`` is the max over the *whole*
tensor, made so by one all-reduce (``pmax``) over exactly the mesh axes that split ``x``; every
device holds the same ``amax`` and ``scale_inv``. Inside a ``shard_map`` body the ops see only
the local block, so ``amax`` there is the block's own (``jax.lax.pmax`` it yourself).

With ``fp8jax.ops.implementation(cast="xla")`` (or ``implementation="xla"``) the references run
instead, compiled, batched and partitioned by XLA, with the same bits.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

from fp8jax.ops.base import checks, opdef
from fp8jax.recipe import fp8_max

__all__ = [
    "cast_to_representable",
    "dequantize",
    "dequantize_reference",
    "quantize",
    "quantize_reference",
]


# Per FP8 dtype: (largest finite code, NaN code, code of +inf); a sign bit is OR-ed into each.
# E4M3FN has no inf: +-inf becomes its NaN. ml_dtypes and XLA's convert give the same NaN and inf
# codes (but they turn a finite overflow into NaN/inf, where fp8jax saturates).
SPECIAL_CODES = {
    jnp.dtype(jnp.float8_e4m3fn): (0x7E, 0x7F, 0x7F),
    jnp.dtype(jnp.float8_e5m2): (0x7B, 0x7E, 0x7C),
}


def _sign_byte(a: jax.Array) -> jax.Array:
    """The sign bit of float32 ``a`` as ``uint8`` 0x00 or 0x80."""
    return (jax.lax.bitcast_convert_type(a, jnp.uint32) >> 24).astype(jnp.uint8) & 0x80


def to_fp8(x: jax.Array, scale: jax.Array, fp8_dtype: Any) -> jax.Array:
    """The FP8 code of float32 ``x * scale`` (the CPU kernel's ``QuantizeValue``).

    Finite products round to nearest even, saturating to +-max beyond the range. A NaN product
    is ``fp8_dtype``'s NaN with the product's sign, ``sign(x) XOR sign(scale)``, taken from the
    operands because a GPU's multiply returns one canonical NaN. An infinite product is
    +-inf (E5M2) or NaN (E4M3) when ``x`` or ``scale`` is not finite, and saturates to +-max
    when both are finite (an overflow of the multiply is a finite value beyond the range).
    """
    dt = jnp.dtype(fp8_dtype)
    max_code, nan_code, inf_code = SPECIAL_CODES[dt]
    y = x * scale
    m = fp8_max(dt)
    finite = jnp.isfinite(y)
    codes = jax.lax.bitcast_convert_type(
        jnp.clip(jnp.where(finite, y, 0), -m, m).astype(dt), jnp.uint8
    )
    nan = _sign_byte(x) ^ _sign_byte(scale) | jnp.uint8(nan_code)
    overflow = jnp.where(jnp.isfinite(x) & jnp.isfinite(scale), max_code, inf_code)
    inf = _sign_byte(y) | overflow.astype(jnp.uint8)
    special = jnp.where(jnp.isnan(y), nan, inf)
    return jax.lax.bitcast_convert_type(jnp.where(finite, codes, special), dt)


def _amax(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """NaN-propagating max(|x|) as a max over the unsigned bits of |x|.

    For non-negative floats the unsigned order of the bits is the numeric order and every NaN
    sorts above inf, so this is exact and propagates NaN. (XLA:CPU's float max-reduction does not
    reliably propagate NaN over large inputs, so a plain ``jnp.max`` is not a usable reference.)
    """
    mag = jax.lax.bitcast_convert_type(jnp.abs(x.astype(jnp.float32)), jnp.uint32)
    a = jnp.max(mag, initial=jnp.uint32(0))
    return jnp.reshape(jax.lax.bitcast_convert_type(a, jnp.float32), shape)


def quantize_reference(
    x: jax.Array, scale: jax.Array, fp8_dtype: Any
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Pure-jnp reference of :func:`quantize` (the definition of its numerics)."""
    q = to_fp8(x.astype(jnp.float32), jnp.reshape(scale, ()), fp8_dtype)
    return q, (1.0 / scale).astype(jnp.float32), _amax(x, scale.shape)


# The op definitions (fp8jax.ops.base.opdef): the kernel call, its sharding, vmap and the
# kernel/XLA switch all follow from them. x and q keep their split, the scale is replicated, and
# quantize's amax is the max over all of x, made global over the mesh.


def _quantize_factors(x_ndim: int, scale_ndim: int) -> tuple[list[str], list[str]]:
    x, s = opdef.lead(x_ndim), "s" * scale_ndim
    return [x, s], [x, s, s]


_QUANTIZE = opdef.OpDef(
    name="quantize",
    family="cast",
    target="fp8jax_quantize",
    reference=quantize_reference,
    outputs=lambda x, scale, *, fp8_dtype: (
        opdef.like(x, fp8_dtype),
        opdef.like(scale, jnp.float32),
        opdef.like(scale, jnp.float32),
    ),
    factors=_quantize_factors,
    max_over={2: 0},  # amax: the max over all of x
)
_quantize_rule = _QUANTIZE.rule  # e.g. "d0 d1, s -> d0 d1, s, s"


def quantize(
    x: jax.Array,
    scale: jax.Array,
    fp8_dtype: Any,
    *,
    amax_reduction: str = "split",
    implementation: str | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Quantizes ``x`` to FP8 with ``scale``; returns ``(q, scale_inv, amax)``.

    Args:
      x: float32, bfloat16 or float16 array of any rank.
      scale: float32, shape ``()`` or ``(1,)``.
      fp8_dtype: ``jnp.float8_e4m3fn`` or ``jnp.float8_e5m2``.
      amax_reduction: when ``x`` is split over a mesh, the devices its ``amax`` is max-reduced
        over: ``"split"`` (default) the mesh axes that split ``x``; ``"mesh"`` all mesh axes, so
        that all such reductions in a program share one device group and XLA combines them
        into one all-reduce. The value is the same either way. (With ``"xla"``, XLA groups
        the reduction itself, over the axes that split ``x``.)
      implementation: ``"kernel"`` or ``"xla"`` (:func:`quantize_reference` compiled by XLA);
        default: the enclosing :func:`fp8jax.ops.implementation` choice for ``"cast"``.

    Returns:
      ``q`` (``x.shape``, ``fp8_dtype``), ``scale_inv`` and ``amax`` (float32, ``scale.shape``).

    >>> import jax.numpy as jnp, fp8jax
    >>> q, s_inv, amax = fp8jax.ops.quantize(jnp.array([1.0, -500.0]), jnp.float32(1.0),
    ...                                      jnp.float8_e4m3fn)
    >>> q.tolist(), float(amax)
    ([1.0, -448.0], 500.0)
    """
    op = "quantize"
    x = checks.wide_array(op, "x", x)
    scale = checks.scalar_f32(op, "scale", scale)
    dt = checks.fp8_dtype_arg(op, "fp8_dtype", fp8_dtype)
    reduction = checks.amax_reduction_arg(op, amax_reduction)
    q, scale_inv, amax = _QUANTIZE(
        x, scale, fp8_dtype=dt, amax_reduction=reduction, implementation=implementation
    )
    return q, scale_inv, amax


# The quiet NaN of each output dtype, as bits; the sign bit is OR-ed in.
_QUIET_NAN = {
    jnp.dtype(jnp.float32): (jnp.uint32, 0x7FC00000, 31),
    jnp.dtype(jnp.bfloat16): (jnp.uint16, 0x7FC0, 15),
    jnp.dtype(jnp.float16): (jnp.uint16, 0x7E00, 15),
}


def dequantize_reference(q: jax.Array, scale_inv: jax.Array, out_dtype: Any) -> jax.Array:
    """Pure-jnp reference of :func:`dequantize`: ``(float32(q) * scale_inv).astype(out_dtype)``.

    A NaN result is ``out_dtype``'s quiet NaN (float32 ``0x7FC00000``, bfloat16 ``0x7FC0``,
    float16 ``0x7E00``) with the product's sign, ``sign(q) XOR sign(scale_inv)``, on every
    platform (a GPU's multiply and its float16 conversion drop a NaN's sign).
    """
    dt = jnp.dtype(out_dtype)
    si = jnp.reshape(scale_inv, ())
    y = (q.astype(jnp.float32) * si).astype(dt)
    uint, quiet, sign_shift = _QUIET_NAN[dt]
    q_sign = jax.lax.bitcast_convert_type(q, jnp.uint8) >> 7
    sign = q_sign.astype(uint) ^ (jax.lax.bitcast_convert_type(si, jnp.uint32) >> 31).astype(uint)
    nan = jax.lax.bitcast_convert_type(sign << sign_shift | uint(quiet), dt)
    return jnp.where(jnp.isnan(y), nan, y)


def _dequantize_factors(q_ndim: int, scale_ndim: int) -> tuple[list[str], list[str]]:
    return [opdef.lead(q_ndim), "s" * scale_ndim], [opdef.lead(q_ndim)]


_DEQUANTIZE = opdef.OpDef(
    name="dequantize",
    family="cast",
    target="fp8jax_dequantize",
    reference=dequantize_reference,
    outputs=lambda q, scale_inv, *, out_dtype: (opdef.like(q, out_dtype),),
    factors=_dequantize_factors,
)
_dequantize_rule = _DEQUANTIZE.rule  # e.g. "d0 d1, s -> d0 d1"


def dequantize(
    q: jax.Array,
    scale_inv: jax.Array,
    out_dtype: Any = jnp.float32,
    *,
    implementation: str | None = None,
) -> jax.Array:
    """Dequantizes FP8 ``q``: ``(float32(q) * scale_inv)`` rounded to ``out_dtype``.

    Args:
      q: ``float8_e4m3fn`` or ``float8_e5m2`` array of any rank.
      scale_inv: float32, shape ``()`` or ``(1,)``.
      out_dtype: float32, bfloat16 or float16.
      implementation: ``"kernel"`` or ``"xla"``, as for :func:`quantize`.
    """
    op = "dequantize"
    q = checks.fp8_array(op, "q", q)
    scale_inv = checks.scalar_f32(op, "scale_inv", scale_inv)
    dt = checks.wide_dtype_arg(op, "out_dtype", out_dtype)
    return _DEQUANTIZE(q, scale_inv, out_dtype=dt, implementation=implementation)[0]


def cast_to_representable(x: jax.Array, fp8_dtype: Any, scale: Any = 1.0) -> jax.Array:
    """Rounds ``x`` to the nearest values that quantize exactly with ``scale``.

    Finite values beyond the range saturate to ``+-fp8_max / scale``; NaN stays NaN with its sign;
    ``+-inf`` stays ``+-inf`` with E5M2 and becomes NaN (with its sign) with E4M3, which has no
    inf (docs/numerics.md).

    ``dequantize(*quantize(x, scale, fp8_dtype)[:2], x.dtype)``: feeding the result to an FP8
    layer whose scale is ``scale`` loses nothing in the cast, so FP8 and high-precision results
    differ only by accumulation order (the check the TransformerEngine FP8 tutorial makes).

    >>> import jax.numpy as jnp, fp8jax
    >>> fp8jax.cast_to_representable(jnp.array([0.3, 1000.0]), jnp.float8_e4m3fn).tolist()
    [0.3125, 448.0]
    """
    x = checks.wide_array("cast_to_representable", "x", x)
    scale = jnp.asarray(scale, jnp.float32)
    q, scale_inv, _ = quantize(x, scale, fp8_dtype)
    return dequantize(q, scale_inv, x.dtype)
