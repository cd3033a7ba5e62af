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

import jax
import jax.numpy as jnp
import numpy as np
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
        "c": (cuda_type(out), N, M, N),  # C is D (beta = 0)
        "d": (cuda_type(out), N, M, N),  # out: N x M, ld N
    }
    for name, (dtype, rows, cols, ld) in layouts.items():
        got = tuple(s[f"layout_{name}.{f}"] for f in ("type", "rows", "cols", "ld"))
        assert got == (dtype, rows, cols, ld), name
        assert s[f"layout_{name}.order"] == c["CUBLASLT_ORDER_COL"]
    assert s["pref.max_workspace_bytes"] == 32 * 2**20
    assert s["pref.min_alignment_a"] == 256 and s["pref.min_alignment_d"] == 256
    assert "desc.d_scale_pointer" not in s  # only the FP8-output epilogues read it


# ------------------------------------------------------------ the GELU epilogues (issue 36)

# (a, b, out) of the MLP's first GEMM (E4M3 x E4M3 -> E4M3) and its dgrad (E5M2 x E4M3 -> E5M2).
GELU_TYPES = {1: ("float8_e4m3fn",) * 3, 2: ("float8_e5m2", "float8_e4m3fn", "float8_e5m2")}


def _gelu_args(epilogue, has_bias=1, wide="bfloat16", **change):
    a, b, out = GELU_TYPES[epilogue]
    args = dict(a=a, b=b, out=out, m=M, n=N, k=K, has_bias=has_bias, fast_accum=int(epilogue == 1),
                bias=wide, bias_count=N if has_bias else 0, epilogue=epilogue, aux="float16",
                aux_count=M * N, d_scale_count=1, amax_count=1)  # fmt: skip
    return args | change


@pytest.mark.parametrize("wide", ["bfloat16", "float16"])
@pytest.mark.parametrize("has_bias", [0, 1])
@pytest.mark.parametrize("epilogue", [1, 2], ids=["gelu", "dgelu"])
def test_gelu_epilogue_setup(epilogue, has_bias, wide):
    """What cuBLASLt documents for an FP8 D with a GELU epilogue: D's scale and amax pointers,
    the GELU input (ld N, float16: the one 16-bit aux type it takes beside an FP8 D), the bias
    (gradient) and C in the 16-bit epilogue dtype, no C pointer (its alignment: the largest)."""
    s = setup._gemm_setup(**_gelu_args(epilogue, has_bias, wide))
    c = consts()
    names = {(1, 0): "GELU_AUX", (1, 1): "GELU_AUX_BIAS", (2, 0): "DGELU", (2, 1): "DGELU_BGRAD"}
    assert s["desc.epilogue"] == c["CUBLASLT_EPILOGUE_" + names[epilogue, has_bias]]
    assert s["desc.d_scale_pointer"] == c["fake_d_scale"]
    assert s["desc.amax_d_pointer"] == c["fake_amax"]
    assert s["desc.aux_pointer"] == c["fake_aux"]
    assert s["desc.aux_ld"] == N and s["desc.aux_data_type"] == c["CUDA_R_16F"]
    assert s["desc.fast_accum"] == int(epilogue == 1)  # the dgrad accumulates in full
    if has_bias:  # GELU: the bias read; DGELU: the bias gradient written
        assert s["desc.bias_pointer"] == c["fake_bias"]
        assert s["desc.bias_data_type"] == cuda_type(wide)
    else:
        assert s["desc.bias_pointer"] == 0
    out = GELU_TYPES[epilogue][2]
    assert (s["layout_d.type"], s["layout_d.rows"], s["layout_d.ld"]) == (cuda_type(out), N, N)
    assert (s["layout_c.type"], s["layout_c.rows"], s["layout_c.ld"]) == (cuda_type(wide), N, N)
    assert s["pref.min_alignment_c"] == 256


