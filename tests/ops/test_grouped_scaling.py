"""fp8jax.ops.block.grouped_scaling: the casts of a mixture of experts' ragged operands, bit for bit
against the per-tensor and block casts applied to each group on its own (the definition: a
group's rows, or a segment of columns, is cast as a tensor of its own)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _implementations import implementation_fixture, pytest_generate_tests  # noqa: F401
from _samples import M, N, Sample, fp8_codes

from fp8jax import ops
from fp8jax.ops.block.grouped_scaling import local_group_sizes, segment_grid_size

E4M3, E5M2, F32, BF16 = jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.float32, jnp.bfloat16
SIZES = [[5, 0, 17, 1], [0, 23, 0, 0], [3, 4, 5, 6], [0, 0, 0, 0]]  # over 23 rows


def _x(rows, cols, seed=0, dtype=F32):
    r = np.random.default_rng(seed)
    mag = np.exp(2 * r.standard_normal((rows, 1)))  # groups of very different magnitudes
    return jnp.asarray(r.standard_normal((rows, cols)) * mag, dtype)


@pytest.mark.parametrize("sizes", SIZES)
@pytest.mark.parametrize("dtype", [E4M3, E5M2])
@pytest.mark.parametrize("wide", [F32, BF16])
def test_grouped_quantize_is_quantize_per_group(sizes, dtype, wide):
    x = _x(23, 37, dtype=wide)
    x = x.at[4, 2].set(jnp.nan)  # a NaN in group 0's rows: its amax is NaN
    scale = jnp.asarray([0.5, 3.0, 17.0, 1.0 / 3.0], F32)
    q, sinv, amax = ops.grouped_quantize(x, jnp.asarray(sizes, jnp.int32), scale, dtype)
    q = _bits(q)  # sliced as bytes: XLA:CPU slices FP8 through float32 (E5M2's NaN 0x7E -> 0x7F)
    start = 0
    for g, s in enumerate(sizes):
        part = x[start : start + s]
        wq, ws, wa = ops.quantize_reference(part, scale[g], dtype)
        np.testing.assert_array_equal(q[start : start + s], _bits(wq))
        np.testing.assert_array_equal(sinv[g], ws)
        np.testing.assert_array_equal(amax[g], wa if s else 0.0)
        start += s
    assert not q[start:].any()


def _bits(q):
    return np.asarray(jax.lax.bitcast_convert_type(q, jnp.uint8))


def _segment_oracle(x, sizes, width, cast):
    """Each group's columns cast on their own (``cast(part) -> (q, grid)``), concatenated; the
    unused grid entries those of an all-zero block."""
    qs, grids = [], []
    start = 0
    for s in sizes:
        if s:
            q, grid = cast(x[:, start : start + s])
            qs.append(np.asarray(jax.lax.bitcast_convert_type(q, jnp.uint8)))
            grids.append(np.asarray(grid, np.float32))
        start += s
    rows = x.shape[0]
    q = np.zeros((rows, x.shape[1]), np.uint8)
    if qs:
        q[:, :start] = np.concatenate(qs, axis=1)
    nb = segment_grid_size(x.shape[1], len(sizes), width)
    empty = np.asarray(cast(jnp.zeros((rows, width), x.dtype))[1], np.float32)
    grid = np.broadcast_to(empty, (rows, nb)).copy()
    if grids:
        used = np.concatenate(grids, axis=1)
        grid[:, : used.shape[1]] = used
    return q, grid


CASTS = {
    "1x128-pow2": (128, lambda v: ops.block_quantize(v, E4M3, (1, 128))),
    "1x128-f32": (128, lambda v: ops.block_quantize(v, E4M3, (1, 128), power_2_scale=False)),
    "mxfp8": (32, lambda v: ops.mxfp8_quantize(v, E4M3, (1, 32))),
}


@pytest.mark.parametrize("sizes", [[100, 0, 170, 29, 0], [1, 130, 0, 2, 127], [300, 0, 0, 0, 0]])
@pytest.mark.parametrize("cast", list(CASTS))
def test_segment_blocks_are_each_groups_own_blocks(sizes, cast):
    width, fn = CASTS[cast]
    x = _x(9, 310, seed=1).T.T  # 9 rows, 310 columns (the ragged dim)
    gs = jnp.asarray(sizes, jnp.int32)
    kw = dict(mxfp8=True) if cast == "mxfp8" else dict(power_2_scale=cast.endswith("pow2"))
    q, grid = ops.segment_block_quantize(x, gs, E4M3, (1, width), **kw)
    want_q, want_grid = _segment_oracle(x, sizes, width, fn)
    np.testing.assert_array_equal(np.asarray(jax.lax.bitcast_convert_type(q, jnp.uint8)), want_q)
    np.testing.assert_array_equal(np.asarray(grid, np.float32), want_grid)
    back = ops.segment_block_dequantize(q, grid, gs, (1, width))
    start = 0
    for s in sizes:  # the inverse is each group's own block dequantize
        if s:
            part_q, part_s = fn(x[:, start : start + s])
            np.testing.assert_array_equal(
                back[:, start : start + s], ops.block_dequantize(part_q, part_s, (1, width))
            )
        start += s
    assert not np.asarray(back[:, start:]).any()


def test_segment_grid_size_is_the_most_any_sizes_need():
    for rows, groups, width in [(310, 5, 128), (7, 3, 32), (128, 1, 128), (0, 2, 32)]:
        nb = segment_grid_size(rows, groups, width)
        r = np.random.default_rng(rows)
        for _ in range(200):
            cuts = np.sort(r.integers(0, rows + 1, groups - 1))
            sizes = np.diff(
                np.concatenate([[0], cuts, [r.integers(cuts[-1] if groups > 1 else 0, rows + 1)]])
            )
            assert sum(-(-int(s) // width) for s in sizes) <= nb


def test_local_group_sizes_are_the_groups_within_a_devices_rows():
    sizes = np.array([5, 0, 9, 3])
    ends = np.cumsum(sizes)
    for start in range(0, 20, 4):
        got = local_group_sizes(jnp.asarray(sizes, jnp.int32), jnp.int32(start), 4)
        rows = np.arange(start, start + 4)
        want = [int(np.sum((rows >= e - s) & (rows < e))) for s, e in zip(sizes, ends, strict=True)]
        assert got.tolist() == want


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (
            lambda: ops.grouped_quantize(
                jnp.ones((4, 2)), jnp.asarray([3, 2], jnp.int32), jnp.ones((2,)), E4M3
            ),
            ValueError,
            "sum to 5",
        ),
        (
            lambda: ops.grouped_quantize(
                jnp.ones((4, 2)), jnp.asarray([3], jnp.int32), jnp.ones((2,)), E4M3
            ),
            ValueError,
            "scale must be",
        ),
        (
            lambda: ops.grouped_quantize(
                jnp.ones((4, 2), jnp.int32), jnp.asarray([3], jnp.int32), jnp.ones((1,)), E4M3
            ),
            TypeError,
            "x must be",
        ),
        (
            lambda: ops.segment_block_quantize(
                jnp.ones((4, 2)), jnp.asarray([3], jnp.int32), E4M3, (2, 128)
            ),
            ValueError,
            r"block must be \(1, width\)",
        ),
        (
            lambda: ops.segment_block_quantize(jnp.ones((4,)), jnp.asarray([3], jnp.int32), E4M3),
            ValueError,
            "x must be a matrix",
        ),
    ],
)
def test_bad_arguments_are_named(call, error, match):
    with pytest.raises(error, match=match):
        call()


# ------------------------------------------------------------------ transpose_padded


def _padded_oracle(bits: np.ndarray, sizes, width: int) -> np.ndarray:
    """numpy: each group's rows of ``bits [M, N]`` as columns starting at a multiple of
    ``width`` of an all-zero ``[N, segment_grid_size(M, G, width) * width]``."""
    rows = bits.shape[0]
    out = np.zeros((bits.shape[1], segment_grid_size(rows, len(sizes), width) * width), np.uint8)
    begin, start = 0, 0
    for size in sizes:
        n = min(begin + max(int(size), 0), rows) - begin
        out[:, start : start + n] = bits[begin : begin + n].T
        begin, start = begin + n, start + -(-n // width) * width
    return out


@pytest.mark.parametrize("sizes", [*SIZES, [30, -4, 30, 9]])  # the last: negative, past the sum
@pytest.mark.parametrize("width", [1, 16, 128])
@pytest.mark.parametrize("dtype", [E4M3, E5M2, jnp.uint8])
def test_transpose_padded_puts_each_groups_rows_at_a_multiple_of_width(
    sizes, width, dtype, implementation
):
    bits = np.random.default_rng(width).integers(0, 256, (23, 37), np.uint8)
    x = jnp.asarray(bits).view(dtype)
    # traced sizes: a negative one and a sum past the rows are clamped, not refused
    got = jax.jit(lambda s: ops.transpose_padded(x, s, width, implementation=implementation))(
        jnp.asarray(sizes, jnp.int32)
    )
    assert got.dtype == x.dtype
    np.testing.assert_array_equal(
        np.asarray(got.view(jnp.uint8)), _padded_oracle(bits, sizes, width)
    )


def test_transpose_padded_takes_one_size_row_per_matrix(implementation):
    bits = np.random.default_rng(1).integers(0, 256, (2, 3, 19, 40), np.uint8)
    sizes = np.asarray([[[19, 0]], [[0, 19]], [[4, 9]]] * 2, np.int32).reshape(2, 3, 2)
    got = ops.transpose_padded(
        jnp.asarray(bits), jnp.asarray(sizes), 16, implementation=implementation
    )
    for i in np.ndindex(2, 3):
        np.testing.assert_array_equal(np.asarray(got[i]), _padded_oracle(bits[i], sizes[i], 16))


def _tp(x=None, sizes=(4,), width=16, dtype=jnp.uint8):
    x = jnp.ones((4, 4), dtype) if x is None else x
    sizes = sizes if hasattr(sizes, "dtype") else jnp.asarray(sizes, jnp.int32)
    return lambda: ops.transpose_padded(x, sizes, width)


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (_tp(dtype=F32), TypeError, "x must be float8_e4m3fn, float8_e5m2 or uint8"),
        (_tp(jnp.ones((4,), jnp.uint8)), ValueError, "x must have rank >= 2"),
        (_tp(width=0), ValueError, "width must be a positive int"),
        (_tp(sizes=jnp.asarray([4.0])), TypeError, "group_sizes must be int32"),
        (_tp(jnp.ones((2, 4, 4), jnp.uint8)), ValueError, r"group_sizes must be \[..., G\] with x"),
        (_tp(sizes=(3, 2)), ValueError, "group_sizes sum to 5, more than the 4 rows of x"),
    ],
)
def test_transpose_padded_names_a_bad_argument(call, error, match):
    with pytest.raises(error, match=match):
        call()


def _sample_transpose_padded(key):
    r = np.random.default_rng(key)
    codes = lambda shape, dt: fp8_codes(r, shape, dt)  # finite: see test_cast_transpose's sample
    sizes = jnp.asarray([3, 0, 9, 2], jnp.int32)  # over M = 16 rows: two past the sum
    return {
        "e4m3-16": Sample(
            ops.transpose_padded, (codes((M, N), E4M3), sizes, 16), integer=("group_sizes",)
        ),
        "e5m2-5": Sample(
            ops.transpose_padded, (codes((M, 2 * N), E5M2), sizes, 5), integer=("group_sizes",)
        ),
    }


SAMPLES = {"transpose_padded": _sample_transpose_padded}
