"""The grouped GEMM's tensor-core path on Hopper (cpp/sm90/grouped_gemm.cu, opt-in by
``gemm_options(grouped_tensor_cores=True)``), as far as it is checked without a GPU: the
device-side preparation kernels (each group's problem, operand offsets and epilogue scale, the
output the GEMM leaves alone zeroed) run on the host runtime against a numpy oracle; the
workspace layout Python sizes is the C++ one; the compiled CUTLASS instantiations are the ones
Python dispatches to, each within the workspace Python gives it; the choice of path; and the
CUDA lowering of an MoE train step, whose six expert GEMMs all call the tensor-core target.
Its numerics on a GPU (bits against the host run, speed) are the GPU measurement issue's
(tools/gpu_check.sh perf)."""

from __future__ import annotations

import functools
import importlib
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _samples import GEMM_GPU_CLOSE
from _shared import rand
from _values import assert_matches

import fp8jax
from fp8jax import _ffi
from fp8jax.functional.moe import MoEConfig
from fp8jax.ops.block.grouped_scaling import segment_grid_size, segment_padded

tc = importlib.import_module("fp8jax.ops.gemms._grouped_tensor_cores")
TARGET = "fp8jax_grouped_gemm_sm90"


def _host_cuda():
    try:
        return importlib.import_module("fp8jax._fp8jax_host_cuda")
    except ImportError:
        pytest.skip("the host run of the CUDA kernels is not built (no CUDA toolkit headers)")


@pytest.mark.parametrize("groups", [1, 7, 8, 256])
def test_workspace_layout_is_the_cpp_one(groups):
    assert _host_cuda().grouped_tc_workspace(groups)["bytes"] == tc.sm90_workspace_bytes(groups)