@pytest.mark.parametrize(
    ("epilogue", "change", "message"),
    [
        (1, dict(out="bfloat16"), "GELU epilogues write float8"),
        (1, dict(out="float8_e5m2"), "E4M3 x E4M3 GEMM cannot write E5M2"),
        (1, dict(bias="float32"), "must be bfloat16 or float16"),
        (2, dict(bias="none", has_bias=0, bias_count=0), "must be bfloat16 or float16"),
        (1, dict(bias_count=N - 16), "bias must have N elements"),
        (2, dict(has_bias=0, bias_count=N), "none without has_bias"),
        (1, dict(aux="bfloat16"), "GELU input must be float16"),
        (2, dict(aux_count=M), "GELU input must be float16"),
        (1, dict(d_scale_count=0), "one float32 scale"),
        (2, dict(amax_count=2), "one float32 amax"),
        (1, dict(epilogue=3), "epilogue must be 0"),
        (
            2,
            dict(a_scale_mode=4, b_scale_mode=4, a_scale_count=M, b_scale_count=N, fast_accum=0),
            "per-tensor scales",
        ),
    ],
)
def test_rejected_gelu_epilogue_problems(epilogue, change, message):
    args = _gelu_args(epilogue, **{k: v for k, v in change.items() if k != "epilogue"})
    with pytest.raises(ValueError, match=message):
        setup._gemm_setup(**(args | {k: v for k, v in change.items() if k == "epilogue"}))


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


GEMM_TARGETS = ("fp8jax_gemm", "fp8jax_gemm_gelu", "fp8jax_gemm_dgelu")


def test_registration_traits():
    """Every CUDA target is registered as command-buffer (CUDA graph) compatible, and each GEMM
    brings an initialize stage (handle, heuristic query and autotuning outside graph capture)."""
    regs = cuda.registrations()
    traits = cuda.traits()
    assert set(traits) == set(regs)
    assert all(v == 1 for v in traits.values())  # XLA_FFI_HANDLER_TRAITS_COMMAND_BUFFER_COMPATIBLE
    for target in GEMM_TARGETS:
        assert set(regs[target]) == {"initialize", "execute"}
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
    for target in GEMM_TARGETS:
        assert set(cuda_calls[target][0]) == {"initialize", "execute"}


# ------------------------------------------------------------ block-scaled GEMMs (issue 21)


