"""The CUDA kernels' launch planning (cpp/common/launch_plan.h), run on the host.

The test-only extension (``fp8jax._fp8jax_testing``) compiles the same header the CUDA kernels
use and exposes it as private ``_plan_*`` functions; ``_simulate_*`` run each kernel's tile walk
for every block and thread of the planned grid and report which element each thread touched. The
tests check, without a GPU: every element written exactly once, vector accesses only where
aligned, scalar head/tail only at the ends, one scale_inv write per group even for empty
tensors, and no grid-dimension limit (more than 65535 row tiles or vmapped groups, more than
2**31 elements: all int64).
"""

from __future__ import annotations

import numpy as np
import pytest
from conftest import load_testing_extension

ext = load_testing_extension()

RESIDENT = 132 * 8  # an H100's SMs x 8 blocks: what the occupancy API might return
BASE = 1 << 20  # a 256-byte aligned fake device address


def arr(b: bytes) -> np.ndarray:
    return np.frombuffer(b, dtype=np.int64)


# ------------------------------------------------------------------- elementwise


@pytest.mark.parametrize("resident", [1, 3, RESIDENT])
@pytest.mark.parametrize("wide_bytes", [4, 2])
@pytest.mark.parametrize(
    ("groups", "per_group"),
    [(1, 0), (3, 0), (1, 1), (1, 7), (1, 8), (1, 9), (1, 1001), (5, 13), (7, 8), (2, 20_000)],
)
def test_elementwise_covers_every_element_once(groups, per_group, wide_bytes, resident):
    sim = ext._simulate_elementwise(groups, per_group, wide_bytes, BASE, 2 * BASE, resident)
    n = groups * per_group
    np.testing.assert_array_equal(arr(sim["visits"]), np.ones(n, np.int64))
    assert sim["misaligned_vector_chunks"] == 0
    assert sim["out_of_group"] == 0
    # scale_inv: one write per group, also for empty groups (the empty-tensor bug's twin).
    np.testing.assert_array_equal(arr(sim["scale_inv_writes"]), np.ones(groups, np.int64))
    # amax: every group flushed by at least one block (an empty group flushes 0).
    assert (arr(sim["amax_flushes"]) >= 1).all()
    assert 1 <= sim["grid"] <= max(1, resident)


@pytest.mark.parametrize("wide_bytes", [4, 2])
def test_elementwise_vector_body_scalar_head_tail(wide_bytes):
    """per_group not a multiple of 8: every group keeps a vector body; at most 7 + 7 scalars."""
    groups, per_group = 6, 1003
    sim = ext._simulate_elementwise(groups, per_group, wide_bytes, BASE, 3 * BASE, RESIDENT)
    vec = arr(sim["vector_visits"]).reshape(groups, per_group)
    scalar_per_group = per_group - vec.sum(axis=1)
    assert (scalar_per_group <= 14).all(), scalar_per_group
    assert (vec.sum(axis=1) >= per_group - 14).all()
    # The scalar elements are only at the two ends of each group.
    for g in range(groups):
        body = np.flatnonzero(vec[g])
        assert body[-1] - body[0] + 1 == body.size  # contiguous vector body


@pytest.mark.parametrize(
    ("wide_off", "narrow_off", "wide_bytes", "vector"),
    [
        (0, 0, 2, True),
        (2, 1, 2, True),  # both shifted by one element: same phase, vector after a 7-element head
        (4, 1, 4, True),
        (16, 8, 4, True),  # 16-byte alignment suffices for f32 (two 16-byte loads)
        (2, 0, 2, False),  # relative misalignment: no common vector start, all scalar
        (1, 0, 2, False),  # not even element-aligned
    ],
)
def test_split_chunks_alignment(wide_off, narrow_off, wide_bytes, vector):
    s = ext._plan_split_chunks(BASE + wide_off, wide_bytes, 2 * BASE + narrow_off, 100)
    assert s["vector"] is vector
    assert -7 <= s["start"] <= 0
    sim = ext._simulate_elementwise(
        1, 100, wide_bytes, BASE + wide_off, 2 * BASE + narrow_off, RESIDENT
    )
    np.testing.assert_array_equal(arr(sim["visits"]), np.ones(100, np.int64))
    assert sim["misaligned_vector_chunks"] == 0
    assert bool(arr(sim["vector_visits"]).sum() > 0) is vector


