"""fp8jax.ops.gemms.rowwise_gemm: the row-wise scaled GEMM on cuBLASLt's outer-vector scale mode
(issue 49). On CPU it is the reference (``rowwise_scaled_matmul``) bit for bit, opted in or not;
lowered for CUDA it is one ``fp8jax_gemm`` call with scale mode 3 (OUTER_VEC_32F) for both
operands, padded operands and one float32 scale per padded row (as many as the handler's own
count), only under ``gemm_options(rowwise_cublaslt=True)`` and on a GPU with the mode; the
layers' GEMMs under Float8RowwiseScaling follow the same opt-in. No GPU has run the kernel
path: its padding and slicing are checked with an emulated handler."""

from __future__ import annotations

import importlib
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _shared import normal, rand
from conftest import load_testing_extension

import fp8jax
from fp8jax import _ffi
from fp8jax.ops import gemm_options
from fp8jax.ops.block.rowwise import rowwise_quantize, rowwise_scaled_matmul

# the module (fp8jax.ops.gemms.rowwise_gemm is the function, as the package re-exports it)
rg = importlib.import_module("fp8jax.ops.gemms.rowwise_gemm")
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
CUDA_TESTING = load_testing_extension(cuda=True) if _ffi.cuda_extension() is not None else None


def _operands(m=100, n=70, k=300, seed=0, b_dtype=E4M3):
    r = np.random.default_rng(seed)
    x, w = normal(r, (m, k)), normal(r, (n, k), scale=0.1)
    x = x * jnp.exp2(jnp.round(jnp.asarray(r.normal(size=(m, 1)), jnp.float32) * 2))
    return (*rowwise_quantize(x, E4M3), *rowwise_quantize(w, b_dtype))


def _fake_gpu(monkeypatch, cc: str) -> None:
    """``jax.devices("gpu")`` answers one device of compute capability ``cc``."""
    fake = types.SimpleNamespace(compute_capability=cc)
    real = jax.devices
    monkeypatch.setattr(jax, "devices", lambda *a: [fake] if a == ("gpu",) else real(*a))


@pytest.mark.parametrize("opted_in", [False, True])
@pytest.mark.parametrize("implementation", ["kernel", "xla", None])
@pytest.mark.parametrize("out_dtype", [jnp.float32, jnp.bfloat16])
def test_on_cpu_it_is_the_reference_bit_for_bit(opted_in, implementation, out_dtype):
    args = _operands(b_dtype=E5M2)
    want = rowwise_scaled_matmul(*args, out_dtype)
    with gemm_options(rowwise_cublaslt=opted_in):
        got = jax.jit(lambda *a: rg.rowwise_gemm(*a, out_dtype, implementation=implementation))(
            *args
        )
    assert got.dtype == out_dtype and got.shape == (100, 70)
    if jax.default_backend() == "cpu":
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def _cuda_lines(fn, *args) -> list[str]:
    """The ``fp8jax_gemm`` lines of ``fn`` lowered for CUDA."""
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    return [line for line in text.splitlines() if "custom_call @fp8jax_gemm" in line]


def test_lowered_for_cuda_it_is_one_outer_vector_cublaslt_call(monkeypatch):
    _fake_gpu(monkeypatch, "9.0")  # a Hopper GPU, whatever this machine has
    with gemm_options(rowwise_cublaslt=True):
        (line,) = _cuda_lines(lambda *a: rg.rowwise_gemm(*a, jnp.bfloat16), *_operands())
    assert "a_scale_mode = 3" in line and "b_scale_mode = 3" in line
    assert "fast_accum = 0" in line  # split accumulation
    types_ = re.search(r"\} : \((.*)\) -> \(", line).group(1).split(", ")
    # M 100 -> 112, N 70 -> 80, K 300 -> 304: multiples of 16; one float32 scale per padded row
    assert types_[:4] == ["tensor<112x304xf8E4M3FN>", "tensor<80x304xf8E4M3FN>",
                          "tensor<112xf32>", "tensor<80xf32>"]  # fmt: skip
    assert "-> (tensor<112x80xbf16>" in line
    if CUDA_TESTING is not None:  # the handler's own count of the scales cuBLASLt reads
        assert CUDA_TESTING._block_scale_count(3, 112, 304) == 112
        assert CUDA_TESTING._block_scale_count(3, 80, 304) == 80


@pytest.mark.parametrize(
    ("cc", "opted_in", "implementation", "kernel"),
    [("9.0", True, None, True), ("9.0", True, "kernel", True), ("9.0", False, None, False),
     ("9.0", False, "kernel", False), ("9.0", True, "xla", False), ("10.0", True, None, False),
     ("8.9", True, None, False), ("12.0", True, "kernel", False)],
)  # fmt: skip
def test_the_kernel_only_opted_in_on_a_gpu_with_the_mode(cc, opted_in, implementation, kernel,
                                                         monkeypatch):  # fmt: skip
    """Opt-in: ``rowwise_cublaslt=True`` and a ``"kernel"`` choice, on an sm_90 GPU (the mode
    is documented for Hopper); anything else lowers to the reference, no custom call."""
    _fake_gpu(monkeypatch, cc)
    with gemm_options(rowwise_cublaslt=opted_in):
        lines = _cuda_lines(lambda *a: rg.rowwise_gemm(*a, implementation=implementation),
                            *_operands())  # fmt: skip
    assert len(lines) == int(kernel)


