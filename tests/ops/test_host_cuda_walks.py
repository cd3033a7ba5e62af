"""The CUDA kernels' tile walks, run as the kernels themselves on the host.

The elementwise kernels (quantize) and the cast-transpose kernels walk their tensors in tiles that
the launch plan (cpp/common/launch_plan.h) spreads over a grid sized from the occupancy. Here the
unchanged kernels run on the host runtime (cpp/testing/host_cuda.h) for a device with one
resident block, three, and an H100's 132 x 8, over shapes that take every branch of the walks:
empty tensors and groups, one element, heads and tails shorter than a vector, groups of three
elements (vmap over 600 of them), rows not a multiple of 8 or 16, several matrices per scale.
Each run must give the reference's bits, and the runtime fails the launch if a thread makes a
misaligned access or two threads store the same byte (an element visited twice). Which chunks
are vector accesses is the plan's choice (the host compiler may split or merge accesses, so a
host run cannot count the GPU's): tests/ops/test_launch_plan.py checks it, with the plan's
arithmetic at sizes too large to run (more than 65,535 row tiles, more than 2**31 elements).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _host_cuda import EXT, NEEDS_EXT, on_host_cuda, on_the_cpu  # noqa: F401
from _shared import normal

from fp8jax import ops

pytestmark = [NEEDS_EXT, pytest.mark.usefixtures("on_the_cpu")]

E4M3 = jnp.float8_e4m3fn
# Devices by resident blocks: (SMs, blocks per SM, the device id ResidentBlocks caches them by).
DEVICES = {"1-block": (1, 1, 41), "3-blocks": (3, 1, 43), "h100": (132, 8, 44)}


def _bits(tree) -> list[bytes]:
    return [np.asarray(a).tobytes() for a in jax.tree.leaves(tree)]


def _kernel_equals_reference(monkeypatch, fn, *args, device="h100"):
    """fn(*args, implementation=...) on the host-run CUDA kernels: the reference's bits; returns
    the runtime's counters."""
    want = fn(*args, implementation="xla")
    sms, per_sm, dev = DEVICES[device]
    EXT.reset_stats()
    with on_host_cuda(monkeypatch, sms=sms, blocks_per_sm=per_sm, device=dev):
        got = jax.block_until_ready(fn(*args, implementation="kernel"))
    stats = EXT.stats()
    assert stats["launches"] > 0
    assert _bits(got) == _bits(want)
    return stats


def _grouped_quantize(x, scales, implementation):
    return jax.vmap(lambda a, s: ops.quantize(a, s, E4M3, implementation=implementation))(x, scales)


def _scales(groups: int) -> jax.Array:
    return jnp.asarray(2.0 ** (np.arange(groups) % 7 - 3), jnp.float32)


# ------------------------------------------------------------------- elementwise


@pytest.mark.parametrize("device", list(DEVICES))
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize(
    ("groups", "per_group"),
    [(1, 0), (3, 0), (1, 1), (1, 7), (1, 8), (1, 9), (1, 1001), (5, 13), (7, 8), (2, 20_000)],
    ids=str,
)
def test_quantize_walk_gives_the_reference(groups, per_group, dtype, device, monkeypatch):
    """Every element once (the runtime fails a second store), every scale_inv and amax written,
    also for empty groups, whatever grid the device's occupancy gives."""
    x = normal(groups * 31 + per_group, (groups, per_group), dtype, 3.0)
    _kernel_equals_reference(monkeypatch, _grouped_quantize, x, _scales(groups), device=device)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_quantize_vector_body_with_scalar_head_and_tail(dtype, monkeypatch):
    """Groups of 1,003: each starts where the last ended, so most start mid-vector: a scalar
    head, a vector body and a scalar tail per group (the plan's split, test_launch_plan.py)."""
    groups, n = 6, 1003
    x = normal(2, (groups, n), dtype, 3.0)
    _kernel_equals_reference(monkeypatch, _grouped_quantize, x, _scales(groups))


def test_quantize_walk_over_many_groups(monkeypatch):
    """vmap over 600 groups of 3 on a 3-block device: each block loops over 200 group tiles.
    (Beyond gridDim.y's 65,535 the walk is the same one-dimensional loop; the plan's index
    arithmetic there is test_launch_plan.py's. 5,000 groups took 135 s of CI's host run with
    coverage and tested nothing 600 do not.)"""
    groups = 600
    x = normal(4, (groups, 3), jnp.bfloat16, 3.0)
    stats = _kernel_equals_reference(
        monkeypatch, _grouped_quantize, x, _scales(groups), device="3-blocks"
    )
    assert stats["blocks"] == 3


# ---------------------------------------------------------------- cast_transpose


def _stacked_cast_transpose(x, scales, implementation):
    """cast_transpose of each matrix of x, with scales[i] for matrix i (vmap), or one scale for
    all (the grouped kernel's several matrices per group)."""
    fn = lambda a, s: ops.cast_transpose(a, s, E4M3, implementation=implementation)
    return jax.vmap(fn, in_axes=(0, 0 if scales.ndim else None))(x, scales)


@pytest.mark.parametrize(
    ("matrices", "rows", "cols", "device"),
    [
        (1, 4, 0, "1-block"),
        (1, 0, 16, "3-blocks"),
        (3, 0, 0, "h100"),
        (1, 1, 1, "1-block"),
        (1, 8, 8, "3-blocks"),
        (1, 64, 64, "h100"),
        (1, 65, 63, "1-block"),
        (2, 9, 130, "3-blocks"),
        (3, 13, 7, "h100"),
        (1, 200, 24, "1-block"),
        (4, 24, 200, "3-blocks"),
        (2, 256, 200, "h100"),  # fast tiles beside guarded ones
        (1, 300, 384, "3-blocks"),  # fast tiles above a partial row of tiles
    ],
    ids=str,
)
@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_cast_transpose_walk_gives_the_reference(matrices, rows, cols, device, dtype, monkeypatch):
    """q and q_t of every element once each, through the shared-memory tile."""
    x = normal(rows * 7 + cols, (matrices, rows, cols), dtype, 3.0)
    _kernel_equals_reference(
        monkeypatch, _stacked_cast_transpose, x, _scales(matrices), device=device
    )


@pytest.mark.parametrize(("rows", "cols"), [(4, 0), (0, 16), (40, 136)])
def test_several_matrices_per_scale(rows, cols, monkeypatch):
    """Six matrices under one scale (an unbatched scale in vmap): one scale_inv and one amax for
    the six, written also when the matrices are empty."""
    x = normal(9, (6, rows, cols), jnp.bfloat16, 3.0)
    _kernel_equals_reference(monkeypatch, _stacked_cast_transpose, x, jnp.float32(0.5))
