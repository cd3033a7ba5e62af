"""gemm: the op on the default backend vs the XLA reference on CPU vs a float64 numpy oracle.

Tolerance (stated once, used everywhere): with exact FP8 inputs, ``s = a_scale_inv * b_scale_inv``
and ``P = (|a| @ |b|.T) * |s|`` (the sum of absolute products), the float64 oracle ``y`` and the
result ``r`` in ``out_dtype`` satisfy

    |r - y| <= eps_out * |y|  +  (K + 2) * eps_acc * (P + |bias|)  +  tiny_out

- ``eps_out = finfo(out_dtype).eps``: twice the half-ulp of the one final rounding;
- ``(K + 2) * eps_acc * (P + |bias|)``: the classic bound of a K-term sum (K - 1 adds) plus the
  scale multiply and the bias add. ``eps_acc = finfo(float32).eps`` for XLA's dot on CPU. On a
  GPU, Hopper's FP8 tensor cores add the products of each 32-deep MMA into their accumulator
  keeping only about 14 mantissa bits, so ``eps_acc = 2**-13`` there, in both modes ("split"
  only promotes the partial sums to float32 every few MMAs; "fast" never does);
- ``tiny_out = finfo(out_dtype).smallest_subnormal``: rounding near zero is absolute.

That worst-case bound is loose on a GPU, so every result must also pass a whole-matrix check that
a wrong layout or scale would fail by orders of magnitude (their error is O(1)):
``||r - y||_F <= (eps_out + allowance) * ||y||_F``: one rounding to ``out_dtype`` plus
``allowance = 2**-9``, which covers float32 accumulation (~1e-7 * sqrt(K)) and "split" mode (up to
16 MMA steps of 2**-13 between promotions); for "fast" on a GPU ``max(2**-9, 2**-13 * K / 32)``:
2**-13 lost in each of the K / 32 MMA steps, even if every loss had the same sign.

On CPU, ``gemm`` *is* the reference, so it must also equal ``gemm_reference`` bit for bit.
"""

from __future__ import annotations

import itertools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from _implementations import implementation_fixture, only, pytest_generate_tests  # noqa: F401
from _samples import F32, GEMM_GPU_CLOSE, M, N, Sample, fp8_codes, scale_of
from _shared import normal
from conftest import on_cpu, requires_cuda

from fp8jax import ops
from fp8jax.ops.gemms.gemm import (
    WORKSPACE_BYTES,
    _cuda_2d,
    _reference_2d,
    gemm_codes,
    gemm_reusing,
    pad_operands,
)

E4M3 = ml_dtypes.float8_e4m3fn
E5M2 = ml_dtypes.float8_e5m2
COMBOS = [(E4M3, E4M3), (E4M3, E5M2), (E5M2, E4M3)]
COMBO_IDS = ["e4m3xe4m3", "e4m3xe5m2", "e5m2xe4m3"]
OUT = [jnp.bfloat16, jnp.float16, jnp.float32]
OUT_IDS = ["bf16", "f16", "f32"]
ODD = (1, 7, 17, 33, 100)
EPS32 = float(np.finfo(np.float32).eps)
TENSOR_CORE_EPS = 2.0**-13  # FP8 MMA accumulation keeps ~14 mantissa bits
ALLOWANCE = 2.0**-9


def _on_gpu() -> bool:
    return jax.default_backend() in ("gpu", "cuda")


def _accuracy(accumulate: str, k: int) -> tuple[float, float]:
    """``(eps_acc, allowance)`` of the backend gemm runs on (see the module docstring)."""
    if not _on_gpu():
        return EPS32, ALLOWANCE
    if accumulate == "fast":
        return TENSOR_CORE_EPS, max(ALLOWANCE, TENSOR_CORE_EPS * k / 32)
    return TENSOR_CORE_EPS, ALLOWANCE


def _fp8(rng: np.random.Generator, shape: tuple[int, ...], fp8, limit: float = 16.0) -> np.ndarray:
    """Random FP8 values drawn uniformly from the format's finite codes with |v| <= limit: zeros,
    subnormals and normals of both signs, so sums mix very different magnitudes."""
    codes = np.arange(256, dtype=np.uint8).view(fp8)
    vals = codes.astype(np.float32)
    pool = codes[np.isfinite(vals) & (np.abs(vals) <= limit)]
    return rng.choice(pool, size=shape)