def _cdiv(a, b):
    return -(-a // b)


def _scale_count(mode, rows, k):
    """The scales cuBLASLt reads (cuBLAS docs, "Narrow precision data types usage")."""
    if mode == 0:
        return 1
    if mode == 3:  # OUTER_VEC_32F (row-wise): one per row
        return rows
    if mode == 4:  # VEC128_32F: rows x ceil(K/128), rows a multiple of 4
        return rows * _cdiv(k, 128)
    if mode == 5:  # BLK128x128_32F: K-major, column stride rounded up to 4
        return _cdiv(rows, 128) * _cdiv(_cdiv(k, 128), 4) * 4
    return _cdiv(rows, 128) * 128 * _cdiv(_cdiv(k, 32), 4) * 4  # VEC32_UE8M0: 128 x 4 tiles


MODE_PAIRS = [(4, 5), (5, 4), (4, 4), (2, 2), (3, 3), (0, 0)]


@pytest.mark.parametrize(("a_mode", "b_mode"), MODE_PAIRS)
def test_block_scale_modes_reach_the_descriptor(a_mode, b_mode):
    m, n, k = 256, 384, 640
    s = setup._gemm_setup(
        "float8_e4m3fn", "float8_e5m2", "bfloat16", m, n, k, 0, 0, a_scale_mode=a_mode,
        b_scale_mode=b_mode, a_scale_count=_scale_count(a_mode, m, k),
        b_scale_count=_scale_count(b_mode, n, k),
    )  # fmt: skip
    # cuBLASLt's A is our b: the modes swap as the scale pointers do
    assert (s["desc.a_scale_mode"], s["desc.b_scale_mode"]) == (b_mode, a_mode)
    c = consts()
    names = {0: "SCALAR_32F", 2: "VEC32_UE8M0", 3: "OUTER_VEC_32F", 4: "VEC128_32F",
             5: "BLK128x128_32F"}  # fmt: skip
    assert c["CUBLASLT_MATMUL_MATRIX_SCALE_" + names[a_mode]] == a_mode
    assert s["desc.fast_accum"] == 0


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(a_scale_mode=5, b_scale_mode=5), "at most one operand may have 128 x 128"),
        (dict(a_scale_mode=4, b_scale_mode=0), "both per tensor"),
        (dict(a_scale_mode=2, b_scale_mode=4), "both per tensor"),
        (dict(a_scale_mode=1, b_scale_mode=1), "must be 0 \\(per tensor\\), 2"),
        (dict(a_scale_mode=6, b_scale_mode=6), "3 \\(OUTER_VEC_32F\\)"),
        (dict(a_scale_mode=3, b_scale_mode=0), "both OUTER_VEC_32F"),
        (dict(a_scale_mode=4, b_scale_mode=3), "both OUTER_VEC_32F"),
        (dict(a_scale_mode=3, b_scale_mode=3, fast_accum=1), "need split accumulation"),
        (dict(a_scale_mode=3, b_scale_mode=3, a_scale_count=1), "M and N row-wise"),
        (dict(a_scale_mode=3, b_scale_mode=3, b_scale_count=64), "must hold the scales"),
        (dict(a_scale_mode=3, b_scale_mode=3, a_scale_dtype="float8_e8m0fnu"), "must be float32"),
        (dict(a_scale_mode=4, b_scale_mode=4, fast_accum=1), "need split accumulation"),
        (dict(a_scale_mode=4, b_scale_mode=4, m=50), "M and N multiples of 4"),
        (dict(a_scale_mode=4, b_scale_mode=4, a_scale_count=7), "must hold the scales"),
        (dict(a_scale_count=2), "must hold the scales"),
    ],
)
def test_rejected_block_scale_problems(change, message):
    m, n, k = change.pop("m", 64), 32, 256
    args = dict(a="float8_e4m3fn", b="float8_e4m3fn", out="float32", m=m, n=n, k=k, has_bias=0,
                fast_accum=0)  # fmt: skip
    args.update({key: v for key, v in change.items() if key == "fast_accum"})
    modes = {key: v for key, v in change.items() if key.endswith("mode")}
    a_mode, b_mode = modes.get("a_scale_mode", 0), modes.get("b_scale_mode", 0)
    known = (0, 2, 3, 4, 5)
    counts = dict(
        a_scale_count=_scale_count(a_mode, m, k) if a_mode in known else 1,
        b_scale_count=_scale_count(b_mode, n, k) if b_mode in known else 1,
    )
    counts.update({key: v for key, v in change.items() if key.endswith(("count", "dtype"))})
    with pytest.raises(ValueError, match=message):
        setup._gemm_setup(**args, **modes, **counts)


