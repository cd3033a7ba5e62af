"""The CUDA kernels' launch planning (cpp/common/launch_plan.h), run on the host.

The test-only extension (``fp8jax._fp8jax_testing``) compiles the same header the CUDA kernels
use and exposes it as private ``_plan_*`` functions. The tests check the plans' arithmetic
without a GPU, also at sizes too large to run: grids never zero nor above the resident blocks,
vector chunks only where aligned, no grid-dimension limit (more than 65535 row tiles or vmapped
groups, more than 2**31 elements: all int64). The kernels themselves walk these plans in
tests/ops/test_host_cuda_walks.py, run on the host.
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
    """The chunks of 100 elements at these addresses (fake ones: XLA's buffers are aligned, so
    the host runs of the kernels cannot show these) cover each element once; a vector chunk
    only where both pointers are aligned for it."""
    wide, narrow = BASE + wide_off, 2 * BASE + narrow_off
    s = ext._plan_split_chunks(wide, wide_bytes, narrow, 100)
    assert s["vector"] is vector
    assert -7 <= s["start"] <= 0
    visits = np.zeros(100, np.int64)
    vectors = 0
    for c in range(s["chunks"]):
        chunk = ext._plan_chunk_at(wide, wide_bytes, narrow, 100, c)
        visits[chunk["first"] : chunk["first"] + chunk["count"]] += 1
        if chunk["vector"]:
            vectors += 1
            assert chunk["count"] == 8
            assert (wide + chunk["first"] * wide_bytes) % 16 == 0
            assert (narrow + chunk["first"]) % 8 == 0
    np.testing.assert_array_equal(visits, np.ones(100, np.int64))
    assert (vectors > 0) is vector


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


def _tile_chunks(rows, cols, offs=(0, 0, 0), tile=0, matrices=1, wide_bytes=2):
    """Thread 0's first load and store chunks of tile `tile`, and whether it is a fast tile."""
    addrs = (BASE + offs[0], 2 * BASE + offs[1], 3 * BASE + offs[2])
    return ext._plan_transpose_chunks(rows, cols, wide_bytes, *addrs, tile, matrices, 0, 0, 0)


def test_cast_transpose_empty_plans_one_block():
    """No tile has work, but the kernel is still launched: it writes every group's scale_inv."""
    for matrices, rows, cols in [(1, 4, 0), (1, 0, 16), (3, 0, 0), (0, 4, 16)]:
        plan = ext._plan_cast_transpose(matrices, rows, cols, RESIDENT)
        assert plan["tiles"] == 0 and plan["grid"] == 1


def _vector_elements(rows, cols):
    """Elements of a bfloat16 [rows, cols] (one tile or less) that the guarded tile's plan moves
    in vector chunks, (loads of x and q, stores of q_t); each vector chunk whole and aligned."""
    loads = stores = 0
    for sub in range(4):
        for t in range(256):
            for p in range(2):
                c = ext._plan_transpose_chunks(rows, cols, 2, BASE, 2 * BASE, 3 * BASE, 0, 1,
                                               sub, t, p)  # fmt: skip
                for kind, addr, width in (("load", BASE, 2), ("store", 3 * BASE, 1)):
                    chunk = c[kind]
                    if chunk["vector"]:
                        assert chunk["count"] == 8
                        assert (addr + chunk["offset"] * width) % (8 * width) == 0
                        if kind == "load":
                            assert (2 * BASE + chunk["offset"]) % 8 == 0  # q
                            loads += 8
                        else:
                            stores += 8
    return loads, stores


def test_guarded_tile_vector_chunks():
    """Rows and columns multiples of 8: x, q and q_t all in vectors. 61 rows: the loads stay
    vectors; q_t's rows (61 bytes) start 8-byte aligned only in every 8th column, whose 7 whole
    chunks are vectors. 100 columns: q_t's 64-byte rows all vectors; x's rows (200 bytes) start
    16-byte aligned only on even rows, whose 12 whole chunks are vectors."""
    assert _vector_elements(64, 128) == (64 * 128, 64 * 128)
    assert _vector_elements(61, 128) == (61 * 128, 16 * 56)
    assert _vector_elements(64, 100) == (32 * 96, 64 * 100)


def test_cast_transpose_misaligned_pointers():
    """Fake misaligned addresses (XLA's buffers never are): every chunk is scalar; 16 bytes of
    alignment suffice for float32's vector loads."""
    chunk = _tile_chunks(64, 64, offs=(4, 1, 3), wide_bytes=4)
    assert not chunk["load"]["vector"] and not chunk["store"]["vector"]
    chunk = _tile_chunks(64, 64, offs=(16, 8, 8), wide_bytes=4)
    assert chunk["load"]["vector"] and chunk["store"]["vector"]


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
    with pytest.raises(ValueError, match="matrices"):
        ext._plan_cast_transpose(-1, 8, 8, RESIDENT)


# ------------------------------------------------- cast_transpose fast path (128 x 128 tiles)


def test_transpose8x8_matches_numpy():
    rng = np.random.default_rng(0)
    for _ in range(100):
        m = rng.integers(0, 256, size=(8, 8), dtype=np.uint8)
        words = [int(w) for w in m.view("<u8").reshape(8)]
        got = np.array(ext._plan_transpose8x8(words), dtype="<u8").view(np.uint8).reshape(8, 8)
        np.testing.assert_array_equal(got, m.T)


def _fast_tiles(matrices, rows, cols, offs=(0, 0, 0)):
    plan = ext._plan_cast_transpose(matrices, rows, cols, RESIDENT)
    return [_tile_chunks(rows, cols, offs, t, matrices)["fast"] for t in range(plan["tiles"])]


def test_fast_path_interior_tiles():
    """Aligned, rows % 16 == 0, cols % 8 == 0: every whole 128 x 128 tile takes the fast path
    (its shared-memory accesses are bank-conflict free: test_host_cuda.py counts them)."""
    assert _fast_tiles(2, 256, 384) == [True] * 12
    # 2 x 2 tiles per matrix, the right column partial: 2 fast tiles per matrix.
    assert _fast_tiles(4, 256, 200) == [True, False, True, False] * 4


@pytest.mark.parametrize(
    ("rows", "cols", "offs"),
    [(200, 256, (0, 0, 0)), (256, 252, (0, 0, 0)), (256, 256, (0, 0, 8)), (256, 256, (16, 4, 0))],
)
def test_fast_path_needs_alignment(rows, cols, offs):
    """Needs rows % 16, cols % 8, 16-byte x and q_t, 8-byte q; else every tile is guarded."""
    assert not any(_fast_tiles(1, rows, cols, offs))


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
