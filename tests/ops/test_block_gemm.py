"""fp8jax.ops._block_gemm: the block-scaled GEMM on cuBLASLt, checked without a GPU. On CPU it is
the reference (bit for bit); lowered for CUDA it is one ``fp8jax_gemm`` call with the operands'
scale modes, padded operands and the scales in cuBLASLt's layout (as many as the handler's own
count); a GPU without a mode runs the reference (the same rule as the handler's check)."""

from __future__ import annotations

import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import load_testing_extension

from fp8jax.ops import _block_gemm as bg
from fp8jax.ops import block_scaling as bs

E4M3 = jnp.float8_e4m3fn

COMBOS = {
    "1x128-128x128": ((1, 128), (128, 128), False),
    "1x128-1x128": ((1, 128), (1, 128), False),
    "128x128-1x128": ((128, 128), (1, 128), False),
    "mxfp8": ((1, 32), (1, 32), True),
}


def _operands(combo, m=100, n=70, k=300, seed=0):
    a_block, b_block, mx = COMBOS[combo]
    r = np.random.default_rng(seed)
    x = jnp.asarray(r.standard_normal((m, k)), jnp.float32)
    w = jnp.asarray(r.standard_normal((n, k)) * 0.1, jnp.float32)

    def q(v, block):
        return bs.mxfp8_quantize(v, E4M3, block) if mx else bs.block_quantize(v, E4M3, block)

    return (*q(x, a_block), a_block, *q(w, b_block), b_block)


@pytest.mark.parametrize("combo", list(COMBOS))
@pytest.mark.parametrize("implementation", ["kernel", "xla"])
def test_on_cpu_it_is_the_reference(combo, implementation):
    args = _operands(combo)
    want = bs.block_scaled_matmul(*args, jnp.bfloat16)
    got = jax.jit(lambda *a: bg.block_gemm(*a[:2], args[2], *a[2:], args[5], jnp.bfloat16,
                                           implementation=implementation))(
        args[0], args[1], args[3], args[4])  # fmt: skip
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


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
def test_lowered_for_cuda_it_is_one_block_scaled_cublaslt_call(combo):
    a_block, b_block, mx = COMBOS[combo]
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
    ext = load_testing_extension(cuda=True)
    if ext is not None:  # the handler's own count of the scales cuBLASLt reads
        assert counts == [ext._block_scale_count(modes[0], 112, 304),
                          ext._block_scale_count(modes[1], 80, 304)]  # fmt: skip


@pytest.mark.parametrize("cc_major", [8, 9, 10, 12])
@pytest.mark.parametrize("mode", [0, 2, 4, 5])
def test_the_python_mode_rule_is_the_handlers(mode, cc_major):
    ext = load_testing_extension(cuda=True)
    if ext is None:
        pytest.skip("the CUDA testing extension is not built")
    assert bg.scale_mode_unsupported(mode, cc_major) == ext._scale_mode_unsupported(
        mode, cc_major, 130100
    )
    if mode in (4, 5) and cc_major == 9:  # the cuBLAS version the handler also checks
        assert "cuBLAS 12.9" in ext._scale_mode_unsupported(mode, 9, 120800)


@pytest.mark.parametrize(
    ("cc", "combo", "kernel"),
    [("9.0", "1x128-128x128", True), ("9.0", "mxfp8", False), ("10.0", "1x128-1x128", False),
     ("10.0", "mxfp8", True), ("12.0", "mxfp8", True), ("8.9", "1x128-1x128", False)],
)  # fmt: skip
def test_a_gpu_without_the_mode_runs_the_reference(cc, combo, kernel, monkeypatch):
    fake = types.SimpleNamespace(compute_capability=cc)
    real = jax.devices
    monkeypatch.setattr(jax, "devices", lambda *a: [fake] if a == ("gpu",) else real(*a))
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
