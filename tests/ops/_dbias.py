"""dbias expectations shared by the cast_transpose_dbias and activation tests."""

from __future__ import annotations

import numpy as np

TILE_ROWS = 128  # rows per tile (cpp/common/launch_plan.h: plan::kBigTile, the CPU strip)
GROUP_ROWS = 8  # rows per group (plan::kSumGroup)
LANES = 16  # pass 2's interleaved sums per column (plan::kColumnLanes)


def column_lanes_sum(parts: np.ndarray) -> np.ndarray:
    """Column totals of partial rows ``parts[r, n]`` in the kernels' pass-2 order
    (``plan::ColumnLane``): 16 interleaved lanes (lane ``l`` adds rows ``l, l + 16, ...`` in order,
    from +0), then the lanes in order, from +0."""
    v = np.asarray(parts, np.float32)
    lanes = np.zeros((LANES, v.shape[1]), np.float32)
    for r, row in enumerate(v):
        lanes[r % LANES] = lanes[r % LANES] + row
    total = np.zeros(v.shape[1], np.float32)
    for lane in lanes:
        total = total + lane
    return total


def strip_order_sum(g: np.ndarray) -> np.ndarray:
    """The kernels' dbias of ``g[m, n]`` in float32, in their order (CPU and CUDA alike): each
    group of 8 rows summed in row order, each 128-row tile's groups in order, every sum from +0,
    then the tiles' sums added as :func:`column_lanes_sum` adds rows."""
    v = np.asarray(g, np.float32)
    tiles = []
    for t0 in range(0, v.shape[0], TILE_ROWS):
        tile = np.zeros(v.shape[1], np.float32)
        for g0 in range(t0, min(t0 + TILE_ROWS, v.shape[0]), GROUP_ROWS):
            group = np.zeros(v.shape[1], np.float32)
            for row in v[g0 : min(g0 + GROUP_ROWS, t0 + TILE_ROWS)]:
                group = group + row
            tile = tile + group
        tiles.append(tile)
    return column_lanes_sum(np.reshape(tiles, (len(tiles), v.shape[1])))


def assert_dbias_close(dbias, g) -> None:
    """Within the float32 error bound of an ``m``-term sum, against the float64 sum."""
    v = np.asarray(g, np.float64)
    want = v.sum(axis=0)
    bound = (v.shape[0] + 1) * float(np.finfo(np.float32).eps) * np.abs(v).sum(axis=0)
    err = np.abs(np.asarray(dbias, np.float64) - want)
    assert (err <= bound + 1e-30).all(), (err.max(), bound.min())
