"""cast_transpose: both outputs bit-identical to the reference, on every path of the kernel."""

from __future__ import annotations

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from _implementations import (  # noqa: F401
    implementation_fixture,
    pytest_generate_tests,
    reference_bits_promised,
)
from _samples import BF16, E4M3, E5M2, F32, M, N, Sample, fp8_codes, scale_of
from _shared import normal
from _values import (
    FP8_TYPES,
    all_16bit,
    assert_fp8_equal,
    assert_matches,
    oracle_quantize,
    special_values,
)
from conftest import on_cpu

from fp8jax import ops

# (8k, 8k) shapes take the vectorised 64x64-tile path on GPU; the others the general path.
WIDE = (jnp.float32, jnp.bfloat16, jnp.float16)
SHAPES = [(1, 1), (7, 3), (8, 16), (64, 64), (65, 129), (128, 72), (2, 3, 40, 24), (3, 17, 5)]


def _check(x: np.ndarray, scale: float, fp8, implementation: str) -> None:
    s = jnp.float32(scale)
    q, qt, s_inv, amax = ops.cast_transpose(jnp.asarray(x), s, fp8)
    _, rqt, rs_inv, ramax = on_cpu(ops.cast_transpose_reference, jnp.asarray(x), s, fp8)
    want = oracle_quantize(x, scale, fp8)
    assert_fp8_equal(q, want)
    assert_fp8_equal(qt, np.swapaxes(want, -1, -2))
    assert_fp8_equal(rqt, np.swapaxes(want, -1, -2))
    # NaN payloads included ("xla" on a GPU: any NaN payload)
    assert_matches(amax, ramax, reference_bits_promised(implementation))
    np.testing.assert_array_equal(np.asarray(s_inv), np.asarray(rs_inv))


@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize(
    "wide", [jnp.float32, jnp.bfloat16, jnp.float16], ids=["f32", "bf16", "f16"]
)
def test_cast_transpose_shapes(shape, wide, implementation):
    # Every tile path and dtype; the FP8 format alternates (test_cast_transpose_special_values
    # covers both exhaustively, test_conformance.py both on plain inputs).
    fp8 = FP8_TYPES[(SHAPES.index(shape) + WIDE.index(wide)) % 2]
    x = normal(sum(shape), shape, wide, 300.0)
    _check(np.asarray(x), 0.9, fp8, implementation)


@pytest.mark.parametrize("fp8", FP8_TYPES, ids=lambda t: t.__name__)
def test_cast_transpose_special_values(fp8, implementation):
    x = special_values(fp8)
    n = (x.size // 8) * 8
    with np.errstate(over="ignore", invalid="ignore"):
        _check(x[:n].reshape(8, -1), 1.0, fp8, implementation)
        _check(x[: n - 1].reshape(-1, 1), 1.0, fp8, implementation)


def test_cast_transpose_every_bf16_input(implementation):
    x = all_16bit(ml_dtypes.bfloat16).reshape(256, 256)
    with np.errstate(over="ignore", invalid="ignore"):
        _check(x, 1.0, ml_dtypes.float8_e4m3fn, implementation)


def test_cast_transpose_bad_input():
    with pytest.raises(ValueError, match="rank >= 2"):
        ops.cast_transpose(jnp.ones(8), jnp.float32(1), jnp.float8_e4m3fn)
    with pytest.raises(ValueError, match="scale must hold"):
        ops.cast_transpose(jnp.ones((2, 2)), jnp.ones(3, jnp.float32), jnp.float8_e4m3fn)


def test_amax_reduction_mesh_on_one_device_is_the_same():
    x = normal(0, (8, 16), jnp.bfloat16)
    s = jnp.float32(3.0)
    for op in (ops.cast_transpose, ops.quantize):
        for got, want in zip(
            op(x, s, jnp.float8_e4m3fn, amax_reduction="mesh"),
            op(x, s, jnp.float8_e4m3fn),
            strict=True,
        ):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


# ------------------------------------------------------------------ the conformance sample
# This op's entries in the conformance suite's table (tests/ops/_samples.py, tests/ops/
# test_conformance.py, tests/distributed/test_ops_conformance.py).


def _sample_cast_transpose(key):
    r = np.random.default_rng(key)
    return {
        "f32-e4m3": Sample(ops.cast_transpose, (normal(r, (M, N), F32, 300), scale_of(0.9), E4M3)),
        "bf16-e5m2-rank3": Sample(
            ops.cast_transpose, (normal(r, (M, 8, 9), BF16, 3e4), scale_of(0.5, (1,)), E5M2)
        ),
    }


def _sample_transpose(key):
    # finite codes (a vmapped FP8 result is sliced by XLA, which would change a NaN code's bits;
    # the tests above move every code, NaN included)
    r = np.random.default_rng(key)
    codes = lambda shape, dt: (
        fp8_codes(r, shape, dt)
        if dt != jnp.uint8
        else jnp.asarray(r.integers(0, 256, shape, np.uint8))
    )
    return {
        "e4m3-words": Sample(ops.transpose, (codes((64, 128), jnp.float8_e4m3fn),)),
        "u8-odd-rank3": Sample(ops.transpose, (codes((8, 37, 70), jnp.uint8),)),
        "e5m2-bytes": Sample(ops.transpose, (codes((M, 66), jnp.float8_e5m2),)),
    }


SAMPLES = {"cast_transpose": _sample_cast_transpose, "transpose": _sample_transpose}


# ------------------------------------------------------------------ transpose


@pytest.mark.parametrize("shape", [(1, 1), (16, 16), (64, 64), (65, 129), (2, 3, 130, 7)])
@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2, jnp.uint8])
def test_transpose_swaps_the_last_two_dims_of_the_codes(shape, dtype, implementation):
    bits = np.random.default_rng(0).integers(0, 256, shape, np.uint8)
    x = jnp.asarray(bits).view(dtype)
    got = ops.transpose(x, implementation=implementation)
    assert got.dtype == x.dtype and got.shape == (*shape[:-2], shape[-1], shape[-2])
    np.testing.assert_array_equal(np.asarray(got.view(jnp.uint8)), np.swapaxes(bits, -1, -2))


def test_transpose_refuses_wide_and_scalar_input():
    with pytest.raises(TypeError, match="transpose: x must be float8_e4m3fn, float8_e5m2 or uint8"):
        ops.transpose(jnp.ones((4, 4), jnp.bfloat16))
    with pytest.raises(ValueError, match="transpose: x must have rank >= 2"):
        ops.transpose(jnp.ones((4,), jnp.uint8))