def test_the_family_choice_xla_forces_the_reference(monkeypatch):
    _fake_gpu(monkeypatch, "9.0")
    with gemm_options(rowwise_cublaslt=True), fp8jax.ops.implementation(gemm="xla"):
        assert _cuda_lines(rg.rowwise_gemm, *_operands()) == []


def _emulated_rowwise_kernel(target, result_types):
    """The CUDA handler's contract for row-wise scales: padded operands (multiples of 16), split
    accumulation, mode 3 both ways, one float32 scale per (padded) row."""
    assert target == "fp8jax_gemm"
    out_type, _ = result_types

    def call(a, b, a_v, b_v, bias, *, has_bias, fast_accum, a_scale_mode, b_scale_mode, autotune):
        (m, k), n = a.shape, b.shape[0]
        assert m % 16 == 0 and n % 16 == 0 and k % 16 == 0 and b.shape[1] == k
        assert has_bias == 0 and fast_accum == 0 and bias.shape == (0,)
        assert int(a_scale_mode) == int(b_scale_mode) == 3
        assert a_v.shape == (m,) and b_v.shape == (n,) and a_v.dtype == b_v.dtype == jnp.float32
        out = rowwise_scaled_matmul(a, a_v[:, None], b, b_v[:, None], out_type.dtype)
        return out, jnp.zeros(result_types[1].shape, result_types[1].dtype)

    return call


@pytest.mark.parametrize("shape", [(100, 70, 300), (16, 32, 256), (3, 5, 40)], ids=str)
def test_cuda_branch_with_an_emulated_handler(shape, monkeypatch):
    """The CUDA branch's padding (zero codes, scale 1 rows) and slicing, run on CPU: the
    reference on the unpadded operands bit for bit (zero codes add exact zeros)."""
    m, n, k = shape
    args = _operands(m, n, k, seed=m + n)
    want = rowwise_scaled_matmul(*args, jnp.bfloat16)
    monkeypatch.setattr(jax.ffi, "ffi_call", _emulated_rowwise_kernel)
    got = rg._cuda_2d(*args, out_dtype=jnp.bfloat16)
    assert got.shape == (m, n) and got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


def test_bad_arguments_name_the_argument():
    aq, a_s, bq, b_s = _operands()
    with pytest.raises(ValueError, match="a_scale_inv must be float32"):
        rg.rowwise_gemm(aq, a_s[:50], bq, b_s)
    with pytest.raises(ValueError, match="same K"):
        rg.rowwise_gemm(aq, a_s, bq[:, :16], b_s)
    with pytest.raises(ValueError, match="implementation"):
        rg.rowwise_gemm(aq, a_s, bq, b_s, implementation="fast")
    with gemm_options(rowwise_cublaslt=True), pytest.raises(ValueError, match="b_scale_inv"):
        rg.rowwise_gemm(aq, a_s, bq, b_s.astype(jnp.bfloat16), implementation="kernel")
    with pytest.raises(TypeError, match="rowwise_cublaslt must be a bool"):
        gemm_options(rowwise_cublaslt=1)
    assert fp8jax.ops.get_gemm_options().rowwise_cublaslt is False  # the default: opt-in


# ------------------------------------------------------------------ the layers' GEMMs (_core)


def _dense_step(recipe):
    def step(x, w, b):
        def loss(x, w, b):
            return jnp.sum(fp8jax.dense(x, w, b, recipe=recipe) ** 2)

        return jax.grad(loss, (0, 1, 2))(x, w, b)

    return step


@pytest.mark.parametrize(("hp_wgrad", "calls"), [(False, 3), (True, 2)])
def test_the_layers_gemms_follow_the_opt_in(hp_wgrad, calls, monkeypatch):
    """fp8jax.dense under Float8RowwiseScaling lowered for CUDA: its fprop, dgrad and (FP8)
    wgrad are each one outer-vector cuBLASLt call when opted in, none otherwise."""
    _fake_gpu(monkeypatch, "9.0")
    recipe = fp8jax.Float8RowwiseScaling(wgrad_high_precision=hp_wgrad)
    args = (rand((64, 96), 1), rand((96, 48), 2) * 0.1, rand((48,), 3))
    assert _cuda_lines(_dense_step(recipe), *args) == []
    with gemm_options(rowwise_cublaslt=True):
        lines = _cuda_lines(_dense_step(recipe), *args)
    assert len(lines) == calls
    assert all("a_scale_mode = 3" in ln and "b_scale_mode = 3" in ln for ln in lines)


def test_the_layers_cpu_results_are_unchanged_by_the_option():
    recipe = fp8jax.Float8RowwiseScaling()
    args = (rand((64, 96), 1), rand((96, 48), 2) * 0.1, rand((48,), 3))
    want = jax.jit(_dense_step(recipe))(*args)
    with gemm_options(rowwise_cublaslt=True):
        got = jax.jit(_dense_step(recipe))(*args)
    if jax.default_backend() == "cpu":
        for g, w in zip(got, want, strict=True):
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
