"""The CPU kernels on inputs large enough to take their threaded, vectorised paths.

The CPU kernels split a tensor into chunks of 2^16 elements over XLA's intra-op thread pool and
quantize in blocks of 512 with a vectorised loop, falling back to the scalar code for a block that
holds a non-finite product; cast_transpose works in strips of 64 rows with 16 x 16 register
transposes. The other tests use small inputs; these put the special values (every tie, NaN, inf,
subnormal, overflow) at random places of tensors of several chunks, with odd shapes, several
groups (vmap) whose boundaries fall inside a chunk, and compare bit for bit with the references
run on the CPU (on a GPU, with the CUDA kernels' own tiling, the same promise holds; float32
subnormals aside, which follow the platform: see ``test_dequantize_large``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _shared import normal
from _values import (
    FP8_TYPES,
    assert_fp8_equal,
    assert_wide_equal,
    oracle_dequantize,
    special_values,
)
from conftest import on_cpu

from fp8jax import ops
from fp8jax.ops.casts.cast_transpose import cast_transpose_reference
from fp8jax.ops.casts.quantize import dequantize_reference, quantize_reference


def _wide_equal(got, want) -> None:
    assert_wide_equal(np.atleast_1d(np.asarray(got)), np.atleast_1d(np.asarray(want)))


def _input(shape: tuple[int, ...], fp8, wide, seed: int) -> np.ndarray:
    """Normal values with the special values scattered at random places."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * 100.0).astype(np.float32).reshape(-1)
    sv = special_values(fp8)
    where = rng.choice(x.size, size=min(x.size // 4, 4 * sv.size), replace=False)
    x[where] = np.resize(sv, where.size)
    return np.asarray(jnp.asarray(x.reshape(shape)).astype(wide))


def _no_special(shape: tuple[int, ...], wide, seed: int) -> np.ndarray:
    """Only finite normal values: every block takes the vectorised path."""
    return np.asarray(normal(seed, shape, wide, 3.0))


@pytest.mark.parametrize("fp8", FP8_TYPES, ids=lambda t: t.__name__)
@pytest.mark.parametrize("wide", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("special", [True, False], ids=["special", "finite"])
def test_quantize_and_cast_transpose_large(fp8, wide, special):
    shape = (517, 1031)  # 533k elements: 9 chunks, ragged strips and 16 x 16 blocks
    x = _input(shape, fp8, wide, 1) if special else _no_special(shape, wide, 1)
    scale = jnp.float32(1.0) if special else jnp.float32(7.5)
    q, s_inv, amax = ops.quantize(x, scale, fp8)
    rq, rs_inv, ramax = on_cpu(quantize_reference, jnp.asarray(x), scale, fp8)
    assert_fp8_equal(q, rq)
    _wide_equal(s_inv, rs_inv)
    _wide_equal(amax, ramax)
    c, ct, cs_inv, camax = ops.cast_transpose(x, scale, fp8)
    want = on_cpu(cast_transpose_reference, jnp.asarray(x), scale, fp8)
    assert_fp8_equal(c, want[0])
    assert_fp8_equal(ct, want[1])
    _wide_equal(cs_inv, want[2])
    _wide_equal(camax, want[3])


@pytest.mark.parametrize("fp8", FP8_TYPES, ids=lambda t: t.__name__)
@pytest.mark.parametrize("wide", [jnp.float32, jnp.bfloat16], ids=["f32", "bf16"])
def test_dequantize_large(fp8, wide):
    codes = np.random.default_rng(2).integers(0, 256, size=(301, 1111), dtype=np.uint8)
    q = jnp.asarray(codes.view(fp8))
    for si in (0.125, 3e-39, -2.0, float("inf")):
        s_inv = jnp.float32(si)
        # Subnormals follow the platform (docs/numerics.md): XLA:CPU flushes them (the reference
        # on the CPU and the CPU kernel alike), so 3e-39 counts as 0 there; a GPU keeps them, as
        # the numpy oracle does.
        if jax.default_backend() == "cpu":
            want = on_cpu(dequantize_reference, q, s_inv, wide)
        else:
            want = oracle_dequantize(codes.view(fp8), si, wide)
        assert_wide_equal(ops.dequantize(q, s_inv, wide), want)


@pytest.mark.parametrize("fp8", FP8_TYPES, ids=lambda t: t.__name__)
def test_vmapped_groups_cross_chunks(fp8):
    # 7 groups of 3 x 13 x 1001 (39k elements): group boundaries fall inside the 64k chunks, and
    # each group keeps its own scale and amax.
    x = _input((7, 3, 13, 1001), fp8, jnp.bfloat16, 3)
    scales = jnp.asarray([0.5, 1.0, 2.0, 1e-3, 4.0, 1e3, 0.75], jnp.float32)
    for op, ref in (
        (ops.quantize, quantize_reference),
        (ops.cast_transpose, cast_transpose_reference),
    ):
        got = jax.vmap(lambda v, s, op=op: op(v, s, fp8))(jnp.asarray(x), scales)
        want = on_cpu(jax.vmap(lambda v, s, ref=ref: ref(v, s, fp8)), jnp.asarray(x), scales)
        for g, w in zip(got, want, strict=True):
            if g.dtype == jnp.float32:
                _wide_equal(g, w)
            else:
                assert_fp8_equal(g, w)
    q = on_cpu(quantize_reference, jnp.asarray(x), jnp.float32(1.0), fp8)[0]
    got = jax.vmap(lambda v, s: ops.dequantize(v, s, jnp.bfloat16))(q, scales)
    want = on_cpu(jax.vmap(lambda v, s: dequantize_reference(v, s, jnp.bfloat16)), q, scales)
    assert_wide_equal(got, want)
