"""Every CUDA kernel body, executed on the host.

``fp8jax._fp8jax_host_cuda`` is cpp/cuda/'s handlers and kernels, unchanged, compiled by the host
compiler on the CUDA-semantics runtime of cpp/testing/host_cuda.h (threads as fibers, shared
memory per block, barriers, warp collectives, atomics; the CUDA runtime calls stubbed), with
every load and store of shared memory checked: a read of a byte the block has not written, a
race between two threads with no barrier in between (either fails the launch), and the
wavefronts of each warp-wide access in 32 banks. Its
handlers are registered for the CPU under ``fp8jax_host_cuda_*`` targets, and each conformance
sample runs the public op with its FFI call sent there: the CUDA handler plans the launch (for a
2-SM or a 132-SM device), every block runs on the host, and the results must equal the
reference (``"xla"``) as the CPU kernel does, bit for bit or within the sample's tolerance, with
the threads of each block run in lane order and in reverse lane order (a shared-memory race gives
different results in the two).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _dbias import strip_order_sum
from _host_cuda import EXT, NEEDS_EXT, on_host_cuda, on_the_cpu, to_cpu  # noqa: F401
from _samples import ACT_CLOSE, KERNEL_PENDING, NORM_CLOSE, Sample, cases, dyadic, sample, scale_of
from _shared import normal
from _values import assert_matches

from fp8jax import ops

# the GEMM is cuBLASLt's, not a kernel of ours; a KERNEL_PENDING op has no kernel yet
CASES = [c for c in cases() if c[0] != "gemm" and c[0] not in KERNEL_PENDING]
pytestmark = [NEEDS_EXT, pytest.mark.usefixtures("on_the_cpu")]


def _id(case) -> str:
    return "-".join(case)


def _paths_the_samples_miss() -> dict[str, Sample]:
    """Kernel paths the conformance samples (small, unaligned) do not take: the cast-transpose's
    fast 128 x 128 tiles (with and without dbias), norm rows read element by element (rows not
    16-byte aligned) or 16 bytes at a time in float16, rows spread over several warps
    (h = 2048), gamma and beta in another dtype than x, the row-wise cast's grid stride, long
    and short rows and special values."""
    r = np.random.default_rng(3)
    e4m3 = jnp.float8_e4m3fn
    out = {}
    for dt in (jnp.bfloat16, jnp.float32):
        name = jnp.dtype(dt).name
        out[f"cast_transpose-fast-{name}"] = Sample(
            ops.cast_transpose, (normal(r, (256, 384), dt, 3.0), scale_of(2.0), e4m3)
        )
        out[f"cast_transpose_dbias-fast-{name}"] = Sample(
            ops.cast_transpose_dbias, (dyadic(r, (256, 384), dt), scale_of(2.0), e4m3)
        )
    for h, dt, param_dt in (
        (36, jnp.float16, jnp.bfloat16),
        (64, jnp.float16, jnp.float32),
        (2048, jnp.float32, jnp.float16),
    ):
        for norm_type in ("layernorm", "rmsnorm"):
            x = normal(r, (8, h), dt, 3.0, 0.5)
            gamma = normal(r, (h,), param_dt, 0.2, 1.0)
            beta = normal(r, (h,), param_dt, 0.2) if norm_type == "layernorm" else None
            kw = dict(norm_type=norm_type, epsilon=1e-5)
            tag = f"{norm_type}-h{h}-{jnp.dtype(dt).name}"
            out[f"norm_forward-{tag}"] = Sample(
                ops.norm_forward, (x, gamma, beta), kw, close=NORM_CLOSE
            )
            out[f"norm_forward_fp8-{tag}"] = Sample(
                ops.norm_forward_fp8, (x, gamma, beta, scale_of(32.0), e4m3), kw, close=NORM_CLOSE
            )
            _, mu, rsigma = ops.norm_forward_reference(x, gamma, beta, **kw)
            out[f"norm_backward-{tag}"] = Sample(
                ops.norm_backward,
                (normal(r, (8, h), dt), x, mu, rsigma, gamma),
                dict(norm_type=norm_type),
                close=NORM_CLOSE,
            )
    # Rows of 13: the activation kernels' chunks element by element, the last one partial.
    for acts in (("gelu", "linear"), ("silu",)):
        x = normal(r, (8, len(acts), 13), jnp.bfloat16, 3.0)
        tag = "-".join(acts)
        out[f"activation-{tag}-n13"] = Sample(ops.activation, (x, acts), close=ACT_CLOSE)
        g = normal(r, (8, 13), jnp.bfloat16)
        out[f"dactivation-{tag}-n13"] = Sample(ops.dactivation, (g, x, acts), close=ACT_CLOSE)
    # Row-wise casts: 300 rows (more than the 128 warps of a 2-SM grid: each warp strides to
    # more rows), rows of 1000 (31 and a bit elements a lane) and of 5 (27 lanes idle), special
    # values (NaN of both signs, inf, zero and subnormal rows).
    special = np.array(normal(r, (16, 40), jnp.float32, 5.0))
    special[0, ::3], special[1, 1::2], special[2, 0] = np.nan, -np.nan, np.inf
    special[3], special[4], special[5] = 0.0, 1e-40, np.nan
    for tag, x, kw in (
        ("300x40-bf16", normal(r, (300, 40), jnp.bfloat16, 3.0), {}),
        ("8x1000-f32-f32scale", normal(r, (8, 1000), jnp.float32, 3.0),
         {"power_2_scale": False, "amax_epsilon": 0.5}),
        ("2x8x5-f16", normal(r, (2, 8, 5), jnp.float16, 3.0), {}),
        ("special-f32", jnp.asarray(special), {"power_2_scale": False}),
    ):  # fmt: skip
        for dt in (e4m3, jnp.float8_e5m2):
            name = f"rowwise_quantize-{tag}-{jnp.dtype(dt).name}"
            out[name] = Sample(ops.rowwise_quantize, (x, dt), kw)
    # 600 rows: 256 slots of up to 3 rows, whose partials pass 2 adds in 16 lanes.
    x = normal(r, (600, 64), jnp.bfloat16, 3.0, 0.5)
    gamma = normal(r, (64,), jnp.bfloat16, 0.2, 1.0)
    _, mu, rsigma = ops.norm_forward_reference(x, gamma, gamma, norm_type="layernorm", epsilon=1e-5)
    out["norm_backward-layernorm-600-rows"] = Sample(
        ops.norm_backward,
        (normal(r, (600, 64), jnp.bfloat16), x, mu, rsigma, gamma),
        dict(norm_type="layernorm"),
        close=NORM_CLOSE,
    )
    return out


EXTRA = _paths_the_samples_miss()


def _compare(s: Sample, reverse: bool, monkeypatch) -> None:
    """Equal to the reference; in lane order, also without a shared-memory bank conflict."""
    args = to_cpu(s.operands().values())
    want = jax.jit(lambda *a: s.call(*a, implementation="xla"))(*args)
    EXT.reset_stats()
    with on_host_cuda(monkeypatch, reverse=reverse, banks=not reverse):
        got = jax.block_until_ready(s.call(*args, implementation="kernel"))
    stats = EXT.stats()
    assert stats["launches"] > 0  # the CUDA handler ran
    assert stats["shared_wavefronts"] == stats["shared_ideal"], stats
    tol = dict(s.close or {})
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        try:
            assert_matches(g, w, not tol, **tol)
        except AssertionError as e:
            raise AssertionError(f"output {i}: {e}") from None


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_cuda_kernels_on_the_host_equal_the_reference(case, monkeypatch):
    """Lane order only: the shared-memory race checker finds what the reverse order would show
    (the extra samples below still run in both orders, as a check of the checker)."""
    _compare(sample(*case), False, monkeypatch)


@pytest.mark.parametrize("reverse", [False, True], ids=["lanes", "reverse"])
@pytest.mark.parametrize("name", list(EXTRA))
def test_paths_the_samples_miss_equal_the_reference(name, reverse, monkeypatch):
    _compare(EXTRA[name], reverse, monkeypatch)


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_vmapped_calls_run_the_grouped_kernels(case, monkeypatch):
    """vmap makes one call with a leading group dimension (one scale per group): the kernels'
    grouped paths. Two groups, the second the first negated and halved."""
    s = sample(*case)
    args = to_cpu(s.operands().values())
    stacked = tuple(
        jnp.stack([a, (-a * 0.5).astype(a.dtype)]) if jnp.issubdtype(a.dtype, jnp.floating) else
        jnp.stack([a, a]) for a in args
    )  # fmt: skip
    want = jax.vmap(lambda *a: s.call(*a, implementation="xla"))(*stacked)
    with on_host_cuda(monkeypatch):
        run = jax.vmap(lambda *a: s.call(*a, implementation="kernel"))
        got = jax.block_until_ready(run(*stacked))
    tol = dict(s.close or {})
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        try:
            assert_matches(g, w, not tol, **tol)
        except AssertionError as e:
            raise AssertionError(f"output {i}: {e}") from None


@pytest.mark.parametrize(
    ("shape", "dtype"), [((2200, 24), jnp.float32), ((2176, 128), jnp.bfloat16)], ids=str
)
def test_dbias_over_more_row_tiles_than_lanes_has_the_documented_bits(shape, dtype, monkeypatch):
    """18 and 17 row tiles (guarded and fast tiles): pass 2 adds them in 16 interleaved lanes;
    the CUDA kernels give the bits of the documented order, as the CPU kernel does."""
    g = normal(5, shape, dtype, 30.0)
    want = strip_order_sum(np.asarray(g, np.float32))
    cpu = ops.cast_transpose_dbias(g, jnp.float32(0.5), jnp.float8_e4m3fn, implementation="kernel")
    np.testing.assert_array_equal(np.asarray(cpu[4]), want)
    with on_host_cuda(monkeypatch):
        out = ops.cast_transpose_dbias(
            g, jnp.float32(0.5), jnp.float8_e4m3fn, implementation="kernel"
        )
        np.testing.assert_array_equal(np.asarray(out[4]), want)
    for a, b in zip(out[:4], cpu[:4], strict=True):
        assert np.asarray(a).tobytes() == np.asarray(b).tobytes()


def test_nan_column_sums_have_the_cpu_kernels_bits(monkeypatch):
    """dbias, dgamma and dbeta of columns holding a negative NaN: 0x7FC00000 from the CUDA
    kernels as from the CPU kernels (a GPU's add returns 0x7FFFFFFF, the CPU's kept the sign)."""
    g = np.ones((300, 24), np.float32)
    g[7, 3] = np.uint32(0xFFC00001).view(np.float32)
    g[200, 5] = np.inf
    g[201, 5] = -np.inf
    x = jnp.asarray(np.linspace(-2, 2, 300 * 24, dtype=np.float32).reshape(300, 24))
    gamma = jnp.ones((24,), jnp.float32)
    _, mu, rsigma = ops.norm_forward_reference(x, gamma, gamma, norm_type="layernorm", epsilon=1e-5)

    def run():
        dbias = ops.cast_transpose_dbias(g, jnp.float32(1), jnp.float8_e4m3fn)[4]
        _, dgamma, dbeta = ops.norm_backward(
            jnp.asarray(g), x, mu, rsigma, gamma, norm_type="layernorm"
        )
        return [np.asarray(v).view(np.uint32) for v in (dbias, dgamma, dbeta)]

    with ops.implementation("kernel"):
        cpu = run()
        with on_host_cuda(monkeypatch):
            cuda = run()
    for a, b in zip(cpu, cuda, strict=True):
        assert a[3] == b[3] == 0x7FC00000 and a[5] == b[5] == 0x7FC00000
    assert cpu[0].tobytes() == cuda[0].tobytes()


@pytest.mark.parametrize(("norm_type", "mx"), [("layernorm", False), ("rmsnorm", True)])
def test_the_norm_block_cast_computes_the_norm_kernels_y(norm_type, mx, monkeypatch):
    """The fused norm's CUDA kernel never reads y: its block cast computes y from the norm
    kernel's statistics (block_sources.h's NormSource). Its codes, grids and statistics are
    those of the CUDA norm forward then the CUDA block cast, bit for bit (x bfloat16, gamma
    float32, beta float16; a row length no vector access takes)."""
    r = np.random.default_rng(7)
    x = normal(r, (200, 136), jnp.bfloat16, 3.0, 1.0)
    gamma = normal(r, 136, jnp.float32, 0.2, 1.0)
    beta = normal(r, 136, jnp.float16) if norm_type == "layernorm" else None
    kw = dict(norm_type=norm_type, epsilon=1e-5, zero_centered_gamma=mx)
    fused = ops.norm_mxfp8_cast_transpose if mx else ops.norm_block_cast_transpose
    cast = ops.mxfp8_cast_transpose if mx else ops.block_cast_transpose
    with ops.implementation("kernel"), on_host_cuda(monkeypatch):
        got = fused(x, gamma, beta, jnp.float8_e4m3fn, **kw)
        y, mu, rsigma = ops.norm_forward(x, gamma, beta, **kw)
        want = (*cast(y, jnp.float8_e4m3fn), mu, rsigma)
    for g, w in zip(got, want, strict=True):
        assert_matches(g, w, True)


UNWRITTEN = "reads a shared byte that no thread of the block has written"
READ_RACE = "reads a shared byte that another thread wrote since the last __syncthreads"
WRITE_RACE = "writes a shared byte that another thread read since the last __syncthreads"
TWO_WRITERS = "writes a global byte that another thread of the launch wrote"


@pytest.mark.parametrize(
    ("kind", "param", "lanes", "reverse"),
    [
        ("neighbour", 1, "", ""),
        ("neighbour", 0, "thread 0 " + UNWRITTEN, "thread 63 " + UNWRITTEN),
        ("unwritten", 0, "thread 0 " + UNWRITTEN, "thread 0 " + UNWRITTEN),
        ("write_after_read", 0, "thread 1 " + WRITE_RACE, "thread 0 " + READ_RACE),
        ("global", 0, "", ""),
        ("global", 1, "thread 1 " + TWO_WRITERS + " (global address", "thread 62 " + TWO_WRITERS),
        ("global", 2, "thread 0 makes a misaligned access to global memory", "thread 0 makes"),
    ],
)
def test_memory_checks_fail_the_launch(kind, param, lanes, reverse):
    """The runtime's own checks, on kernels made to break them (cpp/testing/host_cuda_selftest.cc),
    in both thread orders. Without its barrier, each thread reads its neighbour's word: thread 0
    before thread 1 wrote it (lane order), thread 63 before thread 0 did (reverse order). In
    global memory: a thread may store a byte twice and all may take an atomicMax of one word, but
    two threads storing one byte, or a misaligned access, fail the launch."""
    for order, want in ((False, lanes), (True, reverse)):
        EXT.set_options(reverse=order)
        try:
            got = EXT._self_test(kind, 64, param)
        finally:
            EXT.set_options()
        assert (want in got) if want else got == "", got


@pytest.mark.parametrize(
    ("kind", "param", "wavefronts", "ideal"),
    [
        ("stride", 1, 1, 1),
        ("stride", 2, 2, 1),
        ("stride", 4, 4, 1),
        ("stride", 32, 32, 1),
        ("stride", 33, 1, 1),
        ("wide", 8, 2, 2),
        ("wide", 16, 4, 4),
    ],
)
def test_bank_model_counts_wavefronts(kind, param, wavefronts, ideal):
    """One warp's store: a stride of 2^k words is a 2^k-way conflict, an odd stride none; 8-
    and 16-byte stores take 2 and 4 phases."""
    EXT.set_options(banks=True)
    EXT.reset_stats()
    try:
        assert EXT._self_test(kind, 32, param) == ""
    finally:
        EXT.set_options()
    stats = EXT.stats()
    assert (stats["shared_requests"], stats["shared_wavefronts"]) == (1, wavefronts)
    assert stats["shared_ideal"] == ideal


@pytest.mark.parametrize("shape", [(256, 384), (250, 380)], ids=["fast", "guarded"])
@pytest.mark.parametrize("op", ["cast_transpose", "cast_transpose_dbias"])
def test_cast_transpose_tiles_are_bank_conflict_free(op, shape, monkeypatch):
    """The bank model's wavefronts for the cast-transpose tiles (issue 20 items 4 and 8): the
    fewest possible on the fast tile (plan::FastWord's swizzle, plan::ColpartIndex's pad) and on
    the guarded sub-tile (plan::GuardedTileIndex's and GuardedValsIndex's swizzles; they were
    3.56 and 2.15 times the fewest: a 4-way conflict in the byte gather, 2-way in dbias's
    staging)."""
    g = normal(1, shape, jnp.bfloat16)
    EXT.reset_stats()
    with on_host_cuda(monkeypatch, banks=True):
        jax.block_until_ready(getattr(ops, op)(g, jnp.float32(2), jnp.float8_e4m3fn))
    stats = EXT.stats()
    assert stats["shared_requests"] > 0
    assert stats["shared_wavefronts"] == stats["shared_ideal"], stats


GPU_SAMPLES = {"-".join(c): c for c in CASES} | {name: name for name in EXTRA}


@pytest.mark.skipif(jax.default_backend() != "gpu", reason="needs a GPU (tools/gpu_check.sh)")
@pytest.mark.parametrize("name", list(GPU_SAMPLES))
def test_gpu_kernels_equal_their_host_run(name, monkeypatch):
    """On a GPU machine: the kernels nvcc compiled, run on the GPU, against the same source run
    here on the host, sample by sample (bit for bit, or within the sample's tolerance where the
    device's tanh/erf or summation order may differ)."""
    key = GPU_SAMPLES[name]
    s = EXTRA[key] if isinstance(key, str) else sample(*key)
    gpu = jax.devices("gpu")[0]
    on_gpu = jax.block_until_ready(
        s.call(*(jax.device_put(a, gpu) for a in s.operands().values()), implementation="kernel")
    )
    with on_host_cuda(monkeypatch):
        host = jax.block_until_ready(
            s.call(*to_cpu(s.operands().values()), implementation="kernel")
        )
    tol = dict(s.close or {})
    for i, (g, h) in enumerate(zip(on_gpu, host, strict=True)):
        try:
            assert_matches(np.asarray(g), np.asarray(h), not tol, **tol)
        except AssertionError as e:
            raise AssertionError(f"output {i}: {e}") from None


# The norm plans' cases (tests/ops/test_norm_plan.py): one row, h from 1 to 8,192, rows not
# multiples of the row groups, h not a multiple of 8 (element by element) or of 16 bytes.
NORM_CASES = [(1, 768), (3, 1000), (37, 4097), (5, 8), (2, 1), (300, 64), (7, 8192), (1000, 128)]


@pytest.mark.parametrize(("rows", "h"), NORM_CASES, ids=str)
def test_norm_kernels_over_the_plan_cases(rows, h, monkeypatch):
    """The norm kernels, forward (with the FP8 form and its transpose) and backward, over the
    plans' cases, on a 1-SM device (every block walks many rows) and a 66-SM one: equal to the
    reference within the norms' tolerance (this replaced the hand walks of the kernels' loops)."""
    i = NORM_CASES.index((rows, h))  # bf16 and float32, 1 and 66 SMs, in turn
    dtype = (jnp.bfloat16, jnp.float32)[i % 2]
    sms = (1, 66)[(i // 2) % 2]
    r = np.random.default_rng(rows * 7 + h)
    x = normal(r, (rows, h), dtype, 2.0, 0.3)
    gamma = normal(r, (h,), dtype, 0.2, 1.0)
    beta = normal(r, (h,), dtype, 0.2)
    dy = normal(r, (rows, h), dtype)
    kw = dict(norm_type="layernorm", epsilon=1e-5)

    def run(impl):
        y, mu, rs = ops.norm_forward(x, gamma, beta, **kw, implementation=impl)
        fp8 = ops.norm_forward_fp8(
            x, gamma, beta, jnp.float32(8.0), jnp.float8_e4m3fn, **kw, implementation=impl
        )
        back = ops.norm_backward(dy, x, mu, rs, gamma, norm_type="layernorm", implementation=impl)
        return (y, mu, rs, *back), fp8

    want, want_fp8 = run("xla")
    with on_host_cuda(monkeypatch, sms=sms, blocks_per_sm=1, device=10 + sms):
        got, got_fp8 = jax.block_until_ready(run("kernel"))
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        try:
            assert_matches(np.asarray(g), np.asarray(w), False, **NORM_CLOSE)
        except AssertionError as e:
            raise AssertionError(f"output {i}: {e}") from None
    # The FP8 form is quantize of the same implementation's y, bit for bit (amax too), and q_t
    # its transpose.
    del want_fp8
    q, qt = np.asarray(got_fp8[0]).view(np.uint8), np.asarray(got_fp8[1]).view(np.uint8)
    wq, _, wamax = ops.quantize(got[0], jnp.float32(8.0), jnp.float8_e4m3fn)
    np.testing.assert_array_equal(q, np.asarray(wq).view(np.uint8))
    assert np.asarray(got_fp8[3]).tobytes() == np.asarray(wamax).tobytes()
    np.testing.assert_array_equal(qt.reshape(h, rows), q.reshape(rows, h).T)


def test_a_132_sm_device_plans_other_grids_and_gives_the_same_bits(monkeypatch):
    """The handlers size their grids from the occupancy (ResidentBlocks, cached per device: two
    devices of the process here): a large device runs more blocks, each with less work, and the
    results do not change."""
    x = jax.random.normal(jax.random.key(0), (64, 1024), jnp.bfloat16)  # 8 tiles of 8,192
    scale = jnp.float32(3.0)
    runs = {}
    for device, sms in ((7, 1), (8, 132)):
        EXT.reset_stats()
        with on_host_cuda(monkeypatch, sms=sms, blocks_per_sm=1, device=device):
            out = ops.quantize(x, scale, jnp.float8_e4m3fn, implementation="kernel")
            runs[sms] = [np.asarray(o) for o in out]
        runs[sms, "blocks"] = EXT.stats()["blocks"]
    assert runs[132, "blocks"] > runs[1, "blocks"]
    for a, b in zip(runs[1], runs[132], strict=True):
        assert a.tobytes() == b.tobytes()
