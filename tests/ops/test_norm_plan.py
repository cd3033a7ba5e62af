"""The CUDA norm kernels' launch planning (cpp/common/norm_plan.h), run on the host.

The test-only extension compiles the header the CUDA kernels use. Checked without a GPU: the
plans' block shapes, the backward's per-thread registers within their bound, its slots within
the workspace and independent of the device, and its parallelism on a 132-SM GPU. The kernels
themselves run on these plans' cases in tests/ops/test_host_cuda.py.
"""

from __future__ import annotations

import pytest
from conftest import load_testing_extension

from fp8jax.ops.fused.norm import NORM_WORKSPACE_SLOTS, norm_workspace_slots

ext = load_testing_extension()
RESIDENT = 132 * 4


CASES = [(1, 768), (3, 1000), (37, 4097), (5, 8), (2, 1), (300, 64), (7, 8192), (1000, 128)]


@pytest.mark.parametrize("resident", [1, RESIDENT])
@pytest.mark.parametrize("elem_bytes", [2, 4])
@pytest.mark.parametrize(("rows", "h"), CASES)
def test_forward_plan(rows, h, elem_bytes, resident):
    aligned = (h * elem_bytes) % 16 == 0
    plan = ext._plan_norm(rows, h, elem_bytes, aligned, resident, 0)
    assert plan["vec"] == 16 // elem_bytes and plan["vector"] == aligned
    assert plan["threads"] % plan["threads_per_row"] == 0 and plan["threads"] <= 512
    assert plan["threads_per_row"] in (32, 64, 128, 256, 512)
    assert 1 <= plan["grid"] <= max(resident, 1)
    assert plan["chunks"] == -(-h // plan["vec"])
    assert plan["chunks_per_thread"] * plan["threads_per_row"] >= plan["chunks"]


@pytest.mark.parametrize("elem_bytes", [2, 4])
@pytest.mark.parametrize(("rows", "h"), CASES)
def test_backward_slots_and_registers(rows, h, elem_bytes):
    aligned = (h * elem_bytes) % 16 == 0
    plan = ext._plan_norm(rows, h, elem_bytes, aligned, 0, NORM_WORKSPACE_SLOTS)
    assert plan["backward_ok"]
    assert plan["slots"] <= NORM_WORKSPACE_SLOTS and plan["workspace_fits"]
    assert plan["slots"] == plan["grid"] * plan["rows_per_cta"]
    assert plan["chunks_per_thread"] * plan["vec"] <= 16  # the column sums' registers
    # The device's occupancy does not enter the backward's plan (deterministic partials).
    assert plan == ext._plan_norm(rows, h, elem_bytes, aligned, RESIDENT, NORM_WORKSPACE_SLOTS)


def test_a_workspace_smaller_than_the_plan_is_reported():
    """The CUDA handler refuses a workspace with fewer slots than the plan's blocks hold row
    groups (a direct FFI call; fp8jax passes NORM_WORKSPACE_SLOTS): 4 groups of 32 threads per
    block for h = 64, so 1 to 3 slots cannot hold even one block."""
    for ws in (1, 2, 3):
        plan = ext._plan_norm(1000, 64, 2, True, 0, ws)
        assert plan["slots"] == 4 and not plan["workspace_fits"]
    assert ext._plan_norm(1000, 64, 2, True, 0, 4)["workspace_fits"]
    assert ext._plan_norm(1000, 64, 2, True, 0, NORM_WORKSPACE_SLOTS)["workspace_fits"]


@pytest.mark.parametrize("h", [128, 256, 512, 1024, 2048, 4096, 8192])
def test_backward_fills_a_132_sm_gpu(h):
    """16,384 bfloat16 rows: the workspace the op passes lets the backward run at least 1,024
    warps (about 8 per SM of an H100; with 256 slots it ran 256 warps for h <= 1,024), each row
    group summing at most 16 rows where h <= 2,048, with at most 16 MiB of partial rows."""
    rows = 16384
    slots = norm_workspace_slots(rows, h)
    assert slots * 2 * h * 4 <= 16 << 20
    plan = ext._plan_norm(rows, h, 2, True, 0, slots)
    assert plan["workspace_fits"] and plan["backward_ok"]
    assert plan["grid"] * plan["threads"] >= 32 * 1024
    if h <= 2048:
        assert -(-rows // plan["slots"]) <= 16
    # The slot count depends on the shapes only (the same on every device and every shard).
    assert norm_workspace_slots(1, h) == NORM_WORKSPACE_SLOTS
    assert norm_workspace_slots(rows, h) == slots


def test_backward_limit_is_reported():
    assert ext._plan_norm(4, 8192, 2, True, 0, NORM_WORKSPACE_SLOTS)["backward_ok"]
    assert not ext._plan_norm(4, 8200, 2, True, 0, NORM_WORKSPACE_SLOTS)["backward_ok"]


def test_bad_arguments():
    with pytest.raises(ValueError, match="elem_bytes"):
        ext._plan_norm(1, 8, 3, False, 1, 0)
