"""Shapes that broke the CUDA kernels (issue 9), run on the default backend against the reference.

Here (no GPU) they exercise the CPU kernels; on a GPU machine the same tests run the CUDA kernels,
whose launch planning for exactly these shapes is also checked on the host by
test_launch_plan.py: empty matrices (scale_inv still written), more than 65535 vmapped groups,
more than 65535 64-row tiles, per-group sizes that are not a multiple of 8, and matrices with both
fast (128 x 128 interior) and guarded (edge) tiles.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _shared import normal
from _values import assert_fp8_equal
from conftest import on_cpu

from fp8jax import ops

E4M3 = jnp.float8_e4m3fn


def _x(shape, dtype, seed=0):
    return normal(seed, shape, dtype, 3.0)


@pytest.mark.parametrize("shape", [(4, 0), (0, 16), (3, 4, 0), (2, 0, 16)])
def test_cast_transpose_empty_writes_scale_inv(shape):
    x = jnp.zeros(shape, jnp.bfloat16)
    scale = jnp.float32(4.0)
    q, q_t, scale_inv, amax = ops.cast_transpose(x, scale, E4M3)
    assert q.shape == shape and q_t.shape == (*shape[:-2], shape[-1], shape[-2])
    assert float(scale_inv) == 0.25
    assert float(amax) == 0.0


def test_cast_transpose_empty_vmapped_groups():
    x = jnp.zeros((3, 4, 0), jnp.float32)
    scales = jnp.array([1.0, 2.0, 8.0], jnp.float32)
    _, _, scale_inv, amax = jax.vmap(lambda a, s: ops.cast_transpose(a, s, E4M3))(x, scales)
    np.testing.assert_array_equal(np.asarray(scale_inv), [1.0, 0.5, 0.125])
    np.testing.assert_array_equal(np.asarray(amax), [0.0, 0.0, 0.0])


@pytest.mark.parametrize("per_group", [3, 13])
def test_quantize_more_than_65535_vmapped_groups(per_group):
    groups = 70_000
    x = _x((groups, per_group), jnp.bfloat16)
    scales = jnp.linspace(0.5, 4.0, groups, dtype=jnp.float32)

    def run(a, s):
        return jax.vmap(lambda xi, si: ops.quantize(xi, si, E4M3))(a, s)

    def ref(a, s):
        return jax.vmap(lambda xi, si: ops.quantize_reference(xi, si, E4M3))(a, s)

    q, scale_inv, amax = run(x, scales)
    rq, rsi, ramax = on_cpu(ref, x, scales)
    assert_fp8_equal(q, rq)
    np.testing.assert_array_equal(np.asarray(scale_inv), np.asarray(rsi))
    np.testing.assert_array_equal(np.asarray(amax), np.asarray(ramax))
    out = jax.vmap(lambda qi, si: ops.dequantize(qi, si, jnp.bfloat16))(q, scale_inv)
    rout = on_cpu(jax.vmap(lambda qi, si: ops.dequantize_reference(qi, si, jnp.bfloat16)), rq, rsi)
    np.testing.assert_array_equal(np.asarray(out).view(np.uint16), np.asarray(rout).view(np.uint16))


@pytest.mark.parametrize(
    ("shape", "dtype"),
    [
        ((4_194_305, 4), jnp.bfloat16),  # 65537 row tiles of 64: past gridDim.y's old limit
        ((3, 65, 63), jnp.float32),  # odd sizes, guarded tiles only
        ((2, 256, 384), jnp.bfloat16),  # fast 128 x 128 tiles only
        ((256, 200), jnp.float16),  # fast interior tiles + guarded edge tiles
        ((5, 1003), jnp.float32),  # rows not a multiple of 8
    ],
)
def test_cast_transpose_shapes(shape, dtype):
    x = _x(shape, dtype, seed=1)
    scale = jnp.float32(2.0)
    got = ops.cast_transpose(x, scale, E4M3)
    want = on_cpu(ops.cast_transpose_reference, x, scale, E4M3)
    assert_fp8_equal(got[0], want[0])
    assert_fp8_equal(got[1], want[1])
    assert float(got[2]) == float(want[2])
    assert float(got[3]) == float(want[3])
