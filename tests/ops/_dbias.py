"""dbias expectations shared by the cast_transpose_dbias and activation tests."""

from __future__ import annotations

import numpy as np

STRIP = 64  # the kernels' dbias block (cpp/cpu/cpu_cast_transpose.h, the CUDA row tile)


def strip_order_sum(g: np.ndarray, strip: int = STRIP) -> np.ndarray:
    """The kernels' dbias of ``g[m, n]``, in float32, in their order."""
    v = np.asarray(g, np.float32)
    total = np.zeros(v.shape[1], np.float32)
    for r0 in range(0, v.shape[0], strip):
        part = np.zeros(v.shape[1], np.float32)
        for row in v[r0 : r0 + strip]:
            part = part + row
        total = total + part
    return total


def assert_dbias_close(dbias, g) -> None:
    """Within the float32 error bound of an ``m``-term sum, against the float64 sum."""
    v = np.asarray(g, np.float64)
    want = v.sum(axis=0)
    bound = (v.shape[0] + 1) * float(np.finfo(np.float32).eps) * np.abs(v).sum(axis=0)
    err = np.abs(np.asarray(dbias, np.float64) - want)
    assert (err <= bound + 1e-30).all(), (err.max(), bound.min())