def test_split_chunks_empty_and_one():
    assert ext._plan_split_chunks(BASE, 2, BASE, 0) == {"start": 0, "chunks": 0, "vector": False}
    one = ext._plan_chunk_at(BASE, 2, BASE, 1, 0)
    assert one == {"first": 0, "count": 1, "vector": False}


def test_more_than_65535_groups():
    """vmap over 100k groups: one grid dimension, blocks loop; no 65535 limit."""
    groups = 100_000
    plan = ext._plan_elementwise(groups, 16, RESIDENT)
    assert plan["tiles"] == groups and plan["grid"] == RESIDENT
    assert ext._plan_group_tile_at(plan["tiles"] - 1, plan["tiles_per_group"]) == (groups - 1, 0)
    sim = ext._simulate_elementwise(groups, 3, 2, BASE, 2 * BASE, RESIDENT)
    np.testing.assert_array_equal(arr(sim["visits"]), np.ones(3 * groups, np.int64))
    np.testing.assert_array_equal(arr(sim["scale_inv_writes"]), np.ones(groups, np.int64))


def test_more_than_2_31_elements():
    """int64 everywhere: a 2**33 + 5 element tensor, and 2**31 + 1 groups of 8."""
    n = 2**33 + 5
    plan = ext._plan_elementwise(1, n, RESIDENT)
    chunks_per_tile = plan["chunks_per_tile"]
    assert plan["tiles"] * chunks_per_tile * 8 >= n + 7
    last = ext._plan_chunk_at(BASE, 2, 2 * BASE, n, (n + 7) // 8 - 1)
    assert last["first"] + last["count"] == n
    mid = ext._plan_chunk_at(BASE, 2, 2 * BASE, n, 2**28 + 3)
    assert mid == {"first": (2**28 + 3) * 8, "count": 8, "vector": True}
    groups = 2**31 + 1
    plan = ext._plan_elementwise(groups, 8, RESIDENT)
    assert plan["tiles"] == groups
    assert ext._plan_group_tile_at(groups - 1, 1) == (groups - 1, 0)
    assert plan["grid"] == RESIDENT


def test_grid_is_never_zero_or_above_resident():
    assert ext._plan_elementwise(1, 0, RESIDENT)["grid"] == 1
    assert ext._plan_elementwise(1, 10**9, RESIDENT)["grid"] == RESIDENT
    assert ext._plan_elementwise(1, 10**9, 0)["grid"] == 1  # a bad occupancy answer: still >= 1


# ---------------------------------------------------------------- cast_transpose


def _check_transpose(matrices, rows, cols, groups=1, wide_bytes=2, offs=(0, 0, 0), resident=64):
    sim = ext._simulate_cast_transpose(
        matrices,
        rows,
        cols,
        groups,
        wide_bytes,
        BASE + offs[0],
        2 * BASE + offs[1],
        3 * BASE + offs[2],
        resident,
    )
    n = matrices * rows * cols
    np.testing.assert_array_equal(arr(sim["q_visits"]), np.ones(n, np.int64))
    np.testing.assert_array_equal(arr(sim["qt_visits"]), np.ones(n, np.int64))
    np.testing.assert_array_equal(arr(sim["q_src"]), np.arange(n))
    expected_qt = np.arange(n).reshape(matrices, rows, cols).transpose(0, 2, 1).reshape(-1)
    np.testing.assert_array_equal(arr(sim["qt_src"]), expected_qt)
    assert sim["misaligned_vector_chunks"] == 0
    np.testing.assert_array_equal(arr(sim["scale_inv_writes"]), np.ones(groups, np.int64))
    return sim


@pytest.mark.parametrize(
    ("matrices", "rows", "cols"),
    [
        (1, 4, 0),
        (1, 0, 16),
        (3, 0, 0),
        (0, 4, 16),
        (1, 1, 1),
        (1, 8, 8),
        (1, 64, 64),
        (1, 65, 63),
        (2, 9, 130),
        (3, 13, 7),
        (1, 200, 24),
        (4, 24, 200),
    ],
)
def test_cast_transpose_covers_and_transposes(matrices, rows, cols):
    sim = _check_transpose(matrices, rows, cols)
    if matrices * rows * cols == 0:
        assert sim["tiles"] == 0 and sim["grid"] == 1  # still launched: scale_inv is written


def test_cast_transpose_empty_writes_scale_inv_per_group():
    """The (4, 0) / (0, 16) bug: no tile has work, every group's scale_inv is still written."""
    for rows, cols in [(4, 0), (0, 16)]:
        _check_transpose(6, rows, cols, groups=3)


def test_cast_transpose_vector_paths():
    # rows, cols multiples of 8, aligned: every access is a vector.
    sim = _check_transpose(2, 64, 128)
    assert (arr(sim["vector_q"]) == 1).all() and (arr(sim["vector_qt"]) == 1).all()
    # rows not a multiple of 8: loads stay vector; q_t rows start misaligned, so its stores are
    # vector only where aligned (e.g. all of column 0), and the last partial chunk is scalar.
    sim = _check_transpose(1, 61, 128)
    assert (arr(sim["vector_q"]) == 1).all()
    vqt = arr(sim["vector_qt"]).reshape(128, 61)
    assert (vqt[0, :56] == 1).all() and (vqt[:, 56:] == 0).all()
    # cols not a multiple of 8: rows start misaligned -> those loads are scalar, q_t stays vector.
    sim = _check_transpose(1, 64, 100)
    assert (arr(sim["vector_qt"]) == 1).all()
    assert 0 < arr(sim["vector_q"]).sum() < 64 * 100


def test_cast_transpose_misaligned_pointers():
    sim = _check_transpose(1, 64, 64, wide_bytes=4, offs=(4, 1, 3))
    assert arr(sim["vector_q"]).sum() == 0 and arr(sim["vector_qt"]).sum() == 0
    _check_transpose(1, 64, 64, wide_bytes=4, offs=(16, 8, 8))  # 16 bytes suffice for f32


def test_more_than_65535_row_tiles():
    """10M tokens: 78125 row tiles, beyond gridDim.y's 65535; one grid dimension, blocks loop."""
    rows, cols = 10_000_000, 64
    plan = ext._plan_cast_transpose(1, rows, cols, RESIDENT)
    assert plan["row_tiles"] == 78_125 > 65_535
    assert plan["grid"] == RESIDENT
    last = ext._plan_transpose_chunks(
        rows, cols, 2, BASE, BASE, BASE, plan["tiles"] - 1, 1, 2, 255, 1
    )
    assert (last["row0"], last["col0"]) == ((78_125 - 1) * 128, 0)
    assert not last["fast"]  # a 64-column matrix has no interior 128 x 128 tile
    assert last["load"]["offset"] + last["load"]["count"] == rows * cols
    assert last["store"]["offset"] + last["store"]["count"] == rows * cols


def test_cast_transpose_more_than_2_31_elements():
    rows, cols = 70_016, 40_000  # 2.8e9 elements per matrix
    plan = ext._plan_cast_transpose(2, rows, cols, RESIDENT)
    last = ext._plan_transpose_chunks(
        rows, cols, 4, BASE, BASE, BASE, plan["tiles"] - 1, 2, 2, 255, 1
    )
    assert last["mat"] == 1
    assert last["load"]["offset"] + last["load"]["count"] == 2 * rows * cols
    assert last["store"]["offset"] + last["store"]["count"] == 2 * rows * cols
    assert last["load"]["vector"] and last["store"]["vector"]


def test_planners_reject_negative_sizes():
    with pytest.raises(ValueError, match="per_group"):
        ext._plan_elementwise(1, -1, RESIDENT)
    with pytest.raises(ValueError, match="groups"):
        ext._simulate_cast_transpose(4, 8, 8, 3, 2, BASE, BASE, BASE, 1)


# ------------------------------------------------- cast_transpose fast path (128 x 128 tiles)


def test_transpose8x8_matches_numpy():
    rng = np.random.default_rng(0)
    for _ in range(100):
        m = rng.integers(0, 256, size=(8, 8), dtype=np.uint8)
        words = [int(w) for w in m.view("<u8").reshape(8)]
        got = np.array(ext._plan_transpose8x8(words), dtype="<u8").view(np.uint8).reshape(8, 8)
        np.testing.assert_array_equal(got, m.T)


@pytest.mark.parametrize("wide_bytes", [4, 2])
def test_fast_path_interior_tiles(wide_bytes):
    """Aligned, rows % 16 == 0, cols % 8 == 0: every interior 128 x 128 tile takes the fast path,
    every access is a vector, and shared memory has no bank conflict (by the host's bank model:
    8-byte accesses served 16 threads per 128-byte wavefront, 16-byte ones 8 per wavefront)."""
    sim = _check_transpose(2, 256, 384, wide_bytes=wide_bytes)
    assert sim["fast_tiles"] == 2 * 2 * 3
    assert sim["bank_conflicts"] == 0
    assert (arr(sim["vector_q"]) == 1).all() and (arr(sim["vector_qt"]) == 1).all()


def test_fast_path_with_edge_tiles_and_groups():
    # 2 x 2 tiles per matrix, the right column partial: 2 fast tiles per matrix, the rest guarded.
    sim = _check_transpose(4, 256, 200, groups=2)
    assert sim["fast_tiles"] == 4 * 2
    assert sim["bank_conflicts"] == 0


@pytest.mark.parametrize(
    ("rows", "cols", "offs"),
    [(200, 256, (0, 0, 0)), (256, 252, (0, 0, 0)), (256, 256, (0, 0, 8)), (256, 256, (16, 4, 0))],
)
def test_fast_path_needs_alignment(rows, cols, offs):
    """Needs rows % 16, cols % 8, 16-byte x and q_t, 8-byte q; else every tile is guarded."""
    sim = _check_transpose(1, rows, cols, offs=offs)
    assert sim["fast_tiles"] == 0


def test_column_totals_spread_over_blocks_and_lanes():
    """Pass 2 of dbias for a 16,384 x 1,024 gradient (128 row tiles): 64 blocks of 256 threads,
    each adding 8 tiles in sequence (it was 4 blocks, each thread adding all 128 tiles), and the
    norm backward's 1,024 slots of h = 1,024 (2,048 columns): 128 blocks, 64 steps."""
    assert ext._plan_totals(1, 128, 1024) == {"items": 64, "steps": 8, "threads": 256}
    assert ext._plan_totals(1, 1024, 2048) == {"items": 128, "steps": 64, "threads": 256}
    assert ext._plan_totals(3, 0, 17) == {"items": 6, "steps": 0, "threads": 256}
    assert ext._plan_totals(0, 5, 5)["items"] == 0


def test_resident_blocks_are_cached_per_block_size():
    """ResidentBlocks (cuda/cuda_util.h) caches the occupancy per (device, kernel, threads): the
    norm forward launches one kernel with 128, 256 or 512 threads, and an answer for one size
    must not cap another. A failed query is not cached."""
    asks = [(0, 7, 512), (0, 7, 128), (0, 7, 512), (1, 7, 128), (0, 8, 128), (0, 7, 0), (0, 7, 0)]
    answers, queries = ext._resident_cache_answers(asks)
    assert answers == [4, 16, 4, 16, 16, -1, -1]
    assert queries == 6  # every ask but the repeated (0, 7, 512)
