"""fp8jax.ops.gemms.blockwise: the block-scaled GEMM on cuBLASLt. On CPU it is the reference (bit
for bit), on a GPU within GEMM_GPU_CLOSE of it (cuBLASLt's accumulation order); lowered for CUDA it
is one ``fp8jax_gemm`` call with the operands' scale modes, padded operands and the scales in
cuBLASLt's layout (as many as the handler's own count); a GPU without a mode runs the reference
(the same rule as the handler's check)."""

from __future__ import annotations

import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _samples import GEMM_GPU_CLOSE
from _shared import normal
from _values import assert_matches
from conftest import load_testing_extension

from fp8jax import _ffi
from fp8jax.ops.block import block_scaling as bs
from fp8jax.ops.gemms import blockwise as bg

E4M3 = jnp.float8_e4m3fn
# the handler's own rules, on the host (absent only where the CUDA extension is not built)
CUDA_TESTING = load_testing_extension(cuda=True) if _ffi.cuda_extension() is not None else None

COMBOS = {
    "1x128-128x128": ((1, 128), (128, 128), False),
    "1x128-1x128": ((1, 128), (1, 128), False),
    "128x128-1x128": ((128, 128), (1, 128), False),
    "mxfp8": ((1, 32), (1, 32), True),
}


def _operands(combo, m=100, n=70, k=300, seed=0):
    a_block, b_block, mx = COMBOS[combo]
    r = np.random.default_rng(seed)
    x, w = normal(r, (m, k)), normal(r, (n, k), scale=0.1)

    def q(v, block):
        return bs.mxfp8_quantize(v, E4M3, block) if mx else bs.block_quantize(v, E4M3, block)

    return (*q(x, a_block), a_block, *q(w, b_block), b_block)


@pytest.mark.parametrize("combo", list(COMBOS))
@pytest.mark.parametrize("implementation", ["kernel", "xla"])
def test_it_is_the_reference(combo, implementation):
    args = _operands(combo)
    want = bs.block_scaled_matmul(*args, jnp.bfloat16)
    got = jax.jit(lambda *a: bg.block_gemm(*a[:2], args[2], *a[2:], args[5], jnp.bfloat16,
                                           implementation=implementation))(
        args[0], args[1], args[3], args[4])  # fmt: skip
    assert got.dtype == jnp.bfloat16
    exact = jax.default_backend() == "cpu"  # a GPU: cuBLASLt's sums (or XLA's) in their order
    assert_matches(got, want, exact, **({} if exact else GEMM_GPU_CLOSE))


def _fake_gpu(monkeypatch, cc: str) -> None:
    """``jax.devices("gpu")`` answers one device of compute capability ``cc``."""
    fake = types.SimpleNamespace(compute_capability=cc)
    real = jax.devices
    monkeypatch.setattr(jax, "devices", lambda *a: [fake] if a == ("gpu",) else real(*a))


def _cuda_call(combo, **kw) -> str | None:
    """The ``fp8jax_gemm`` line of the function lowered for CUDA, or None."""
    args = _operands(combo, **kw)

    def fn(aq, a_s, bq, b_s):
        return bg.block_gemm(aq, a_s, args[2], bq, b_s, args[5])

    text = jax.jit(fn).trace(args[0], args[1], args[3], args[4])
    text = text.lower(lowering_platforms=("cuda",)).as_text()
    lines = [line for line in text.splitlines() if "custom_call @fp8jax_gemm" in line]
    assert len(lines) <= 1
    return lines[0] if lines else None


@pytest.mark.parametrize("combo", list(COMBOS))
def test_lowered_for_cuda_it_is_one_block_scaled_cublaslt_call(combo, monkeypatch):
    a_block, b_block, mx = COMBOS[combo]
    _fake_gpu(monkeypatch, "10.0" if mx else "9.0")  # a GPU with the mode, whatever this one is
    line = _cuda_call(combo)
    assert line is not None
    modes = (bs.CUBLASLT_SCALE_MODES[a_block], bs.CUBLASLT_SCALE_MODES[b_block])
    assert f"a_scale_mode = {modes[0]}" in line and f"b_scale_mode = {modes[1]}" in line
    assert "fast_accum = 0" in line  # block modes need split accumulation
    types_ = re.search(r"\} : \((.*)\) -> \(", line).group(1).split(", ")
    # M 100 -> 112, N 70 -> 80, K 300 -> 304: multiples of 16 (zero codes)
    assert types_[0] == "tensor<112x304xf8E4M3FN>" and types_[1] == "tensor<80x304xf8E4M3FN>"
    counts = [int(re.match(r"tensor<(\d+)x", t).group(1)) for t in types_[2:4]]
    scale_dtype = "f8E8M0FNU" if mx else "f32"
    assert all(t.endswith(f"x{scale_dtype}>") for t in types_[2:4])
    if CUDA_TESTING is not None:  # the handler's own count of the scales cuBLASLt reads
        assert counts == [CUDA_TESTING._block_scale_count(modes[0], 112, 304),
                          CUDA_TESTING._block_scale_count(modes[1], 80, 304)]  # fmt: skip