def _operands(seed, m, n, k, a_dt=E4M3, b_dt=E4M3, out=jnp.bfloat16, bias=False):
    rng = np.random.default_rng(seed)
    a = _fp8(rng, (m, k), a_dt)
    b = _fp8(rng, (n, k), b_dt)
    sa = np.float32(0.37)
    sb = np.float32(1.9)
    bias_v = np.asarray(normal(rng, n, out, 8.0)) if bias else None
    return a, b, sa, sb, bias_v


def _oracle(a, b, sa, sb, bias) -> np.ndarray:
    y = a.astype(np.float64) @ b.astype(np.float64).T * (np.float64(sa) * np.float64(sb))
    if bias is not None:
        y = y + np.asarray(bias).astype(np.float64)
    return y


def _bound(a, b, sa, sb, bias, out_dtype, eps_acc) -> np.ndarray:
    k = a.shape[1]
    p = np.abs(a.astype(np.float64)) @ np.abs(b.astype(np.float64)).T * abs(float(sa) * float(sb))
    if bias is not None:
        p = p + np.abs(np.asarray(bias).astype(np.float64))
    fo = ml_dtypes.finfo(out_dtype)
    y = np.abs(_oracle(a, b, sa, sb, bias))
    return float(fo.eps) * y + (k + 2) * eps_acc * p + float(fo.smallest_subnormal)


def _assert_close(got, a, b, sa, sb, bias, out_dtype, accuracy, what) -> None:
    eps_acc, allowance = accuracy
    got = np.asarray(got).astype(np.float64)
    want = _oracle(a, b, sa, sb, bias)
    tol = _bound(a, b, sa, sb, bias, out_dtype, eps_acc)
    assert got.shape == want.shape, what
    bad = ~(np.abs(got - want) <= tol)
    if bad.any():
        i = tuple(np.argwhere(bad)[0])
        raise AssertionError(
            f"{what}: {bad.sum()} of {bad.size} elements off, first at {i}: got {got[i]}, "
            f"want {want[i]}, tolerance {tol[i]}"
        )
    rel = np.linalg.norm(got - want) / max(np.linalg.norm(want), np.finfo(np.float64).tiny)
    limit = float(ml_dtypes.finfo(out_dtype).eps) + allowance
    assert rel <= limit, f"{what}: relative Frobenius error {rel} > {limit}"


# Jitted, like gemm itself: XLA then makes the same fusion choices (e.g. a fused multiply-add of
# the scale and the float32 bias) for both, which op-by-op execution would not.
_reference = jax.jit(ops.gemm_reference, static_argnames=("out_dtype", "accumulate"))


def _check(a, b, sa, sb, bias, out_dtype, accumulate="fast") -> None:
    """gemm on the default backend against the oracle; the CPU reference against the oracle and,
    when the default backend is the CPU, against gemm bit for bit."""
    args = (jnp.asarray(a), jnp.asarray(b), jnp.float32(sa), jnp.float32(sb))
    kw = {
        "out_dtype": out_dtype,
        "bias": None if bias is None else jnp.asarray(bias),
        "accumulate": accumulate,
    }
    got = ops.gemm(*args, **kw)
    ref = on_cpu(_reference, *args, **kw)
    assert got.dtype == ref.dtype == jnp.dtype(out_dtype)
    assert got.shape == ref.shape == (a.shape[0], b.shape[0])
    _assert_close(ref, a, b, sa, sb, bias, out_dtype, (EPS32, ALLOWANCE), "reference vs oracle")
    accuracy = _accuracy(accumulate, a.shape[1])
    _assert_close(got, a, b, sa, sb, bias, out_dtype, accuracy, "gemm vs oracle")
    if not _on_gpu():
        np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))


# ------------------------------------------------------------------ numerics


@pytest.mark.parametrize("accumulate", ["fast", "split"])
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
@pytest.mark.parametrize("out", OUT, ids=OUT_IDS)
@pytest.mark.parametrize(("a_dt", "b_dt"), COMBOS, ids=COMBO_IDS)
def test_gemm_every_dtype_combination(a_dt, b_dt, out, bias, accumulate):
    a, b, sa, sb, bias_v = _operands(1, 48, 32, 64, a_dt, b_dt, out, bias)
    _check(a, b, sa, sb, bias_v, out, accumulate)


