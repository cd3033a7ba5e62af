"""An independent numpy implementation of the row-wise cast (Float8RowwiseScaling, issue 49),
read by tests/ops/test_rowwise.py and tests/functional/test_rowwise_layers.py: float32
arithmetic in numpy, ``frexp`` for the power-of-two rounding, ``ml_dtypes`` for the FP8
rounding (saturated first)."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np

E4M3, E5M2 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)
FMAX = {E4M3: 448.0, E5M2: 57344.0}
ML = {E4M3: ml_dtypes.float8_e4m3fn, E5M2: ml_dtypes.float8_e5m2}
TINY = np.finfo(np.float32).smallest_normal


def _row_scale(row: np.ndarray, fmax: float, pow2: bool, eps: float, input_max: float) -> float:
    """The scale of one row (float64 values of its float32 elements)."""
    finite_or_inf = row[~np.isnan(row)]
    amax = float(np.max(np.abs(finite_or_inf))) if finite_or_inf.size else 0.0
    amax = max(amax, eps)
    if amax < TINY or np.isinf(amax):
        return 1.0
    with np.errstate(over="ignore"):
        s = np.float32(fmax) / np.float32(amax)  # float32 division, round to nearest
    if np.isinf(s):
        s = np.float32(input_max)
    if pow2:
        _, e = np.frexp(np.float64(s))  # s = m * 2**e, m in [0.5, 1): 2**floor(log2 s) = 2**(e-1)
        s = np.ldexp(1.0, int(e) - 1)
    return float(np.float32(s))


def numpy_rowwise(x: np.ndarray, dtype, pow2: bool = True, eps: float = 0.0, input_max=None):
    """The row-wise cast of ``x`` (any rank, rows along the last axis), written independently
    of fp8jax: ``(codes as uint8, scale_inv [..., 1])``."""
    input_max = np.finfo(np.float32).max if input_max is None else input_max
    x32 = np.asarray(x, np.float32)
    rows = x32.reshape(-1, x32.shape[-1])
    fmax = FMAX[jnp.dtype(dtype)]
    scales = np.array(
        [_row_scale(r.astype(np.float64), fmax, pow2, eps, input_max) for r in rows], np.float32
    )
    with np.errstate(over="ignore", invalid="ignore"):
        y = rows * scales[:, None]  # float32 products, as the cast computes them
        finite = np.isfinite(y)
        sat = np.where(finite, np.clip(y, -fmax, fmax), y)  # finite: saturated; inf, NaN kept
    q = sat.astype(ML[jnp.dtype(dtype)])
    sinv = (np.float32(1) / scales).astype(np.float32)
    return q.view(np.uint8).reshape(x32.shape), sinv.reshape(*x32.shape[:-1], 1)


def numpy_rowwise_values(x: np.ndarray, dtype, pow2: bool = True, eps: float = 0.0) -> np.ndarray:
    """The float64 values the row-wise cast of ``x`` stands for: each code's value times its
    row's inverse scale."""
    q, sinv = numpy_rowwise(x, dtype, pow2, eps)
    values = q.view(ML[jnp.dtype(dtype)]).astype(np.float64)
    return values * sinv.astype(np.float64)
