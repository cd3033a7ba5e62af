"""The cuBLASLt FP8 GEMM's host-side setup (cpp/cuda/gemm_cublaslt.cc), checked without a GPU.

Everything the handler does before ``cublasLtMatmul`` -- argument checks, the matmul descriptor
(compute/scale type, transposes, fast or split accumulation, scale pointers, bias epilogue and
bias dtype), the three matrix layouts and the heuristic preference -- is built by the same code
with placeholder device pointers and read back from cuBLASLt. Loading the CUDA extension runs no
CUDA call, so this runs wherever the extension was built (nvcc at build time), GPU or not.

What needs a device: ``cublasLtCreate`` (the handle; see ``test_what_needs_a_device``) and hence
the heuristic query ``cublasLtMatmulAlgoGetHeuristic`` and ``cublasLtMatmul``, which take it.
"""

from __future__ import annotations

import itertools

import pytest
from conftest import load_testing_extension

from fp8jax import _ffi

cuda = _ffi.cuda_extension()
pytestmark = pytest.mark.skipif(
    cuda is None,
    reason="the CUDA extension is not built (no nvcc when fp8jax was built); the cuBLASLt setup "
    "lives in it",
)
# The host-side GEMM setup lives in the test-only CUDA extension.
setup = load_testing_extension(cuda=True) if cuda is not None else None

FP8 = ("float8_e4m3fn", "float8_e5m2")
OUT = ("float32", "bfloat16", "float16")
M, N, K = 48, 32, 64  # K, N multiples of 16; M free


def consts():
    return setup._cublaslt_constants()


def cuda_type(name: str) -> int:
    c = consts()
    return {
        "float8_e4m3fn": c["CUDA_R_8F_E4M3"],
        "float8_e5m2": c["CUDA_R_8F_E5M2"],
        "float32": c["CUDA_R_32F"],
        "bfloat16": c["CUDA_R_16BF"],
        "float16": c["CUDA_R_16F"],
    }[name]


CASES = list(itertools.product(FP8, FP8, OUT, (0, 1), (0, 1)))


@pytest.mark.parametrize(("a", "b", "out", "fast_accum", "has_bias"), CASES)
def test_setup_for_every_dtype_combination(a, b, out, fast_accum, has_bias):
    bias = out if has_bias else "none"
    args = dict(a=a, b=b, out=out, m=M, n=N, k=K, has_bias=has_bias, fast_accum=fast_accum)
    if a == b == "float8_e5m2":
        with pytest.raises(ValueError, match="E5M2 x E5M2 is not supported"):
            setup._gemm_setup(**args, bias=bias, bias_count=N)
        return
    if has_bias and out == "float32":
        with pytest.raises(ValueError, match="fused bias needs a bfloat16 or float16 output"):
            setup._gemm_setup(**args, bias=bias, bias_count=N)
        return
    s = setup._gemm_setup(**args, bias=bias, bias_count=N if has_bias else 0)
    c = consts()
    assert s["desc.compute_type"] == c["CUBLAS_COMPUTE_32F"]
    assert s["desc.scale_type"] == c["CUDA_R_32F"]
    # out[M, N] row-major = (b^T a) column-major: cuBLASLt's A is our b (transposed), B our a.
    assert s["desc.transa"] == c["CUBLAS_OP_T"]
    assert s["desc.transb"] == c["CUBLAS_OP_N"]
    assert s["desc.fast_accum"] == fast_accum  # 0: split accumulation (dgrad, wgrad)
    assert s["desc.a_scale_pointer"] == c["fake_b_scale_inv"]
    assert s["desc.b_scale_pointer"] == c["fake_a_scale_inv"]
    if has_bias:
        assert s["desc.epilogue"] == c["CUBLASLT_EPILOGUE_BIAS"]
        assert s["desc.bias_pointer"] == c["fake_bias"]
        assert s["desc.bias_data_type"] == cuda_type(out)
    else:
        assert s["desc.epilogue"] == c["CUBLASLT_EPILOGUE_DEFAULT"]
        assert s["desc.bias_pointer"] == 0
    layouts = {
        "a": (cuda_type(b), K, N, K),  # our b: K x N column-major, ld K
        "b": (cuda_type(a), K, M, K),  # our a: K x M, ld K
        "d": (cuda_type(out), N, M, N),  # out: N x M, ld N
    }
    for name, (dtype, rows, cols, ld) in layouts.items():
        got = tuple(s[f"layout_{name}.{f}"] for f in ("type", "rows", "cols", "ld"))
        assert got == (dtype, rows, cols, ld), name
        assert s[f"layout_{name}.order"] == c["CUBLASLT_ORDER_COL"]
    assert s["pref.max_workspace_bytes"] == 32 * 2**20
    assert s["pref.min_alignment_a"] == 256 and s["pref.min_alignment_d"] == 256


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(a="int8"), "a and b must be float8"),
        (dict(b="float32"), "a and b must be float8"),
        (dict(out="int8"), "output must be float32, bfloat16 or float16"),
        (dict(k=40), "multiples of 16"),
        (dict(n=24, bias_count=24), "multiples of 16"),
        (dict(k=0), "K must be > 0"),
        (dict(m=-1), "negative dimension"),
        (dict(has_bias=2), "has_bias and fast_accum must be 0 or 1"),
        (dict(fast_accum=-1), "has_bias and fast_accum must be 0 or 1"),
        (dict(bias="float16"), "bias must have N elements of the output dtype"),
        (dict(bias_count=N - 1), "bias must have N elements of the output dtype"),
    ],
)
def test_rejected_problems(change, message):
    args = dict(
        a="float8_e4m3fn",
        b="float8_e5m2",
        out="bfloat16",
        m=M,
        n=N,
        k=K,
        has_bias=1,
        fast_accum=0,
        bias="bfloat16",
        bias_count=N,
    )
    args.update(change)
    with pytest.raises(ValueError, match=message):
        setup._gemm_setup(**args)