@pytest.mark.parametrize(("n", "k"), list(itertools.product(ODD, ODD)), ids=str)
def test_gemm_odd_sizes(n, k):
    for m in ODD:
        a, b, sa, sb, bias_v = _operands(m * 10000 + n * 100 + k, m, n, k, bias=True)
        _check(a, b, sa, sb, bias_v, jnp.bfloat16)


@pytest.mark.parametrize("out", OUT, ids=OUT_IDS)
def test_gemm_odd_sizes_f32_bias_and_e5m2(out):
    # float32 output adds the bias outside the CUDA kernel; E5M2 b with an odd N pads E5M2 rows.
    a, b, sa, sb, bias_v = _operands(7, 33, 17, 100, E4M3, E5M2, out, bias=True)
    _check(a, b, sa, sb, bias_v, out, "split")


def test_gemm_scale_shapes_and_values():
    a, b, _, _, _ = _operands(3, 16, 16, 32)
    for sa, sb in [(1.0, 1.0), (2.0**-10, 2.0**7), (1e-3, 3.3)]:
        got = ops.gemm(jnp.asarray(a), jnp.asarray(b), jnp.full((1,), sa, jnp.float32), sb)
        ref = on_cpu(_reference, jnp.asarray(a), jnp.asarray(b), jnp.float32(sa), jnp.float32(sb))
        assert got.shape == (16, 16)
        accuracy = _accuracy("fast", a.shape[1])
        _assert_close(got, a, b, sa, sb, None, jnp.bfloat16, accuracy, f"scales {sa}, {sb}")
        if not _on_gpu():
            np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))


def test_gemm_empty_dims():
    for m, n, k in [(0, 16, 16), (16, 0, 16), (16, 16, 0), (0, 0, 0)]:
        a = jnp.zeros((m, k), jnp.float8_e4m3fn)
        b = jnp.zeros((n, k), jnp.float8_e4m3fn)
        bias = jnp.arange(n, dtype=jnp.float32)
        got = ops.gemm(a, b, jnp.float32(1), jnp.float32(1), out_dtype=jnp.float32, bias=bias)
        assert got.shape == (m, n)
        np.testing.assert_array_equal(np.asarray(got), np.broadcast_to(np.arange(n), (m, n)))


# ------------------------------------------------------------------ CUDA padding


@only("kernel")  # private helpers of the CUDA branch: no implementation switch involved
@pytest.mark.parametrize(("m", "n", "k"), [(1, 1, 1), (7, 17, 33), (100, 7, 17), (16, 32, 48)])
def test_pad_operands_keeps_the_result(m, n, k):
    # Integer-valued FP8 inputs make every float32 sum exact, so padded == unpadded bit for bit.
    rng = np.random.default_rng(m + n + k)
    a = jnp.asarray(rng.integers(-8, 9, (m, k)).astype(E4M3))
    b = jnp.asarray(rng.integers(-8, 9, (n, k)).astype(E5M2))
    bias = jnp.asarray(rng.integers(-50, 50, n).astype(np.float32)).astype(jnp.bfloat16)
    a_p, b_p, bias_p = pad_operands(a, b, bias)
    assert a_p.shape[0] == m and a_p.shape[1] % 16 == 0 and a_p.shape[1] >= k
    assert b_p.shape[0] % 16 == 0 and b_p.shape[1] == a_p.shape[1] and b_p.shape[0] >= n
    assert bias_p.shape == (b_p.shape[0],)
    np.testing.assert_array_equal(np.asarray(a_p)[:, :k], np.asarray(a))
    np.testing.assert_array_equal(np.asarray(b_p)[:n, :k], np.asarray(b))
    assert not np.asarray(a_p)[:, k:].astype(np.float32).any()
    assert not np.asarray(b_p)[n:].astype(np.float32).any()
    assert not np.asarray(b_p)[:, k:].astype(np.float32).any()
    s = (jnp.float32(0.5), jnp.float32(2.0))
    want = on_cpu(ops.gemm_reference, a, b, *s, bias=bias)
    padded = on_cpu(ops.gemm_reference, a_p, b_p, *s, bias=bias_p)
    np.testing.assert_array_equal(np.asarray(padded)[:, :n], np.asarray(want))
    if m % 16 == 0 and n % 16 == 0 and k % 16 == 0:
        assert a_p is a and b_p is b and bias_p is bias  # aligned: passed through, no copy


