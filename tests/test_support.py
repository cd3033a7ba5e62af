"""fp8_support() and extension loading."""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp
from conftest import has_cuda, requires_cuda

import fp8jax
from fp8jax import _ffi


def test_cpu_extension_always_built_and_registered():
    assert importlib.util.find_spec("fp8jax._fp8jax_cpu") is not None
    names = set(_ffi.cpu_extension().registrations())
    assert {"fp8jax_quantize", "fp8jax_dequantize", "fp8jax_cast_transpose"} <= names
    _ffi.ensure_registered()  # idempotent
    _ffi.ensure_registered()


def test_every_op_is_in_the_cpp_op_table_and_back():
    """The C++ op table (cpp/common/op_table.h) and the Python op declarations name the same
    targets: an op declared on one side only fails here."""
    from fp8jax.ops.base.opdef import registered_ops

    # the ragged grouped GEMM calls its target directly (fp8jax/ops/gemms/grouped_gemm.py), as
    # the GEMM does, rather than through an OpDef; it has a CPU kernel and a CUDA one
    targets = {op.target for op in registered_ops().values()} | {"fp8jax_grouped_gemm"}
    assert set(_ffi.cpu_extension().registrations()) == targets
    cuda = _ffi.cuda_extension()
    if cuda is not None:  # built with nvcc: the same table, plus the CUDA-only GEMM
        gemms = {"fp8jax_gemm", "fp8jax_gemm_gelu", "fp8jax_gemm_dgelu"}  # cuBLASLt, CUDA only
        sm90 = {"fp8jax_grouped_gemm_sm90"}  # built only with CUTLASS's headers (FP8JAX_CUTLASS)
        assert targets | gemms <= set(cuda.registrations()) <= targets | gemms | sm90


def test_fp8_support_on_cpu():
    if jax.default_backend() != "cpu":
        return
    ok, reason = fp8jax.fp8_support()
    assert ok and "emulated on CPU" in reason


@requires_cuda
def test_fp8_support_and_custom_call_on_gpu():
    assert has_cuda() and _ffi.cuda_extension() is not None
    ok, reason = fp8jax.fp8_support()
    assert ok, reason
    x = jnp.ones((64, 64), jnp.bfloat16)
    f = jax.jit(lambda x: fp8jax.ops.cast_transpose(x, jnp.float32(1), jnp.float8_e4m3fn))
    hlo = f.lower(x).compile().as_text()
    assert "fp8jax_cast_transpose" in hlo
    assert f(x)[0].devices().pop().platform == "gpu"