def test_empty_output_needs_no_k():
    """M == 0 or N == 0: nothing to compute; K == 0 is then accepted (the handler returns)."""
    s = setup._gemm_setup("float8_e4m3fn", "float8_e4m3fn", "float32", 0, 32, 0, 0, 1)
    assert s["layout_b.cols"] == 0


def test_what_needs_a_device():
    """cublasLtCreate needs a CUDA device (the descriptors above do not); so does everything that
    takes the handle: the heuristic query and the matmul. On a machine with no GPU or driver it
    returns CUBLAS_STATUS_NOT_INITIALIZED (seen on the project's CPU machines); with JAX's CUDA
    backend up it must succeed."""
    status = setup._probe_cublaslt_create()
    assert status.startswith("CUBLAS_STATUS_"), status
    if _ffi.jax_has_cuda():
        assert status == "CUBLAS_STATUS_SUCCESS"


def test_registration_traits():
    """Every CUDA target is registered as command-buffer (CUDA graph) compatible, and the GEMM
    brings an initialize stage (handle and heuristic query outside graph capture)."""
    regs = cuda.registrations()
    traits = cuda.traits()
    assert set(traits) == set(regs)
    assert all(v == 1 for v in traits.values())  # XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE
    assert set(regs["fp8jax_gemm"]) == {"initialize", "execute"}
    assert _ffi._traits_kwargs(traits, "fp8jax_gemm")["traits"] == 1
    assert _ffi._traits_kwargs({}, "fp8jax_gemm") == {}


def test_cuda_registration_passes_traits_and_stages(monkeypatch):
    """What ensure_registered hands JAX for the CUDA platform (JAX's CUDA backend faked)."""
    calls = []
    monkeypatch.setattr(_ffi, "jax_has_cuda", lambda: True)
    monkeypatch.setattr(
        _ffi.jax.ffi, "register_ffi_target", lambda name, fn, **kw: calls.append((name, fn, kw))
    )
    _ffi.ensure_registered.__wrapped__()
    cuda_calls = {name: (fn, kw) for name, fn, kw in calls if kw["platform"] == "CUDA"}
    assert set(cuda_calls) == set(cuda.registrations())
    for _, kw in cuda_calls.values():
        assert int(kw["traits"]) == 1  # COMMAND_BUFFER_COMPATIBLE
    assert set(cuda_calls["fp8jax_gemm"][0]) == {"initialize", "execute"}