def _emulated_kernel(target, result_types):
    """Stands in for ``jax.ffi.ffi_call`` with the CUDA handler's contract (cpp/cuda/
    gemm_cublaslt.cc), so the CUDA branch's padding, slicing and bias handling run on CPU."""
    assert target == "fp8jax_gemm"
    out_type, ws_type = result_types

    def call(a, b, a_scale_inv, b_scale_inv, bias, *, has_bias, fast_accum, a_scale_mode,
             b_scale_mode, autotune):  # fmt: skip
        assert a_scale_mode == b_scale_mode == 0  # per-tensor (block scales: test_block_gemm.py)
        assert autotune in (0, 1)
        m, k = a.shape
        n = b.shape[0]
        assert k % 16 == 0 and n % 16 == 0 and b.shape[1] == k, "K and N must be padded"
        assert out_type.shape == (m, n) and ws_type.shape == (WORKSPACE_BYTES,)
        assert fast_accum in (0, 1) and has_bias in (0, 1)
        if has_bias:
            assert out_type.dtype != jnp.float32, "a float32 bias is added outside the kernel"
            assert bias.shape == (n,) and bias.dtype == out_type.dtype
        else:
            assert bias.shape == (0,)
        out = _reference_2d(
            a, b, a_scale_inv, b_scale_inv, bias if has_bias else None, out_dtype=out_type.dtype
        )
        return out, jnp.zeros(ws_type.shape, ws_type.dtype)

    return call


@only("kernel")
@pytest.mark.parametrize("out", OUT, ids=OUT_IDS)
@pytest.mark.parametrize(("m", "n", "k"), [(1, 1, 1), (7, 17, 33), (100, 7, 17), (16, 32, 48)])
def test_cuda_branch_with_an_emulated_kernel(monkeypatch, m, n, k, out):
    monkeypatch.setattr(jax.ffi, "ffi_call", _emulated_kernel)
    rng = np.random.default_rng(m * n * k)
    a = jnp.asarray(rng.integers(-8, 9, (m, k)).astype(E4M3))
    b = jnp.asarray(rng.integers(-8, 9, (n, k)).astype(E5M2))
    s = (jnp.float32(0.5), jnp.float32(2.0))
    for bias in (None, jnp.asarray(rng.integers(-50, 50, n)).astype(out)):
        got = _cuda_2d(a, b, *s, bias, out_dtype=jnp.dtype(out), fast_accum=True)
        want = _reference_2d(a, b, *s, bias, out_dtype=jnp.dtype(out))
        assert got.shape == (m, n) and got.dtype == jnp.dtype(out)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


# ------------------------------------------------------------------ transformations


def _loop(a, b, sa, sb, bias, axes):
    """The vmapped call as a Python loop over the batch (axes: which operands are batched)."""
    size = next(x.shape[0] for x, ax in zip((a, b, sa, sb, bias), axes, strict=True) if ax)
    outs = []
    for i in range(size):
        args = [x[i] if ax else x for x, ax in zip((a, b, sa, sb, bias), axes, strict=True)]
        outs.append(ops.gemm(*args[:4], bias=args[4]))
    return jnp.stack(outs)