def _oracle(sizes, a_scale, b_scale, form, rows, cols, depth, width, out_bytes, b_grid=None):
    """Per group (m, n, k, a offset, b offset, out offset, alpha, scale offsets: into the
    transposed grids under block scales, else -1) and the zeroed output bytes. ``b_grid``: block
    scales, b's grid per group (rows, cols)."""
    ragged = rows if form == 0 else depth
    begin, blocks, out, zeroed = 0, 0, [], []
    for g, size in enumerate(sizes):
        end = min(begin + max(int(size), 0), ragged)
        n = end - begin
        alpha = 1.0 if b_grid else float(np.float32(a_scale[g]) * np.float32(b_scale[g]))
        if form == 0:
            sf = (begin, g * b_grid[0] * b_grid[1]) if b_grid else (-1, -1)
            out.append((n, cols, depth, begin * depth, g * cols * depth, begin * cols, alpha, *sf))
        else:
            start = blocks * width
            sf = (blocks * rows, blocks * cols) if b_grid else (-1, -1)
            out.append((rows, cols, n, start, start, g * rows * cols, alpha, *sf))
            if n == 0:
                per = rows * cols * out_bytes
                zeroed += range(g * per, (g + 1) * per)
            blocks += -(-n // width)
        begin = end
    if form == 0:
        zeroed = list(range(begin * cols * out_bytes, rows * cols * out_bytes))
    return out, zeroed


CASES = {
    "rows": (0, [5, 0, 17, 6], 48, 32, 64),  # 20 rows past the sum
    "rows_clamped": (0, [30, -4, 30, 9], 48, 16, 32),  # a negative size, the sum past M
    "contracting": (1, [9, 0, 17, 6], 24, 32, 64),  # K=24 rows, N=32, padded M
    "contracting_all_empty": (1, [0, 0, 0], 8, 16, 48),
}


@pytest.mark.parametrize("case", list(CASES))
def test_preparation_runs_on_the_host_as_the_oracle_says(case):
    form, sizes, rows, cols, depth = CASES[case]
    sizes = np.asarray(sizes, np.int32)
    groups = sizes.size
    rng = np.random.default_rng(0)
    a_scale = rng.uniform(0.5, 2.0, groups).astype(np.float32)
    b_scale = rng.uniform(0.5, 2.0, groups).astype(np.float32)
    width = tc.SM90_PAD if form == 1 else 0
    if form == 1:  # the padded operands' columns, as the Python side pads them
        depth = segment_grid_size(depth, groups, width) * width
    for out_bytes in (2, 4):
        per_group, zeroed = _host_cuda().grouped_tc_prepare(
            sizes, a_scale, b_scale, form, rows, cols, depth, width, out_bytes
        )
        want, want_zeroed = _oracle(sizes, a_scale, b_scale, form, rows, cols, depth, width,
                                    out_bytes)  # fmt: skip
        got = [(*g[:7], *g[8:]) for g in per_group]
        assert got == want, (case, out_bytes)
        assert all(g[7] for g in per_group)  # each alpha pointer points at its own alpha
        assert list(zeroed) == want_zeroed


@pytest.mark.parametrize("case", list(CASES))
def test_preparation_points_each_group_at_its_block_scales(case):
    """Block scales: alpha 1, and each group's scales in the transposed grids: the rows form's
    a from its first row (the grid [K / 128, M]), b its own [K / 128, N / 128] matrix; the
    contracting form's both from its first segment block (grids [nb, K] and [nb, N])."""
    form, sizes, rows, cols, depth = CASES[case]
    sizes = np.asarray(sizes, np.int32)
    width = tc.SM90_BLOCK if form == 1 else 0
    if form == 1:
        depth = segment_grid_size(depth, sizes.size, width) * width
        b_grid = (cols, segment_grid_size(depth, sizes.size, width))
        a_scale = np.ones(rows * b_grid[1], np.float32)
        b_scale = np.ones(cols * b_grid[1], np.float32)
    else:
        b_grid = (-(-cols // 128), -(-depth // 128))
        a_scale = np.ones(rows * b_grid[1], np.float32)
        b_scale = np.ones(sizes.size * b_grid[0] * b_grid[1], np.float32)
    per_group, zeroed = _host_cuda().grouped_tc_prepare(
        sizes, a_scale, b_scale, form, rows, cols, depth, width, 2, *b_grid
    )
    want, want_zeroed = _oracle(sizes, a_scale, b_scale, form, rows, cols, depth, width, 2, b_grid)
    assert [(*g[:7], *g[8:]) for g in per_group] == want
    assert list(zeroed) == want_zeroed


def test_padding_puts_each_groups_columns_at_a_multiple_of_16():
    x = jnp.asarray(rand((3, 40), 0).astype(jnp.float8_e4m3fn))
    sizes = jnp.asarray([9, 0, 17, 6], jnp.int32)
    padded = np.asarray(segment_padded(x, sizes, 16).astype(jnp.float32))
    xs = np.asarray(x.astype(jnp.float32))
    assert padded.shape == (3, segment_grid_size(40, 4, 16) * 16)
    starts, begin, blocks = [], 0, 0
    for n in np.asarray(sizes):
        np.testing.assert_array_equal(
            padded[:, blocks * 16 : blocks * 16 + n], xs[:, begin : begin + n]
        )
        starts.append(blocks * 16)
        begin, blocks = begin + n, blocks + -(-n // 16)
    kept = sum(int(n) for n in np.asarray(sizes))
    assert np.count_nonzero(padded) == np.count_nonzero(xs[:, :kept])


def test_python_dispatches_to_the_compiled_instantiations():
    """cpp/sm90/grouped_gemm.cu's FP8JAX_SM90_VARIANTS and grouped_gemm_blockwise.cu's are
    SM90_VARIANTS, and each one's CUTLASS workspace (on a 1024-multiprocessor device, 256
    groups) fits the 1 MiB Python gives it."""
    try:
        cuda = importlib.import_module("fp8jax._fp8jax_cuda")
    except ImportError:
        pytest.skip("the CUDA extension is not built")
    variants = cuda.sm90_grouped_variants()
    if not variants:
        pytest.skip("the CUDA extension was built without CUTLASS (FP8JAX_CUTLASS_ROOT unset)")
    names = {"e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2"}
    compiled = {(names[a], names[b], out, fast, n) for a, b, out, fast, n, *_ in variants}
    assert compiled == set(tc.SM90_VARIANTS)
    for *_, workspace, sa, sb, sd in variants:
        assert workspace <= 1 << 20 and max(sa, sb, sd) <= 32
    assert TARGET in cuda.registrations() and TARGET in cuda.traits()


def _config(ragged="rows", a_block=None, out=jnp.bfloat16, b_block=None):
    return (ragged, a_block, b_block or a_block, jnp.dtype(out))


_ROWS_BLOCKS = _config(a_block=(1, 128), b_block=(128, 128))
_E4M3 = ("float8_e4m3fn", "float8_e4m3fn")


@pytest.mark.parametrize(
    ("option", "config", "a", "b", "accumulate", "want", "dtypes", "scale"),
    [
        (True, _config(), (64, 128), (4, 256, 128), "fast", True, None, "f32"),
        (False, _config(), (64, 128), (4, 256, 128), "fast", False, None, "f32"),  # opt-in
        (True, _config(), (64, 128), (4, 250, 128), "fast", False, None, "f32"),  # N % 16
        (True, _config(), (64, 120), (4, 256, 120), "fast", False, None, "f32"),  # K % 16
        (True, _config(out=jnp.float16), (64, 128), (4, 256, 128), "fast", False, None, "f32"),
        (True, _config("contracting", out=jnp.float32), (128, 60), (256, 60), "split", True, None,
         "f32"),
        # block scales: Float8BlockScaling's, E4M3, float32 scales
        (True, _ROWS_BLOCKS, (64, 128), (4, 256, 128), "fast", True, _E4M3, "f32"),
        (True, _ROWS_BLOCKS, (64, 128), (4, 256, 128), "split", True, _E4M3, "f32"),
        (True, _ROWS_BLOCKS, (64, 128), (4, 256, 128), "fast", False, _E4M3, "e8m0"),  # MXFP8
        (True, _config(a_block=(1, 128)), (64, 128), (4, 256, 128), "fast", False, _E4M3, "f32"),
        (True, _config(a_block=(1, 32)), (64, 128), (4, 256, 128), "fast", False, _E4M3, "f32"),
        (True, _config("contracting", (1, 128), jnp.float32), (128, 60), (256, 60), "split", True,
         _E4M3, "f32"),
        (True, _config("contracting", (1, 128), jnp.bfloat16), (128, 60), (256, 60), "split",
         False, _E4M3, "f32"),  # no instantiation
    ],
)  # fmt: skip
def test_the_tensor_core_path_is_chosen_where_it_runs(
    option, config, a, b, accumulate, want, dtypes, scale
):
    contracting = config[0] == "contracting"
    if dtypes is None:
        dtypes = ("float8_e4m3fn", "float8_e5m2" if contracting else "float8_e4m3fn")
    a = jax.ShapeDtypeStruct(a, jnp.dtype(dtypes[0]))
    b = jax.ShapeDtypeStruct(b, jnp.dtype(dtypes[1]))
    sa = jax.ShapeDtypeStruct((4,), jnp.float32 if scale == "f32" else jnp.float8_e8m0fnu)
    if _ffi.jax_has_cuda() and want:
        pytest.skip("on a GPU the path also needs an sm_90 device and a CUTLASS build")
    with fp8jax.ops.gemm_options(grouped_tensor_cores=option):
        assert tc.tensor_cores(config, a, b, sa, accumulate) is want


def test_grouped_tensor_cores_is_a_checked_bool():
    with pytest.raises(TypeError, match="grouped_tensor_cores must be a bool"):
        fp8jax.ops.gemm_options(grouped_tensor_cores=1)
    assert fp8jax.ops.get_gemm_options().grouped_tensor_cores is False


RECIPES = {
    "delayed": fp8jax.DelayedScaling(amax_history_len=4),
    "current": fp8jax.Float8CurrentScaling(),
    "blocks": fp8jax.Float8BlockScaling(),
}


def _moe_step_text(tensor_cores: bool, recipe) -> str:
    """The CUDA lowering of an MoE train step (bfloat16 activations, float32 weights: the layers'
    common case)."""
    e, h, i = 4, 128, 128
    params = {
        "gate_kernel": rand((h, e), 1),
        "wi_0": rand((e, h, i), 2, 0.05),
        "wi_1": rand((e, h, i), 3, 0.05),
        "wo": rand((e, i, h), 4, 0.05),
    }
    x = rand((64, h), 5).astype(jnp.bfloat16)
    delayed = isinstance(recipe, fp8jax.DelayedScaling)
    meta = fp8jax.init_fp8_meta(recipe, 6 * e) if delayed else None
    cfg = MoEConfig(num_experts=e, num_experts_per_tok=2)

    def step(params, probe, x):
        def loss(params, probe, x):
            out = fp8jax.moe(x, params, cfg, fp8_meta=meta, recipe=recipe, probe=probe).out
            return jnp.sum(out.astype(jnp.float32) ** 2)

        return jax.grad(loss, argnums=(0, 1, 2))(params, probe, x)

    with fp8jax.ops.gemm_options(grouped_tensor_cores=tensor_cores):
        traced = jax.jit(step).trace(params, jnp.zeros((6 * e,), jnp.float32), x)
        return traced.lower(lowering_platforms=("cuda",)).as_text()


def _calls(text: str, target: str) -> int:
    """How many times running ``main`` of a StableHLO module calls the custom call ``target``:
    a function jitted inside the step is printed once however often it is called, so each
    ``call`` counts its callee's calls."""
    bodies: dict[str, list[str]] = {}
    name = None
    for line in text.splitlines():
        if m := re.search(r"func\.func (?:public |private )?@([\w.$-]+)", line):
            name = m.group(1)
            bodies[name] = []
        elif name is not None:
            bodies[name].append(line)

    @functools.cache
    def count(fn: str) -> int:
        total = 0
        for line in bodies.get(fn, ()):
            total += len(re.findall(rf"custom_call @{target}\b", line))
            total += sum(count(c) for c in re.findall(r"\bcall @([\w.$-]+)\(", line))
        return total

    return count("main")


@pytest.mark.skipif(_ffi.jax_has_cuda(), reason="lowers for a Hopper build without a GPU")
@pytest.mark.parametrize("recipe", list(RECIPES))
def test_moe_train_step_lowers_every_expert_gemm_to_the_tensor_cores(recipe):
    """Forward, dgrad and wgrad of both expert GEMMs (wi, whose gated halves' wgrads are two
    GEMMs, and wo): seven tensor-core calls, no CUDA-core grouped GEMM left; without the option,
    the reverse. Per-group scales: the four wgrad operands come from transpose_padded, which
    writes the padded layout in the transpose's one pass."""
    on, off = _moe_step_text(True, RECIPES[recipe]), _moe_step_text(False, RECIPES[recipe])
    assert _calls(on, TARGET) == 7 and _calls(on, "fp8jax_grouped_gemm") == 0
    assert _calls(off, TARGET) == 0 and _calls(off, "fp8jax_grouped_gemm") == 7
    padded = 0 if recipe == "blocks" else 4
    assert _calls(on, "fp8jax_transpose_padded") == padded
    assert _calls(off, "fp8jax_transpose_padded") == 0


# ------------------------------------------------------------------ the padded wgrad operands


def _contracting_operands(sizes, k=24, n=32, m=40):
    """Row-major codes ``[M, K]``, ``[M, N]`` (as a layer holds them) and per-group scales."""
    a = jnp.asarray(rand((m, k), 10)).astype(jnp.float8_e4m3fn)
    b = jnp.asarray(rand((m, n), 11)).astype(jnp.float8_e5m2)
    g = len(sizes)
    sa = jnp.linspace(0.5, 2.0, g, dtype=jnp.float32)
    sb = jnp.linspace(1.5, 0.25, g, dtype=jnp.float32)
    return a, b, jnp.asarray(sizes, jnp.int32), sa, sb


@pytest.mark.parametrize("sizes", [[9, 0, 17, 6], [0, 0, 0, 0], [40, 0, 0, 0], [30, -4, 30, 9]])
@pytest.mark.parametrize("width", [16, 32])
@pytest.mark.parametrize("tensor_cores", [False, True])
@pytest.mark.parametrize("implementation", ["kernel", "xla"])
def test_padded_operands_give_the_unpadded_gemm(sizes, width, tensor_cores, implementation):
    """``padded=``: the operands in transpose_padded's layout give the GEMM of the plain
    transposes, bit for bit, on every path this machine runs (with the option on, the padded
    layout is gathered back here; on an sm_90 GPU the tensor cores read it as it is)."""
    a, b, gs, sa, sb = _contracting_operands(sizes)
    kw = dict(ragged="contracting", out_dtype=jnp.float32, accumulate="split",
              implementation=implementation)  # fmt: skip
    # traced sizes (a negative one, a sum past the rows: clamped alike on both sides)
    want = jax.jit(lambda a, b, gs: fp8jax.ops.grouped_gemm(a.T, b.T, gs, sa, sb, **kw))(a, b, gs)

    def padded(a, b, gs):
        pa = fp8jax.ops.transpose_padded(a, gs, width)
        pb = fp8jax.ops.transpose_padded(b, gs, width)
        return fp8jax.ops.grouped_gemm(pa, pb, gs, sa, sb, padded=width, **kw)

    with fp8jax.ops.gemm_options(grouped_tensor_cores=tensor_cores):
        got = jax.jit(padded)(a, b, gs)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(padded=16), "padded applies to ragged='contracting' only"),
        (dict(padded=8, ragged="contracting", b=(16, 16)), "padded must be a multiple of 16"),
        (dict(padded=-1), "padded must be an int >= 0"),
        (dict(padded=True), "padded must be an int >= 0"),
    ],
)
def test_padded_is_checked(kwargs, match):
    a = jnp.ones((8, 16), jnp.float8_e4m3fn)
    b = jnp.ones(kwargs.pop("b", (2, 16, 16)), jnp.float8_e4m3fn)
    one = jnp.ones((2,), jnp.float32)
    with pytest.raises(ValueError, match=match):
        fp8jax.ops.grouped_gemm(a, b, jnp.asarray([4, 4], jnp.int32), one, one, **kwargs)


@pytest.mark.parametrize("sizes", [[9, 0, 170, 6], [0, 0, 0, 0], [200, 0, 0, 0]])
@pytest.mark.parametrize("tensor_cores", [False, True])
@pytest.mark.parametrize("implementation", ["kernel", "xla"])
def test_padded_block_scaled_operands_give_the_unpadded_gemm(sizes, tensor_cores, implementation):
    """Float8BlockScaling's wgrad operands left in the padded layout the segment-block cast runs
    in (``segment_block_quantize(padded=True)``) give the GEMM of the ones gathered back, with
    the grids ``[K, P / 128]`` of the same blocks, bit for bit on every path this machine runs."""
    m = 200
    xa, xb = rand((24, m), 12), rand((32, m), 13)
    gs = jnp.asarray(sizes, jnp.int32)
    cast = lambda v, padded: fp8jax.ops.segment_block_quantize(
        v, gs, jnp.float8_e4m3fn, (1, 128), padded=padded
    )
    kw = dict(ragged="contracting", out_dtype=jnp.float32, accumulate="split",
              a_block=(1, 128), b_block=(1, 128), implementation=implementation)  # fmt: skip
    (a, sa), (b, sb) = cast(xa, False), cast(xb, False)
    want = fp8jax.ops.grouped_gemm(a, b, gs, sa, sb, **kw)
    (pa, psa), (pb, psb) = cast(xa, True), cast(xb, True)
    p = pa.shape[1]
    assert p % 128 == 0 and pb.shape[1] == p and psa.shape == (24, p // 128)
    with fp8jax.ops.gemm_options(grouped_tensor_cores=tensor_cores):
        got = fp8jax.ops.grouped_gemm(pa, pb, gs, psa, psb, padded=128, **kw)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_padded_block_grids_are_checked():
    a = jnp.ones((8, 256), jnp.float8_e4m3fn)
    gs = jnp.asarray([100, 20], jnp.int32)
    s = jnp.ones((8, 2), jnp.float32)
    kw = dict(ragged="contracting", a_block=(1, 128), b_block=(1, 128))
    with pytest.raises(
        ValueError, match=r"with padded=128, b_scale_inv must be the padded layout's grid \[8, 2\]"
    ):
        fp8jax.ops.grouped_gemm(a, a, gs, s, jnp.ones((8, 3), jnp.float32), padded=128, **kw)
    with pytest.raises(
        ValueError, match="padded block-scaled operands are padded to the blocks' width 128"
    ):
        fp8jax.ops.grouped_gemm(a, a, gs, s, s, padded=16, **kw)


# ------------------------------------------------------------------ on an sm_90 GPU


def _sm90_gpu() -> bool:
    return _ffi.jax_has_cuda() and tc.sm90_runs_here()


def _gpu_case(name):
    """(a, b, group_sizes, a_scale_inv, b_scale_inv, kwargs) of one recipe's GEMM."""
    r = np.random.default_rng(7)
    sizes = jnp.asarray([70, 0, 300, 5, 137], jnp.int32)  # 512 rows / columns, one group empty
    g, m, k, n = 5, 512, 256, 384
    e4, e5 = jnp.float8_e4m3fn, jnp.float8_e5m2
    per_group = lambda: jnp.asarray(r.uniform(0.25, 2.0, g), jnp.float32)
    normal = lambda *shape: jnp.asarray(r.standard_normal(shape), jnp.float32)
    if name.startswith("blocks"):
        blocks = dict(accumulate="split", a_block=(1, 128))
        if name == "blocks_rows":
            a, sa = fp8jax.ops.block_quantize(normal(m, k), e4, (1, 128))
            w = [fp8jax.ops.block_quantize(normal(n, k), e4, (128, 128)) for _ in range(g)]
            b, sb = jnp.stack([q for q, _ in w]), jnp.stack([s for _, s in w])
            return a, b, sizes, sa, sb, dict(blocks, b_block=(128, 128), out_dtype=jnp.bfloat16)
        seg = lambda v: fp8jax.ops.segment_block_quantize(v, sizes, e4, (1, 128))
        (a, sa), (b, sb) = seg(normal(k, m)), seg(normal(n, m))
        return a, b, sizes, sa, sb, dict(blocks, ragged="contracting", b_block=(1, 128),
                                         out_dtype=jnp.float32)  # fmt: skip
    dt_a, dt_b, out, acc, ragged = {
        "forward": (e4, e4, jnp.bfloat16, "fast", "rows"),
        "dgrad_hybrid": (e5, e4, jnp.float32, "split", "rows"),
        "wgrad_hybrid": (e4, e5, jnp.float32, "split", "contracting"),
        "wgrad_e4m3": (e4, e4, jnp.float32, "split", "contracting"),
    }[name]
    if ragged == "rows":
        a, b = normal(m, k).astype(dt_a), normal(g, n, k).astype(dt_b)
    else:
        a, b = normal(k, m).astype(dt_a), normal(n, m).astype(dt_b)
    kw = dict(ragged=ragged, out_dtype=out, accumulate=acc)
    return a, b, sizes, per_group(), per_group(), kw


GPU_CASES = ["forward", "dgrad_hybrid", "wgrad_hybrid", "wgrad_e4m3", "blocks_rows",
             "blocks_contracting"]  # fmt: skip


@pytest.mark.skipif(not _sm90_gpu(), reason="needs an sm_90 GPU and a CUTLASS build")
@pytest.mark.parametrize("case", GPU_CASES)
def test_tensor_cores_agree_with_the_cuda_core_kernel(case):
    """Every recipe's GEMMs on the tensor cores against fp8jax's CUDA-core kernel (whose bits are
    its host run's, tests/ops/test_host_cuda.py), within the dense FP8 GEMM's GPU tolerance: the
    tensor cores sum in their own order (docs/design.md)."""
    a, b, gs, sa, sb, kw = _gpu_case(case)
    want = jax.jit(lambda *v: fp8jax.ops.grouped_gemm(*v, **kw))(a, b, gs, sa, sb)
    with fp8jax.ops.gemm_options(grouped_tensor_cores=True):
        fn = jax.jit(lambda *v: fp8jax.ops.grouped_gemm(*v, **kw))
        assert TARGET in fn.lower(a, b, gs, sa, sb).as_text()
        got = fn(a, b, gs, sa, sb)
    assert_matches(np.asarray(got), np.asarray(want), False, **GEMM_GPU_CLOSE)
