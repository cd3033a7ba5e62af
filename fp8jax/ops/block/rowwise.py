"""Row-wise FP8 (``Float8RowwiseScaling``, issue 49): one float32 scale per row of a GEMM
operand, along the GEMM's contraction dim, from the row's own amax.

A row is one block as long as the row (``block_quantize`` with a ``(1, K)`` block would give
the same codes and scales): the amax leaves NaNs out, the scale is Float8BlockScaling's rule
(:func:`~fp8jax.ops.block.block_scaling.block_scale`: ``fp8_max / max(amax, amax_epsilon)``,
1 for an amax of 0, subnormal, inf or NaN, by default rounded down to a power of two) and the
codes are the per-tensor cast's (:func:`~fp8jax.ops.casts.quantize.to_fp8`: round to nearest
even, saturate, NaN keeps its sign, +-inf stays non-finite). Every inverse scale has shape
``x.shape[:-1] + (1,)``, so ``q * scale_inv`` dequantizes by broadcasting.

The GEMM of two row-wise operands (:func:`rowwise_scaled_matmul`) needs no per-element
dequantization: the scales factor out of the dot, ``a @ b.T = (a8 @ b8.T) * sa[:, None] *
sb[None, :]`` (cuBLASLt's outer-vector scale mode applies them the same way on a GPU).

The cast is an op (``rowwise_quantize``, FFI target ``fp8jax_rowwise_quantize``): CPU and CUDA
kernels bit-identical to :func:`rowwise_quantize_reference`, under the ``"cast"`` family's
kernel/XLA switch (:func:`fp8jax.ops.implementation`; ``"kernel"`` by default, ``"xla"`` runs the
reference). :func:`rowwise_cast_transpose` is that kernel twice, the second time on XLA's
transpose of ``x`` (the transposed copy is quantized from the high-precision values, so no byte
transpose of ``q`` can make it). vmap: the batch dims are more leading dims, that is more rows.
Sharding: the rows split freely, each device casting its own rows (their scales follow them, no
collective); a split last dim (``K``, the rows' length) is gathered before the kernel (a row's
amax and codes are then one device's work, and the result is the one-device result bit for bit),
rather than all-reducing the row amax over the split, which would cost a collective per cast for
the rare layout that splits a cast's contraction dim.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fp8jax.ops.base import checks, opdef, partition
from fp8jax.ops.block.block_scaling import SCALE_F32, SCALE_POW2, block_scale
from fp8jax.ops.casts.quantize import to_fp8

__all__ = [
    "rowwise_amax",
    "rowwise_cast_transpose",
    "rowwise_dequantize",
    "rowwise_quantize",
    "rowwise_quantize_reference",
    "rowwise_scaled_matmul",
]


def _check_eps(owner: str, amax_epsilon: Any) -> float:
    ok = isinstance(amax_epsilon, (int, float, np.floating, np.integer))
    if not ok or isinstance(amax_epsilon, bool) or not (
        np.isfinite(amax_epsilon) and amax_epsilon >= 0
    ):  # fmt: skip
        raise ValueError(f"{owner}: amax_epsilon must be a finite float >= 0, got {amax_epsilon!r}")
    return float(amax_epsilon)


def _check_x(owner: str, x: Any) -> jax.Array:
    x = checks.wide_array(owner, "x", x)
    if x.ndim < 1:
        raise ValueError(f"{owner}: x must have at least one dim (its rows' last), got a scalar")
    return x


def rowwise_amax(x: jax.Array) -> jax.Array:
    """The amax of each row of ``x`` (along its last axis): float32 ``x.shape[:-1] + (1,)``.
    NaNs are left out (as the block amax, TransformerEngine's ``fmaxf``); an inf makes the
    amax inf; an empty row's amax is 0."""
    x = _check_x("rowwise_amax", x)
    mag = jnp.abs(x.astype(jnp.float32))
    mag = jnp.where(jnp.isnan(mag), jnp.float32(0), mag)
    return jnp.max(mag, axis=-1, keepdims=True, initial=jnp.float32(0))


def _reference(x, *, fp8_dtype, power_2_scale, amax_epsilon):
    """The op's reference: ``(q, scale_inv)``, ``scale_inv`` of shape ``x.shape[:-1]`` (the
    public functions add the trailing 1)."""
    amax = rowwise_amax(x)
    scale = block_scale(
        amax, fp8_dtype, power_2_scale=power_2_scale, amax_epsilon=amax_epsilon,
        input_dtype=x.dtype,
    )  # fmt: skip
    q = to_fp8(x.astype(jnp.float32), scale, fp8_dtype)
    return q, (np.float32(1) / scale).astype(jnp.float32)[..., 0]


def _outputs(x, *, fp8_dtype, power_2_scale, amax_epsilon):
    del power_2_scale, amax_epsilon
    # scale_inv: x's leading dims (one per row), split like them
    return opdef.like(x, fp8_dtype), opdef.like(x, jnp.float32, dims=(), core=1)


def _factors(x_ndim: int) -> tuple[list[str], list[str]]:
    rows = opdef.lead(x_ndim - 1)
    return [f"{rows} k".strip()], [f"{rows} k".strip(), rows]


def _attrs(*, fp8_dtype, power_2_scale, amax_epsilon):
    del fp8_dtype
    mode = SCALE_POW2 if power_2_scale else SCALE_F32
    return {"scale_mode": np.int64(mode), "epsilon": np.float32(amax_epsilon)}


# The row-wise cast as an op (fp8jax.ops.base.opdef): its kernels, vmap, the "cast" family's
# kernel/XLA switch, and sharding: the rows (every leading dim) split freely, scale_inv like
# them; a split K is gathered first (need_replication). No collective.
_ROWWISE_QUANTIZE = opdef.OpDef(
    name="rowwise_quantize",
    family="cast",
    target="fp8jax_rowwise_quantize",
    reference=_reference,
    outputs=_outputs,
    factors=_factors,
    attrs=_attrs,
    need_replication=("k",),
)


def _args(owner: str, x: Any, fp8_dtype: Any, power_2_scale: Any, amax_epsilon: Any) -> dict:
    x = _check_x(owner, x)
    dt = checks.fp8_dtype_arg(owner, "fp8_dtype", fp8_dtype)
    eps = _check_eps(owner, amax_epsilon)
    if not isinstance(power_2_scale, (bool, np.bool_)):
        raise TypeError(f"{owner}: power_2_scale must be a bool, got {power_2_scale!r}")
    return dict(x=x, fp8_dtype=dt, power_2_scale=bool(power_2_scale), amax_epsilon=eps)


@functools.partial(jax.jit, static_argnums=(1, 2, 3))
def _run_reference(x, fp8_dtype, power_2_scale, amax_epsilon):
    q, s = _reference(
        x, fp8_dtype=fp8_dtype, power_2_scale=power_2_scale, amax_epsilon=amax_epsilon
    )
    return q, s[..., None]


def rowwise_quantize_reference(
    x: jax.Array,
    fp8_dtype: Any,
    *,
    power_2_scale: bool = True,
    amax_epsilon: float = 0.0,
) -> tuple[jax.Array, jax.Array]:
    """Pure-``jnp`` reference of :func:`rowwise_quantize` (its ``"xla"`` implementation): the
    definition of the row-wise cast's numerics, which its kernels equal bit for bit."""
    a = _args("rowwise_quantize_reference", x, fp8_dtype, power_2_scale, amax_epsilon)
    return _run_reference(a["x"], a["fp8_dtype"], a["power_2_scale"], a["amax_epsilon"])


def rowwise_quantize(
    x: jax.Array,
    fp8_dtype: Any,
    *,
    power_2_scale: bool = True,
    amax_epsilon: float = 0.0,
    implementation: str | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Row-wise quantization of ``x`` (rows along its last axis): ``(q, scale_inv)``.

    ``q = saturate(round(x * scale))`` in ``x``'s shape, with its row's ``scale``
    (:func:`~fp8jax.ops.block.block_scaling.block_scale` of :func:`rowwise_amax`: see the
    module docstring); ``scale_inv = 1 / scale``, float32 ``x.shape[:-1] + (1,)``.
    ``implementation``: ``"kernel"`` or ``"xla"`` (:func:`rowwise_quantize_reference`), as for
    :func:`fp8jax.ops.quantize` (family ``"cast"``).

    >>> import jax.numpy as jnp
    >>> q, sinv = rowwise_quantize(jnp.array([[1.0, -3.0], [0.0, 0.0], [96.0, 7.0]]),
    ...                            jnp.float8_e4m3fn)
    >>> sinv.ravel().tolist()  # amax 3 -> 2**floor(log2(448 / 3)) = 128; zeros -> 1; 96 -> 4
    [0.0078125, 1.0, 0.25]
    >>> (q.astype(jnp.float32) * sinv).tolist()
    [[1.0, -3.0], [0.0, 0.0], [96.0, 7.0]]
    """
    a = _args("rowwise_quantize", x, fp8_dtype, power_2_scale, amax_epsilon)
    q, s = _ROWWISE_QUANTIZE(a.pop("x"), implementation=implementation, **a)
    return q, jnp.expand_dims(s, -1)


def rowwise_cast_transpose(
    x: jax.Array,
    fp8_dtype: Any,
    *,
    power_2_scale: bool = True,
    amax_epsilon: float = 0.0,
    implementation: str | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Matrix ``x [M, K]`` quantized row-wise for a GEMM in both layouts: ``(q [M, K],
    scale_inv [M, 1], q_t [K, M], scale_inv_t [K, 1])``, ``q_t`` quantized again from ``x``'s
    high-precision values along ``M`` (one scale per column of ``x``), never transposed from
    ``q``: the copy a GEMM contracting over ``M`` (the wgrad) reads. Two calls of
    :func:`rowwise_quantize` (``implementation`` as there), the second on XLA's transpose of
    ``x``."""
    x = _check_x("rowwise_cast_transpose", x)
    if x.ndim != 2:
        raise ValueError(f"rowwise_cast_transpose: x must be a matrix, got shape {x.shape}")
    kw = dict(power_2_scale=power_2_scale, amax_epsilon=amax_epsilon,
              implementation=implementation)  # fmt: skip
    return (*rowwise_quantize(x, fp8_dtype, **kw), *rowwise_quantize(x.T, fp8_dtype, **kw))


def rowwise_dequantize(
    q: jax.Array, scale_inv: jax.Array, out_dtype: Any = jnp.float32
) -> jax.Array:
    """``q * scale_inv`` in float32, then ``out_dtype``: the inverse of
    :func:`rowwise_quantize` (``scale_inv`` of shape ``q.shape[:-1] + (1,)``)."""
    q = checks.fp8_array("rowwise_dequantize", "q", q)
    want = (*q.shape[:-1], 1)
    if tuple(jnp.shape(scale_inv)) != want:
        raise ValueError(
            f"rowwise_dequantize: scale_inv must have shape {want} (one per row of q), got "
            f"{jnp.shape(scale_inv)}"
        )
    out_dt = checks.wide_dtype_arg("rowwise_dequantize", "out_dtype", out_dtype)
    return (q.astype(jnp.float32) * scale_inv.astype(jnp.float32)).astype(out_dt)


def rowwise_scaled_matmul(
    a_q: jax.Array,
    a_scale_inv: jax.Array,
    b_q: jax.Array,
    b_scale_inv: jax.Array,
    out_dtype: Any = jnp.float32,
) -> jax.Array:
    """The row-wise scaled GEMM ``a @ b.T`` of the K-major FP8 ``a_q [M, K]`` and ``b_q [N,
    K]`` with their rows' inverse scales (``[M, 1]`` and ``[N, 1]``, as
    :func:`rowwise_quantize` returns them): ``(a8 @ b8.T) * (sa[:, None] * sb[None, :])``, the
    dot of the FP8 values (exact products, summed in float32 in XLA's order,
    ``precision=HIGHEST``) scaled by the outer product of the scales in float32, then
    ``out_dtype``. With power-of-two scales the scaling is exact (barring under- or overflow)."""
    owner = "rowwise_scaled_matmul"
    a_q, b_q = checks.fp8_array(owner, "a_q", a_q), checks.fp8_array(owner, "b_q", b_q)
    if a_q.ndim != 2 or b_q.ndim != 2 or a_q.shape[1] != b_q.shape[1]:
        raise ValueError(
            f"{owner}: a_q [M, K] and b_q [N, K] must be matrices with the same K, got "
            f"{a_q.shape} and {b_q.shape}"
        )
    for name, q, s in (("a_scale_inv", a_q, a_scale_inv), ("b_scale_inv", b_q, b_scale_inv)):
        if tuple(jnp.shape(s)) != (q.shape[0], 1) or jnp.result_type(s) != jnp.float32:
            raise ValueError(
                f"{owner}: {name} must be float32 [{q.shape[0]}, 1] (one per row), got "
                f"{jnp.result_type(s)}{list(jnp.shape(s))}"
            )
    out_dt = checks.wide_dtype_arg(owner, "out_dtype", out_dtype)
    # under explicit sharding, the output sharded as the GEMM's rule gives it (a split K summed)
    spec = partition.explicit_matmul_spec(a_q, b_q, b_rows_are_n=True) if (
        partition.explicit_mesh()) else None  # fmt: skip
    acc = jax.lax.dot_general(
        a_q.astype(jnp.float32), b_q.astype(jnp.float32), (((1,), (1,)), ((), ())),
        precision=jax.lax.Precision.HIGHEST, preferred_element_type=jnp.float32,
        out_sharding=spec,
    )  # fmt: skip
    b_row = jnp.reshape(b_scale_inv, (1, -1))
    if spec is not None:  # the scales as the output's rows and columns (an axis used once)
        a_scale_inv = jax.sharding.reshard(a_scale_inv, jax.sharding.PartitionSpec(spec[0], None))
        b_row = jax.sharding.reshard(b_row, jax.sharding.PartitionSpec(None, spec[1]))
    return (acc * (a_scale_inv * b_row)).astype(out_dt)