@pytest.mark.parametrize("mode", [4, 5, 2])
@pytest.mark.parametrize(("rows", "k"), [(128, 256), (260, 416), (36, 1000)], ids=str)
def test_block_scale_layouts_agree_with_the_python_side(mode, rows, k):
    """common/block_scale_layout.h (what a CUDA handler will use) and
    fp8jax.ops.block.block_scaling.cublaslt_scales put every scale at the same place: distinct
    places inside the count, the count as documented."""
    from fp8jax.ops.block import block_scaling as bs

    block = {4: (1, 128), 5: (128, 128), 2: (1, 32)}[mode]
    grid = (_cdiv(rows, block[0]), _cdiv(k, block[1]))
    count = setup._block_scale_count(mode, rows, k)
    assert count == _scale_count(mode, rows, k)
    cpp = [
        setup._block_scale_index(mode, r, j, rows, k)
        for r in range(grid[0])
        for j in range(grid[1])
    ]
    assert len(set(cpp)) == len(cpp) and 0 <= min(cpp) and max(cpp) < count
    values = np.arange(1, grid[0] * grid[1] + 1, dtype=np.float32).reshape(grid)
    if mode == 2:
        values = (values % 250 + 1).astype(np.uint8)  # E8M0 bits, never the zero padding
        scale = jax.lax.bitcast_convert_type(jnp.asarray(values), jnp.float8_e8m0fnu)
    else:
        scale = jnp.asarray(values)
    flat = bs.cublaslt_scales(scale, block, rows, k)
    assert flat.shape == (count,) and flat.dtype == scale.dtype
    got = np.asarray(jax.lax.bitcast_convert_type(flat, jnp.uint8) if mode == 2 else flat)
    np.testing.assert_array_equal(got[cpp], values.ravel())
    pad = np.ones(count, bool)
    pad[cpp] = False
    assert (got[pad] == 0).all()  # cuBLASLt wants zeros outside the matrix


def test_the_mxfp8_tile_layout_as_documented():
    """The 128 x 4 tile of cuBLAS's documentation: row r, K block j at (r % 32) * 16 +
    (r // 32) * 4 + j inside a 512-byte tile; tiles row-major."""
    assert setup._block_scale_index(2, 0, 0, 256, 256) == 0
    assert setup._block_scale_index(2, 1, 0, 256, 256) == 16
    assert setup._block_scale_index(2, 32, 0, 256, 256) == 4
    assert setup._block_scale_index(2, 0, 3, 256, 256) == 3
    assert setup._block_scale_index(2, 0, 4, 256, 512) == 512  # the next tile along K
    # K = 512 is 16 K blocks, 4 tiles along K: the next row of tiles starts 4 tiles on
    assert setup._block_scale_index(2, 128, 0, 256, 512) == 4 * 512


# ------------------------------------------------------- row-wise GEMMs (issue 49, OUTER_VEC_32F)


@pytest.mark.parametrize(("m", "n", "k"), [(48, 32, 64), (50, 16, 1008), (1, 16, 16)], ids=str)
def test_rowwise_scales_reach_the_descriptor(m, n, k):
    """OUTER_VEC_32F for both operands: M scales for our a, N for our b, on cuBLASLt's B and A
    (its A is our b), split accumulation; no multiple-of-4 rule on M (the Python side pads M to
    16 anyway), one scale per row whatever K."""
    s = setup._gemm_setup(
        "float8_e4m3fn", "float8_e4m3fn", "float32", m, n, k, 0, 0, a_scale_mode=3,
        b_scale_mode=3, a_scale_count=m, b_scale_count=n,
    )  # fmt: skip
    c = consts()
    assert c["CUBLASLT_MATMUL_MATRIX_SCALE_OUTER_VEC_32F"] == 3
    assert (s["desc.a_scale_mode"], s["desc.b_scale_mode"]) == (3, 3)
    assert s["desc.a_scale_pointer"] == c["fake_b_scale_inv"]  # cuBLASLt's A vector: our N
    assert s["desc.b_scale_pointer"] == c["fake_a_scale_inv"]
    assert s["desc.fast_accum"] == 0
    assert setup._block_scale_count(3, m, k) == m
    assert [setup._block_scale_index(3, r, 7, m, k) for r in range(m)] == list(range(m))


@pytest.mark.parametrize(("cc_major", "version", "why"), [
    (9, 130100, ""), (9, 120900, ""), (9, 120800, "need cuBLAS 12.9"),
    (8, 130100, "need an sm_90"), (10, 130100, "need an sm_90"), (12, 130100, "need an sm_90"),
])  # fmt: skip
def test_rowwise_scales_need_hopper(cc_major, version, why):
    got = setup._scale_mode_unsupported(3, cc_major, version)
    assert (got == "") if not why else (why in got and "OUTER_VEC_32F" in got)
