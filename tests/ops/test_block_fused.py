"""The fused block-scaled casts (fp8jax/ops/fused/block_fused.py): each equals its unfused chain
bit for bit within one implementation, dbias in the kernels' fixed order (the same bits as
cast_transpose_dbias's), plus the argument checks. On a GPU only the kernels promise that
(XLA:GPU keeps values in float32 across the chain's roundings and has its own transcendentals).
The conformance samples below put the three ops through the CPU kernel, vmap, the CUDA kernel
run on the host and 8 devices."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _dbias import assert_dbias_close, strip_order_sum
from _implementations import reference_bits_promised
from _samples import ACT_CLOSE, BF16, F16, F32, F32_SCALE_GPU_CLOSE, NORM_CLOSE, Sample, dyadic
from _shared import normal

from fp8jax import ops

E4M3, E5M2 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)
WIDE = [jnp.float32, jnp.bfloat16, jnp.float16]
# (block, fused dbias op, unfused cast) for the three block kinds of the recipes
KINDS = {
    "1x128": ((1, 128), ops.block_cast_transpose_dbias, ops.block_cast_transpose),
    "128x128": ((128, 128), ops.block_cast_transpose_dbias, ops.block_cast_transpose),
    "mxfp8": ((1, 32), ops.mxfp8_cast_transpose_dbias, ops.mxfp8_cast_transpose),
}


def _heavy(r, shape, dtype, spread=2.0):
    """Normal values times a log-normal spread of magnitudes; ``r``: a Generator or a seed."""
    r = np.random.default_rng(r)
    x = r.standard_normal(shape) * np.exp(r.standard_normal(shape) * spread)
    return jnp.asarray(x.astype(np.float32), dtype)


def _bits(a):
    a = np.asarray(a)
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a


# The implementations whose fused op must equal its unfused chain bit for bit on this backend.
EXACT_IMPLS = tuple(i for i in ("xla", "kernel") if reference_bits_promised(i))  # kernel last


def _assert_same(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_array_equal(_bits(g), _bits(w))


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("dtype", WIDE, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", [(300, 260), (1, 40), (128, 128), (2200, 24)], ids=str)
def test_dbias_form_equals_the_cast_and_the_kernels_column_sums(kind, dtype, shape):
    block, fused, cast = KINDS[kind]
    g = _heavy(sum(shape), shape, dtype)
    for impl in EXACT_IMPLS:
        *casts, dbias = fused(g, E4M3, block, implementation=impl)
        _assert_same(casts, cast(g, E4M3, block, implementation=impl))
        assert dbias.shape == (shape[1],) and dbias.dtype == jnp.float32
        assert_dbias_close(dbias, g)
    # the kernel's order: the bits of strip_order_sum and of cast_transpose_dbias's dbias
    np.testing.assert_array_equal(np.asarray(dbias), strip_order_sum(g))
    ct = ops.cast_transpose_dbias(g, jnp.float32(1), E4M3, implementation="kernel")
    np.testing.assert_array_equal(np.asarray(dbias), np.asarray(ct[4]))


def test_dbias_form_options_and_empty_inputs():
    g = _heavy(1, (256, 200), jnp.float32)
    kw = dict(power_2_scale=False, amax_epsilon=1e-3, implementation="kernel")
    *casts, _ = ops.block_cast_transpose_dbias(g, E5M2, **kw)
    _assert_same(casts, ops.block_cast_transpose(g, E5M2, **kw))
    for shape in [(0, 5), (5, 0), (0, 0)]:
        *_, dbias = ops.block_cast_transpose_dbias(jnp.zeros(shape), E4M3, implementation="kernel")
        np.testing.assert_array_equal(np.asarray(dbias), np.zeros(shape[1], np.float32))


ACTS = [("gelu",), ("relu",), ("silu", "linear"), ("gelu_exact", "linear")]


@pytest.mark.parametrize("acts", ACTS, ids="-".join)
@pytest.mark.parametrize("dtype", WIDE, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("mx", [False, True], ids=["block", "mxfp8"])
def test_activation_form_equals_the_activation_then_the_cast(acts, dtype, mx):
    x = _heavy(len(acts), (300, len(acts), 200), dtype, spread=1.0)
    fused = ops.activation_mxfp8_cast_transpose if mx else ops.activation_block_cast_transpose
    cast = ops.mxfp8_cast_transpose if mx else ops.block_cast_transpose
    for impl in EXACT_IMPLS:
        a = ops.activation(x, acts, implementation=impl)
        _assert_same(fused(x, acts, E4M3, implementation=impl), cast(a, E4M3, implementation=impl))


def test_activation_form_square_blocks_and_options():
    x = _heavy(2, (130, 1, 140), jnp.float32)
    a = ops.activation(x, "relu")
    _assert_same(
        ops.activation_block_cast_transpose(x, "relu", E5M2, (128, 128), power_2_scale=False),
        ops.block_cast_transpose(a, E5M2, (128, 128), power_2_scale=False),
    )


@pytest.mark.parametrize("acts", ACTS, ids="-".join)
@pytest.mark.parametrize("dtype", WIDE, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("kind", list(KINDS))
def test_activation_gradient_form_equals_dactivation_then_the_cast(acts, dtype, kind):
    """As the [m, k * n] matrix the GEMMs read (n a multiple of the block's columns): the codes,
    both grids and dbias of dactivation then the dbias cast, bit for bit."""
    block, _, _ = KINDS[kind]
    r = np.random.default_rng(len(acts))
    m, k, n = 300, len(acts), 256
    x, g = _heavy(r, (m, k, n), dtype, 1.0), _heavy(r, (m, n), dtype, 1.0)
    fused = ops.dactivation_mxfp8_cast_transpose_dbias if kind == "mxfp8" else (
        ops.dactivation_block_cast_transpose_dbias)  # fmt: skip
    for impl in EXACT_IMPLS:
        q, s, q_t, s_t, dbias = fused(g, x, acts, E5M2, block, implementation=impl)
        dx = ops.dactivation(g, x, acts, implementation=impl).reshape(m, k * n)
        *want, want_dbias = KINDS[kind][1](dx, E5M2, block, implementation=impl)
        got = (q.reshape(m, k * n), s.reshape(s.shape[0], -1), q_t.reshape(k * n, m),
               s_t.reshape(k * n // block[0], -1))  # fmt: skip
        _assert_same(got, want)
        assert dbias.shape == (k, n)
        if impl == "kernel":  # the same order: the same bits
            np.testing.assert_array_equal(np.asarray(dbias).reshape(-1), np.asarray(want_dbias))


def test_activation_gradient_form_halves_are_separate_matrices():
    """With n not a multiple of the block, each gated half is blocked on its own (its reference:
    block_cast_transpose of each half)."""
    r = np.random.default_rng(5)
    x, g = _heavy(r, (40, 2, 100), jnp.float32), _heavy(r, (40, 100), jnp.float32)
    acts = ("relu", "linear")
    q, s, q_t, s_t, _ = ops.dactivation_block_cast_transpose_dbias(g, x, acts, E4M3)
    dx = ops.dactivation(g, x, acts)
    for j in range(2):
        wq, ws, wqt, wst = ops.block_cast_transpose(dx[:, j], E4M3)
        _assert_same((q[:, j], s[:, j], q_t[j], s_t[j]), (wq, ws, wqt, wst))


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda: ops.block_cast_transpose_dbias(jnp.ones((2, 3, 4)), E4M3), "rank 2"),
        (lambda: ops.block_cast_transpose_dbias(jnp.ones((4, 4)), E4M3, (2, 64)), "1 x n or sq"),
        (lambda: ops.block_cast_transpose_dbias(jnp.ones((4, 4), jnp.int32), E4M3), "g must"),
        (lambda: ops.mxfp8_cast_transpose_dbias(jnp.ones((4, 4)), jnp.float32), "fp8_dtype"),
        (lambda: ops.activation_block_cast_transpose(jnp.ones((4, 4)), "gelu", E4M3), "rank 3"),
        (lambda: ops.activation_block_cast_transpose(jnp.ones((4, 1, 4)), "nope", E4M3), "activ"),
        (
            lambda: ops.activation_mxfp8_cast_transpose(jnp.ones((4, 1, 4)), ("silu", "linear")),
            "k = len",
        ),
        (
            lambda: ops.activation_block_cast_transpose(
                jnp.ones((4, 1, 4)), "gelu", E4M3, (1, 5), implementation="kernel"
            ),
            "powers of two",
        ),
        (
            lambda: ops.dactivation_block_cast_transpose_dbias(
                jnp.ones((4, 5)), jnp.ones((4, 1, 4)), "gelu", E4M3
            ),
            "g must have shape",
        ),
        (
            lambda: ops.dactivation_mxfp8_cast_transpose_dbias(
                jnp.ones((4, 4), jnp.bfloat16), jnp.ones((4, 1, 4)), "gelu"
            ),
            "share a dtype",
        ),
    ],
)
def test_bad_arguments_are_named(call, match):
    with pytest.raises((ValueError, TypeError), match=match):
        call()


def test_each_fused_op_is_one_custom_call():
    g = jnp.ones((256, 256), jnp.bfloat16)
    x = jnp.ones((256, 1, 128), jnp.bfloat16)
    for fn, arg in (
        (lambda v: ops.block_cast_transpose_dbias(v, E4M3, implementation="kernel"), g),
        (lambda v: ops.activation_mxfp8_cast_transpose(v, "gelu", implementation="kernel"), x),
    ):
        hlo = jax.jit(fn).lower(arg).as_text()
        assert hlo.count("stablehlo.custom_call") == 1, hlo


NORMS = {"layernorm": False, "rmsnorm-zc": True}


@pytest.mark.parametrize("norm", list(NORMS))
@pytest.mark.parametrize("dtype", WIDE, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("kind", list(KINDS))
def test_norm_form_equals_the_norm_then_the_cast(norm, dtype, kind):
    """q, both grids, mu and rsigma of norm_forward then the cast, bit for bit; gamma and beta
    in another dtype than x's."""
    block = KINDS[kind][0]
    norm_type, zc = norm.split("-")[0], NORMS[norm]
    r = np.random.default_rng(len(norm))
    x = _heavy(r, (300, 260), dtype, 1.0)
    gamma = normal(r, 260, jnp.bfloat16, 0.2, 1.0)
    beta = normal(r, 260) if norm_type == "layernorm" else None
    kw = dict(norm_type=norm_type, epsilon=1e-5, zero_centered_gamma=zc)
    fused = ops.norm_mxfp8_cast_transpose if kind == "mxfp8" else ops.norm_block_cast_transpose
    cast = KINDS[kind][2]
    for impl in EXACT_IMPLS:
        got = fused(x, gamma, beta, E5M2, block, implementation=impl, **kw)
        y, mu, rsigma = ops.norm_forward(x, gamma, beta, implementation=impl, **kw)
        _assert_same(got, (*cast(y, E5M2, block, implementation=impl), mu, rsigma))


def test_norm_form_checks_its_arguments():
    x, g = jnp.ones((4, 128)), jnp.ones(128)
    f = ops.norm_block_cast_transpose
    with pytest.raises(ValueError, match="beta must be None for norm_type='rmsnorm'"):
        f(x, g, g, E4M3, norm_type="rmsnorm", epsilon=1e-5)
    with pytest.raises(ValueError, match="beta is required"):
        f(x, g, None, E4M3, norm_type="layernorm", epsilon=1e-5)
    with pytest.raises(ValueError, match="norm_type must be 'layernorm' or 'rmsnorm'"):
        f(x, g, g, E4M3, norm_type="batchnorm", epsilon=1e-5)
    with pytest.raises(ValueError, match="epsilon must be a finite float > 0"):
        f(x, g, g, E4M3, norm_type="layernorm", epsilon=0.0)
    with pytest.raises(ValueError, match="x must have rank 2"):
        f(jnp.ones((2, 4, 128)), g, g, E4M3, norm_type="layernorm", epsilon=1e-5)
    with pytest.raises(ValueError, match=r"gamma must have shape \(128,\)"):
        f(x, jnp.ones(64), g, E4M3, norm_type="layernorm", epsilon=1e-5)
    with pytest.raises(ValueError, match="amax_epsilon must be a finite float >= 0"):
        f(x, g, g, E4M3, norm_type="layernorm", epsilon=1e-5, amax_epsilon=-1.0)


# ------------------------------------------------------------------ the conformance samples
# 1024 rows (256 for MXFP8): split 8 ways by the mesh check, each device holds whole blocks of
# the transposed copy's blocks (which run down the rows).


def _sample_block_cast_transpose_dbias(key):
    r = np.random.default_rng(key)
    scaled = lambda shape, dt: (
        dyadic(r, shape, dt) * jnp.asarray(2.0 ** r.integers(-3, 4, (shape[0], 1)), dt)
    )
    f = ops.block_cast_transpose_dbias
    return {
        "1x128-bf16-e4m3": Sample(f, (scaled((1024, 200), jnp.bfloat16), E4M3), sums=(4,)),
        "128x128-f32-e5m2-f32scale": Sample(
            f,
            (scaled((1024, 130), jnp.float32), E5M2, (128, 128)),
            {"power_2_scale": False},
            sums=(4,),
            gpu_close=F32_SCALE_GPU_CLOSE,
        ),
        "mxfp8-1x32-f16": Sample(
            ops.mxfp8_cast_transpose_dbias, (scaled((256, 100), jnp.float16), E4M3), sums=(4,)
        ),
    }


def _sample_activation_block_cast_transpose(key):
    r = np.random.default_rng(key)
    return {
        # relu: no transcendental function, the same bits on every implementation
        "reglu-1x128-f32-e4m3": Sample(
            ops.activation_block_cast_transpose,
            (_heavy(r, (1024, 2, 130), jnp.float32), ("relu", "linear"), E4M3),
        ),
        # (not gelu: its tanh differs by platform in the far negative tail, where 1 + tanh
        # cancels, and a small block's scale makes those tiny values whole codes apart)
        "relu-1x128-bf16-e5m2": Sample(
            ops.activation_block_cast_transpose,
            (_heavy(r, (1024, 1, 160), jnp.bfloat16), ("relu",), E5M2),
        ),
        "swiglu-mxfp8-f16": Sample(
            ops.activation_mxfp8_cast_transpose,
            (_heavy(r, (256, 2, 96), jnp.float16, 0.5), ("silu", "linear")),
            close=ACT_CLOSE,
            gpu_xla="XLA:GPU's exp moved one 1x32 block's amax across a power of two on an H200",
        ),
    }


def _sample_dactivation_block_cast_transpose_dbias(key):
    r = np.random.default_rng(key)
    out = {}
    # relu on dyadic values: no transcendental function and exact sums, the same bits everywhere
    cases = (("reglu-1x128-f32-e4m3", 1024, jnp.float32, E4M3, False),
             ("relu-mxfp8-bf16-e5m2", 256, jnp.bfloat16, E5M2, True))  # fmt: skip
    for name, m, dt, fp8, mx in cases:
        acts = ("relu", "linear") if name.startswith("reglu") else ("relu",)
        x, g = dyadic(r, (m, len(acts), 96), dt), dyadic(r, (m, 96), dt)
        fn = ops.dactivation_mxfp8_cast_transpose_dbias if mx else (
            ops.dactivation_block_cast_transpose_dbias)  # fmt: skip
        out[name] = Sample(fn, (g, x, acts, fp8), sums=(4,))
    return out


def _sample_norm_block_cast_transpose(key):
    r = np.random.default_rng(key)
    f, mx = ops.norm_block_cast_transpose, ops.norm_mxfp8_cast_transpose

    def args(m, h, dt, norm_type, param_dt):
        x = normal(r, (m, h), dt, 3, 0.5) * jnp.asarray(2.0 ** r.integers(-3, 4, (m, 1)), dt)
        gamma = normal(r, (h,), param_dt, 0.2, 1.0)
        beta = normal(r, (h,), param_dt, 0.2) if norm_type == "layernorm" else None
        return x, gamma, beta

    # The kernel's row sums differ from XLA's in order (NORM_CLOSE); float32 scales keep a hair's
    # difference in y from moving a block's power-of-two scale a whole step. (h = 160 for MXFP8:
    # with h = 96, XLA:CPU summed a 32-row shard's float16 rows in another order than the whole
    # array's, so "xla" on 8 devices was not its one-device bits.)
    return {
        "layernorm-1x128-bf16-e4m3-f32scale": Sample(
            f, (*args(1024, 200, BF16, "layernorm", BF16), E4M3),
            dict(norm_type="layernorm", epsilon=1e-5, power_2_scale=False), close=NORM_CLOSE,
        ),
        "rmsnorm-128x128-f32-e5m2-f32scale-zc": Sample(
            f, (*args(1024, 136, F32, "rmsnorm", F32), E5M2, (128, 128)),
            dict(norm_type="rmsnorm", epsilon=1e-5, zero_centered_gamma=True,
                 power_2_scale=False),
            close=NORM_CLOSE,
        ),
        "layernorm-mxfp8-f16": Sample(
            mx, args(256, 160, F16, "layernorm", F32),
            dict(norm_type="layernorm", epsilon=1e-5), close=NORM_CLOSE,
        ),
    }  # fmt: skip


SAMPLES = {
    "block_cast_transpose_dbias": _sample_block_cast_transpose_dbias,
    "activation_block_cast_transpose": _sample_activation_block_cast_transpose,
    "dactivation_block_cast_transpose_dbias": _sample_dactivation_block_cast_transpose_dbias,
    "norm_block_cast_transpose": _sample_norm_block_cast_transpose,
}