def _assert_same_computation(got, want):
    """Bit for bit on CPU; on a GPU, different shapes (folded vs per-element) may pick different
    cuBLASLt algorithms, so only agreement to bf16 precision is expected."""
    if _on_gpu():
        np.testing.assert_allclose(
            np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2**-7, atol=1e-2
        )
    else:
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_vmap_batched_a_folds_into_m(implementation):
    rng = np.random.default_rng(11)
    a = jnp.asarray(_fp8(rng, (4, 7, 33), E4M3))
    b = jnp.asarray(_fp8(rng, (17, 33), E4M3))
    bias = normal(rng, 17, jnp.bfloat16)
    sa, sb = jnp.float32(0.5), jnp.full((1,), 3.0, jnp.float32)
    f = jax.vmap(lambda x: ops.gemm(x, b, sa, sb, bias=bias))
    got = f(a)
    assert got.shape == (4, 7, 17)
    _assert_same_computation(got, _loop(a, b, sa, sb, bias, (1, 0, 0, 0, 0)))
    jaxpr = str(jax.make_jaxpr(f)(a))
    if implementation == "kernel":  # fp8jax's batching rule ("xla": XLA's batched dot)
        assert "f8_e4m3fn[28,33]" in jaxpr  # one GEMM with M = 4 * 7
    assert "scan" not in jaxpr and "while" not in jaxpr
    # in_axes other than 0, and a nested vmap, fold as well.
    a_t = jnp.swapaxes(a, 0, 1)  # [7, 4, 33]
    got_t = jax.vmap(lambda x: ops.gemm(x, b, sa, sb, bias=bias), in_axes=1)(a_t)
    _assert_same_computation(got_t, got)
    a2 = a.reshape(2, 2, 7, 33)
    g2 = jax.vmap(jax.vmap(lambda x: ops.gemm(x, b, sa, sb, bias=bias)))
    _assert_same_computation(g2(a2), got.reshape(2, 2, 7, 17))
    assert "scan" not in str(jax.make_jaxpr(g2)(a2))


@pytest.mark.parametrize(
    "axes",
    [(0, 1, 0, 0, 0), (1, 1, 0, 0, 0), (1, 0, 1, 0, 0), (0, 0, 0, 1, 0), (1, 0, 0, 0, 1)],
    ids=["b", "a+b", "a+a_scale", "b_scale", "a+bias"],
)
def test_vmap_other_batching_maps_over_the_batch(axes, implementation):
    rng = np.random.default_rng(sum(axes))
    size = 3
    a = jnp.asarray(_fp8(rng, (size, 7, 33) if axes[0] else (7, 33), E4M3))
    b = jnp.asarray(_fp8(rng, (size, 17, 33) if axes[1] else (17, 33), E5M2))
    sa = jnp.asarray(rng.uniform(0.1, 2, size if axes[2] else ()).astype(np.float32))
    sb = jnp.asarray(rng.uniform(0.1, 2, (size, 1) if axes[3] else (1,)).astype(np.float32))
    bias = normal(rng, (size, 17) if axes[4] else 17, jnp.bfloat16)
    in_axes = tuple(0 if ax else None for ax in axes)
    f = jax.vmap(lambda x, y, s, t, c: ops.gemm(x, y, s, t, bias=c), in_axes=in_axes)
    got = f(a, b, sa, sb, bias)
    assert got.shape == (size, 7, 17)
    _assert_same_computation(got, _loop(a, b, sa, sb, bias, axes))
    if implementation == "kernel":  # fp8jax's batching rule ("xla": XLA's batched dot)
        assert "scan" in str(jax.make_jaxpr(f)(a, b, sa, sb, bias))


def test_jit_matches_eager():
    a, b, sa, sb, bias = _operands(21, 33, 17, 100, bias=True)
    args = (jnp.asarray(a), jnp.asarray(b), jnp.float32(sa), jnp.float32(sb))
    for out, acc in [(jnp.bfloat16, "fast"), (jnp.float32, "split")]:
        bias_j = jnp.asarray(bias).astype(out)
        eager = ops.gemm(*args, out_dtype=out, bias=bias_j, accumulate=acc)
        jitted = jax.jit(ops.gemm, static_argnames=("out_dtype", "accumulate"))(
            *args, out_dtype=out, bias=bias_j, accumulate=acc
        )
        _assert_same_computation(jitted, eager)


def _compiled_hlo(device, m=32, n=48, k=64) -> str:
    a = jax.device_put(jnp.ones((m, k), jnp.float8_e4m3fn), device)
    b = jax.device_put(jnp.ones((n, k), jnp.float8_e4m3fn), device)
    s = jax.device_put(jnp.float32(1.0), device)
    bias = jax.device_put(jnp.zeros((n,), jnp.bfloat16), device)
    f = jax.jit(lambda x, y, p, q, c: ops.gemm(x, y, p, q, bias=c))
    return f.lower(a, b, s, s, bias).compile().as_text()


def test_cpu_hlo_is_an_xla_dot_without_custom_call():
    hlo = _compiled_hlo(jax.devices("cpu")[0])
    assert " dot(" in hlo
    assert "fp8jax_gemm" not in hlo
    assert "custom-call" not in hlo


# ------------------------------------------------------------------ bad input