@pytest.mark.parametrize("cc_major", [8, 9, 10, 12])
@pytest.mark.parametrize("mode", [0, 2, 3, 4, 5])
def test_the_python_mode_rule_is_the_handlers(mode, cc_major):
    if CUDA_TESTING is None:
        pytest.skip("the CUDA extension is not built (the handler's rule lives in it)")
    assert bg.scale_mode_unsupported(mode, cc_major) == CUDA_TESTING._scale_mode_unsupported(
        mode, cc_major, 130100
    )
    if mode in (3, 4, 5) and cc_major == 9:  # the cuBLAS version the handler also checks
        assert "cuBLAS 12.9" in CUDA_TESTING._scale_mode_unsupported(mode, 9, 120800)


@pytest.mark.parametrize(
    ("cc", "combo", "kernel"),
    [("9.0", "1x128-128x128", True), ("9.0", "mxfp8", False), ("10.0", "1x128-1x128", False),
     ("10.0", "mxfp8", True), ("12.0", "mxfp8", True), ("8.9", "1x128-1x128", False)],
)  # fmt: skip
def test_a_gpu_without_the_mode_runs_the_reference(cc, combo, kernel, monkeypatch):
    _fake_gpu(monkeypatch, cc)
    assert (_cuda_call(combo) is not None) == kernel


def test_bad_operands_name_the_argument():
    args = list(_operands("1x128-1x128"))
    with pytest.raises(ValueError, match="block must be a pair"):
        bg.block_gemm(args[0], args[1], (1, 0), *args[3:])
    a, a_s, _, b, b_s, _ = _operands("1x128-128x128")
    with pytest.raises(ValueError, match="at most one may"):
        bg.block_gemm(b, b_s, (128, 128), b, b_s, (128, 128))
    with pytest.raises(ValueError, match="implementation"):
        bg.block_gemm(a, a_s, (1, 128), b, b_s, (128, 128), implementation="fast")


# ------------------------------------------------ the CUDA branch, with an emulated handler

_BLOCK_OF_MODE = {4: (1, 128), 5: (128, 128), 2: (1, 32)}


def _layout_index(mode, rows, k, traced=False):
    """For each compact grid entry (row-major), where cuBLASLt reads it: the documented layouts,
    written out as index formulas (cuBLAS docs, "Narrow precision data types usage"). ``traced``:
    from iotas, not numpy constants (custom_partitioning refuses constants)."""
    kb = -(-k // (32 if mode == 2 else 128))
    grid_rows = -(-rows // 128) if mode == 5 else rows
    if traced:
        r, j = (jax.lax.broadcasted_iota(jnp.int32, (grid_rows, kb), d) for d in (0, 1))
    else:
        r, j = np.meshgrid(np.arange(grid_rows), np.arange(kb), indexing="ij")
    if mode == 4:
        return j * rows + r
    if mode == 5:
        return r * (-(-kb // 4) * 4) + j
    return ((r // 128) * -(-kb // 4) + j // 4) * 512 + (r % 32) * 16 + (r % 128 // 32) * 4 + j % 4


def _emulated_block_kernel(target, result_types, traced=False):
    """The CUDA handler's contract for block scales: padded operands, split accumulation, each
    scale buffer in cuBLASLt's layout (decoded here with the index formulas above)."""
    assert target == "fp8jax_gemm"
    out_type, _ = result_types

    def call(a, b, a_sl, b_sl, bias, *, has_bias, fast_accum, a_scale_mode, b_scale_mode, autotune):
        (m, k), n = a.shape, b.shape[0]
        assert m % 16 == 0 and n % 16 == 0 and k % 16 == 0 and b.shape[1] == k
        assert has_bias == 0 and fast_accum == 0 and bias.shape == (0,)
        grids = []
        for flat, mode, rows in ((a_sl, int(a_scale_mode), m), (b_sl, int(b_scale_mode), n)):
            idx = _layout_index(mode, rows, k, traced)
            grids.append(jnp.asarray(flat)[idx])
        out = bs.block_scaled_matmul(a, grids[0], _BLOCK_OF_MODE[int(a_scale_mode)], b,
                                     grids[1], _BLOCK_OF_MODE[int(b_scale_mode)],
                                     out_type.dtype)  # fmt: skip
        return out, jnp.zeros(result_types[1].shape, result_types[1].dtype)

    return call


@pytest.mark.parametrize("combo", list(COMBOS))
@pytest.mark.parametrize("shape", [(100, 70, 300), (16, 32, 256), (3, 5, 40)], ids=str)
def test_cuda_branch_with_an_emulated_handler(combo, shape, monkeypatch):
    """The CUDA branch's padding, scale layouts and slicing, run on CPU: the result equals the
    reference on the unpadded operands bit for bit."""
    m, n, k = shape
    aq, a_s, a_block, bq, b_s, b_block = _operands(combo, m=m, n=n, k=k, seed=m + n)
    want = bs.block_scaled_matmul(aq, a_s, a_block, bq, b_s, b_block, jnp.bfloat16)
    monkeypatch.setattr(jax.ffi, "ffi_call", _emulated_block_kernel)
    got = bg._cuda_2d(aq, a_s, bq, b_s, a_block=a_block, b_block=b_block, out_dtype=jnp.bfloat16)
    assert got.shape == (m, n) and got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
