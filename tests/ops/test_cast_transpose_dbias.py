"""cast_transpose_dbias: cast_transpose's outputs bit for bit, plus deterministic column sums.

dbias is checked against the float64 column sums (within the float32 error bound of a sum of
``m`` terms) and, for the kernel, bit for bit against a numpy emulation of its documented
summation order (``docs/numerics.md``): groups of 8 rows, 128-row tiles of groups, then the tiles,
each in order from 0. That order does not depend on the number of threads, so matching it
bit for bit is the determinism check for any thread count.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from _dbias import assert_dbias_close, strip_order_sum
from _implementations import implementation_fixture, pytest_generate_tests  # noqa: F401
from _samples import BF16, E4M3, E5M2, F32, M, N, Sample, dyadic, scale_of
from _shared import normal
from _values import FP8_TYPES, assert_fp8_equal

from fp8jax import ops
from fp8jax.ops.casts.cast_transpose import grouped_cast_transpose_dbias

WIDE = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}
# (256, 264): fast tiles on a GPU; the others have guarded edges; (300, 520): several row tiles;
# (2200, 24): 18 row tiles, more than pass 2's 16 lanes.
SHAPES = [(1, 1), (7, 3), (8, 16), (64, 64), (65, 129), (128, 72), (256, 264), (300, 520)]
SHAPES += [(3, 4097), (2200, 24)]


def _g(shape, dtype, seed=0):
    return normal(seed, shape, dtype, 30.0)


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("wide", list(WIDE), ids=list(WIDE))
def test_matches_cast_transpose_and_column_sums(shape, wide, implementation):
    fp8 = FP8_TYPES[(SHAPES.index(shape) + list(WIDE).index(wide)) % 2]  # both, alternating
    g = _g(shape, WIDE[wide], seed=sum(shape))
    s = jnp.float32(0.7)
    q, qt, si, amax, dbias = ops.cast_transpose_dbias(g, s, fp8)
    wq, wqt, wsi, wamax = ops.cast_transpose(g, s, fp8)
    assert_fp8_equal(q, wq)
    assert_fp8_equal(qt, wqt)
    assert np.asarray(si).tobytes() == np.asarray(wsi).tobytes()
    assert np.asarray(amax).tobytes() == np.asarray(wamax).tobytes()
    assert dbias.shape == (shape[1],) and dbias.dtype == jnp.float32
    assert_dbias_close(dbias, g)
    if implementation == "kernel":
        np.testing.assert_array_equal(np.asarray(dbias), strip_order_sum(g))


def test_empty_and_degenerate():
    for shape in [(0, 5), (5, 0), (0, 0)]:
        g = jnp.zeros(shape, jnp.float32)
        q, qt, si, amax, dbias = ops.cast_transpose_dbias(g, jnp.float32(4), jnp.float8_e4m3fn)
        assert q.shape == shape and qt.shape == shape[::-1] and dbias.shape == (shape[1],)
        assert float(amax) == 0.0 and float(si) == 0.25
        np.testing.assert_array_equal(np.asarray(dbias), np.zeros(shape[1], np.float32))


def test_nonfinite_columns(implementation):
    """A NaN column sum is NaN; the kernels return it as 0x7FC00000 whatever the NaNs added
    (a negative NaN kept its sign on the CPU and not on a GPU before)."""
    g = np.ones((70, 5), np.float32)
    g[3, 1] = np.inf
    g[69, 2] = np.nan
    g[5, 4] = np.uint32(0xFFC00001).view(np.float32)  # a negative NaN with a payload
    dbias = ops.cast_transpose_dbias(jnp.asarray(g), jnp.float32(1), jnp.float8_e5m2)[4]
    got = np.asarray(dbias)
    assert got[0] == 70 and got[1] == np.inf and np.isnan(got[2]) and got[3] == 70
    assert np.isnan(got[4])
    if implementation == "kernel":
        assert got.view(np.uint32)[[2, 4]].tolist() == [0x7FC00000, 0x7FC00000]


def test_grouped_is_the_2d_op_on_the_view(implementation):
    """``grouped_cast_transpose_dbias(g[m, k, n])``: the bits of ``cast_transpose_dbias`` of
    ``g.reshape(m, k * n)``, reshaped to ``q [m, k, n]``, ``q_t [k, n, m]``, ``dbias [k, n]``."""
    from fp8jax.ops.casts.cast_transpose import grouped_cast_transpose_dbias

    g = _g((200, 3, 40), jnp.bfloat16, seed=11)
    s = jnp.float32(2.0)
    got = grouped_cast_transpose_dbias(g, s, jnp.float8_e4m3fn)
    want = ops.cast_transpose_dbias(g.reshape(200, 120), s, jnp.float8_e4m3fn)
    shapes = [(200, 3, 40), (3, 40, 200), (), (), (3, 40)]
    for a, w, shape in zip(got, want, shapes, strict=True):
        assert a.shape == shape
        assert np.asarray(a).tobytes() == np.asarray(w).reshape(shape).tobytes()
    with pytest.raises(ValueError, match="rank 3"):
        grouped_cast_transpose_dbias(g.reshape(200, 120), s, jnp.float8_e4m3fn)


def test_bad_input():
    with pytest.raises(ValueError, match="rank 2"):
        ops.cast_transpose_dbias(jnp.ones((2, 2, 2)), jnp.float32(1), jnp.float8_e4m3fn)


# ------------------------------------------------------------------ the conformance sample
# This op's entries in the conformance suite's table (tests/ops/_samples.py, tests/ops/
# test_conformance.py, tests/distributed/test_ops_conformance.py).


def _sample_cast_transpose_dbias(key):
    r = np.random.default_rng(key)
    return {
        "f32-e4m3": Sample(
            ops.cast_transpose_dbias, (dyadic(r, (M, N), F32), scale_of(30.0), E4M3), sums=(4,)
        ),
        "bf16-e5m2": Sample(
            ops.cast_transpose_dbias,
            (dyadic(r, (M, 40), BF16), scale_of(1.0, (1,)), E5M2),
            sums=(4,),
        ),
    }


def _sample_grouped_cast_transpose_dbias(key):
    r = np.random.default_rng(key)
    g = dyadic(r, (M, 3, 8), BF16)
    return {"bf16-e4m3": Sample(grouped_cast_transpose_dbias, (g, scale_of(4.0), E4M3), sums=(4,))}


SAMPLES = {
    "cast_transpose_dbias": _sample_cast_transpose_dbias,
    "grouped_cast_transpose_dbias": _sample_grouped_cast_transpose_dbias,
}