def _good():
    return {
        "a": jnp.ones((4, 32), jnp.float8_e4m3fn),
        "b": jnp.ones((16, 32), jnp.float8_e4m3fn),
        "a_scale_inv": jnp.float32(1),
        "b_scale_inv": jnp.ones((1,), jnp.float32),
    }


@pytest.mark.parametrize(
    ("change", "exc", "match"),
    [
        (
            {"a": jnp.ones((4, 32), jnp.float8_e5m2), "b": jnp.ones((16, 32), jnp.float8_e5m2)},
            TypeError,
            "cannot both be float8_e5m2",
        ),
        ({"a": jnp.ones((2, 4, 32), jnp.float8_e4m3fn)}, ValueError, "a must be 2-D"),
        ({"b": jnp.ones((32,), jnp.float8_e4m3fn)}, ValueError, "b must be 2-D"),
        ({"b": jnp.ones((16, 31), jnp.float8_e4m3fn)}, ValueError, "must share K"),
        ({"a_scale_inv": jnp.ones((2,), jnp.float32)}, ValueError, "a_scale_inv must hold one"),
        ({"b_scale_inv": jnp.ones((1, 1), jnp.float32)}, ValueError, "b_scale_inv must hold one"),
        ({"a_scale_inv": jnp.bfloat16(1)}, TypeError, "a_scale_inv must be float32"),
        ({"out_dtype": jnp.float8_e4m3fn}, TypeError, "out_dtype must be"),
        ({"bias": jnp.ones((16,), jnp.float32)}, TypeError, "bias must have dtype out_dtype"),
        ({"bias": jnp.ones((17,), jnp.bfloat16)}, ValueError, r"bias must have shape \(N,\)"),
        ({"bias": jnp.ones((1, 16), jnp.bfloat16)}, ValueError, r"bias must have shape \(N,\)"),
        ({"accumulate": None}, ValueError, "accumulate must be"),
        ({"a": "not an array"}, TypeError, "a must be"),
    ],
    ids=lambda v: v if isinstance(v, str) else None,
)
@pytest.mark.parametrize("fn", [ops.gemm, ops.gemm_reference], ids=["gemm", "reference"])
def test_bad_input(fn, change, exc, match):
    kw = _good() | change
    pos = [kw.pop(name) for name in ("a", "b", "a_scale_inv", "b_scale_inv")]
    with pytest.raises(exc, match=match):
        fn(*pos, **kw)


# ------------------------------------------------------------------ GPU only


@requires_cuda
@only("kernel")
def test_gpu_hlo_calls_the_fp8_kernel():
    hlo = _compiled_hlo(jax.devices("cuda")[0])
    assert "fp8jax_gemm" in hlo, "the CUDA path must call the cuBLASLt kernel, not an XLA dot"


@requires_cuda
@pytest.mark.parametrize("accumulate", ["fast", "split"])
@pytest.mark.parametrize("out", OUT, ids=OUT_IDS)
@pytest.mark.parametrize(("a_dt", "b_dt"), COMBOS, ids=COMBO_IDS)
def test_gpu_kernel_large(a_dt, b_dt, out, accumulate):
    # K = 2048 makes the difference between the accumulation modes visible to the bound.
    a, b, sa, sb, bias_v = _operands(5, 256, 384, 2048, a_dt, b_dt, out, bias=True)
    _check(a, b, sa, sb, bias_v, out, accumulate)


@requires_cuda
@pytest.mark.parametrize(("m", "n", "k"), [(1, 1, 1), (7, 17, 33), (100, 33, 7), (33, 100, 17)])
def test_gpu_kernel_odd_sizes_are_padded(m, n, k):
    for out in OUT:
        a, b, sa, sb, bias_v = _operands(m + n + k, m, n, k, out=out, bias=True)
        _check(a, b, sa, sb, bias_v, out, "split")


# ------------------------------------------------------------------ gemm_reusing (layers' dgrad)


def _dgrad_operands(seed, m=7, n=17, k=33):
    rng = np.random.default_rng(seed)
    g = jnp.asarray(_fp8(rng, (m, n), E5M2))
    w_q = jnp.asarray(_fp8(rng, (k, n), E4M3))
    x_t = jnp.asarray(_fp8(rng, (k, m), E4M3))
    return g, w_q, w_q.T, x_t


def test_gemm_reusing_equals_gemm():
    """On one device ``reuse`` steers nothing: the result is ``gemm``'s, bit for bit."""
    g, w_q, w_t, x_t = _dgrad_operands(31)
    sa, sb = jnp.float32(0.25), jnp.full((1,), 3.0, jnp.float32)
    want = ops.gemm(g, w_q, sa, sb, out_dtype=jnp.float32, accumulate="split")
    got = gemm_reusing(g, w_q, sa, sb, reuse=(w_t, x_t), out_dtype=jnp.float32)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    jitted = jax.jit(lambda *v: gemm_reusing(*v[:4], reuse=v[4:], out_dtype=jnp.float32))
    np.testing.assert_array_equal(np.asarray(jitted(g, w_q, sa, sb, w_t, x_t)), np.asarray(want))


@pytest.mark.parametrize("batched", ["g", "g+w"])
def test_gemm_reusing_vmap(batched):
    size = 3
    parts = [_dgrad_operands(40 + i) for i in range(size)]
    g = jnp.stack([p[0] for p in parts])
    w_q = jnp.stack([p[1] for p in parts]) if batched == "g+w" else parts[0][1]
    x_t = jnp.stack([p[3] for p in parts])
    w_t = jnp.swapaxes(w_q, -1, -2)
    sa, sb = jnp.float32(0.5), jnp.float32(2.0)
    w_axis = 0 if batched == "g+w" else None
    f = jax.vmap(
        lambda g, w, wt, xt: gemm_reusing(g, w, sa, sb, reuse=(wt, xt)),
        in_axes=(0, w_axis, w_axis, 0),
    )
    got = f(g, w_q, w_t, x_t)
    for i in range(size):
        w = w_q[i] if batched == "g+w" else w_q
        np.testing.assert_array_equal(
            np.asarray(got[i], np.float32), np.asarray(ops.gemm(g[i], w, sa, sb), np.float32)
        )


@pytest.mark.parametrize(
    ("which", "value", "match"),
    [
        (0, lambda w_t, x_t: w_t.T, r"reuse\[0\] must be b's transpose"),
        (0, lambda w_t, x_t: w_t.astype(E5M2), r"reuse\[0\] must be b's transpose"),
        (0, lambda w_t, x_t: w_t.astype(jnp.float32), r"reuse\[0\].*FP8|reuse\[0\].*float8"),
        (1, lambda w_t, x_t: x_t.T, r"reuse\[1\] must be the forward input transposed"),
        (1, lambda w_t, x_t: x_t[None], r"reuse\[1\] must be the forward input transposed"),
    ],
    ids=["w_t-shape", "w_t-dtype", "w_t-wide", "x_t-shape", "x_t-rank"],
)
def test_gemm_reusing_bad_reuse(which, value, match):
    g, w_q, w_t, x_t = _dgrad_operands(50, m=5)
    reuse = [w_t, x_t]
    reuse[which] = value(w_t, x_t)
    with pytest.raises((TypeError, ValueError), match=match):
        gemm_reusing(g, w_q, jnp.float32(1), jnp.float32(1), reuse=tuple(reuse))


# ------------------------------------------------------------------ gemm_codes (layers' residuals)


def _codes(x):
    return jax.lax.bitcast_convert_type(x, jnp.uint8)


def test_gemm_codes_equals_gemm():
    """FP8 tensors given as their uint8 codes: the same GEMM, bit for bit, with and without
    ``reuse``, with a bias, under jit and vmap."""
    g, w_q, w_t, x_t = _dgrad_operands(60)
    sa, sb = jnp.float32(0.25), jnp.full((1,), 3.0, jnp.float32)
    want = ops.gemm(g, w_q, sa, sb, out_dtype=jnp.float32, accumulate="split")
    dtypes = (E5M2, E4M3)
    got = gemm_codes(_codes(g), _codes(w_q), sa, sb, dtypes=dtypes, out_dtype=jnp.float32,
                     accumulate="split")  # fmt: skip
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    reused = jax.jit(
        lambda *v: gemm_codes(*v[:4], dtypes=dtypes, reuse=v[4:], out_dtype=jnp.float32)
    )(_codes(g), _codes(w_q), sa, sb, _codes(w_t), _codes(x_t))
    np.testing.assert_array_equal(np.asarray(reused), np.asarray(want))
    bias = jnp.arange(w_q.shape[0], dtype=jnp.float32)
    with_bias = gemm_codes(_codes(g), _codes(w_q), sa, sb, dtypes=dtypes, bias=bias,
                           out_dtype=jnp.float32)  # fmt: skip
    np.testing.assert_array_equal(
        np.asarray(with_bias),
        np.asarray(ops.gemm(g, w_q, sa, sb, bias=bias, out_dtype=jnp.float32)),
    )
    batched = jax.vmap(lambda a: gemm_codes(a, _codes(w_q), sa, sb, dtypes=dtypes))(
        jnp.stack([_codes(g)] * 2)
    )
    np.testing.assert_array_equal(np.asarray(batched[1]), np.asarray(ops.gemm(g, w_q, sa, sb)))


def test_gemm_codes_bad_input():
    g, w_q, w_t, x_t = _dgrad_operands(61)
    one = jnp.float32(1)
    with pytest.raises(TypeError, match="a must hold uint8 codes"):
        gemm_codes(g, _codes(w_q), one, one, dtypes=(E5M2, E4M3))
    with pytest.raises(TypeError, match="dtypes"):
        gemm_codes(_codes(g), _codes(w_q), one, one, dtypes=(jnp.float32, E4M3))
    with pytest.raises(TypeError, match="cannot both be float8_e5m2"):
        gemm_codes(_codes(g), _codes(w_q), one, one, dtypes=(E5M2, E5M2))
    with pytest.raises(ValueError, match="takes no bias"):
        bias = jnp.zeros(w_q.shape[0], jnp.bfloat16)
        gemm_codes(_codes(g), _codes(w_q), one, one, dtypes=(E5M2, E4M3),
                   bias=bias, reuse=(_codes(w_t), x_t))  # fmt: skip
    with pytest.raises(ValueError, match=r"reuse\[0\] must be b's transpose"):
        gemm_codes(_codes(g), _codes(w_q), one, one, dtypes=(E5M2, E4M3),
                   reuse=(_codes(w_q), x_t))  # fmt: skip


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize(
    ("x_dt", "g_dt"), [(jnp.float8_e4m3fn, jnp.float8_e4m3fn), (jnp.float8_e5m2, jnp.float8_e4m3fn)]
)
def test_nonfinite_input_makes_a_nonfinite_gemm_row(bad, x_dt, g_dt):
    # The point of the non-finite cast rule: one inf or NaN in an input row reaches the GEMM as a
    # non-finite code (it used to saturate to +-max), so the row's outputs, and a loss built on
    # them, are non-finite as in high precision. The other rows are untouched.
    x = np.ones((3, 16), np.float32)
    x[1, 5] = bad
    w = np.full((4, 16), 0.5, np.float32)
    qx, sx, _ = ops.quantize(jnp.asarray(x), jnp.float32(1.0), x_dt)
    qw, sw, _ = ops.quantize(jnp.asarray(w), jnp.float32(1.0), g_dt)
    y = np.asarray(ops.gemm(qx, qw, sx, sw, out_dtype=jnp.float32))
    assert not np.isfinite(y[1]).any()
    np.testing.assert_array_equal(y[[0, 2]], 8.0)


# ------------------------------------------------------------------ the conformance sample
# This op's entries in the conformance suite's table (tests/ops/_samples.py, tests/ops/
# test_conformance.py, tests/distributed/test_ops_conformance.py).


def _sample_gemm(key):
    r = np.random.default_rng(key)
    a, b = fp8_codes(r, (M, 32), jnp.float8_e4m3fn), fp8_codes(r, (N, 32), jnp.float8_e4m3fn)
    b5 = fp8_codes(r, (N, 32), jnp.float8_e5m2)
    bias = normal(r, (N,), F32)
    return {
        "e4m3-bf16": Sample(
            ops.gemm, (a, b, scale_of(0.5), scale_of(0.25)), gpu_close=GEMM_GPU_CLOSE
        ),
        "e4m3xe5m2-f32-bias-split": Sample(
            ops.gemm,
            (a, b5, scale_of(0.5, (1,)), scale_of(2.0)),
            dict(out_dtype=F32, bias=bias, accumulate="split"),
            gpu_close=GEMM_GPU_CLOSE,
        ),
    }


SAMPLES = {"gemm": _sample_gemm}
