"""The block-scaled recipes on 8 emulated devices: ``layernorm_mlp`` (forward and every
gradient) under data, tensor (column- then row-parallel) and fully-sharded layouts equals the
one-device result within float32 summation order (every layout splits some contracted dim: the
rows, for the weight gradients), and the compiled step reduces no amax across devices (no
all-reduce takes a maximum): block scales are local. (The count of all-reduces is XLA's own
partitioning of the dequantized GEMMs: under FSDP it adds one sum that the FP8-off step does
without.)"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _hlo import count
from _shared import make_mesh, rand
from conftest import needs_devices
from jax.errors import JaxRuntimeError
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import fp8jax

pytestmark = needs_devices(8)

ROWS, HIDDEN, MLP = 1024, 256, 512  # 128 rows a device when the rows are split 8 ways
RECIPES = {"block": fp8jax.Float8BlockScaling(), "mxfp8": fp8jax.MXFP8BlockScaling()}
# name: (x, w1 (hidden, 1, mlp), w2 (mlp, hidden)) specs on a ("data", "model") = (2, 4) mesh
LAYOUTS = {
    "data": (P("data", None), P(), P()),
    "tensor": (P("data", None), P(None, None, "model"), P("model", None)),  # K of GEMM 2 split
    "fsdp": (P("data", None), P("data", None, None), P("data", None)),
    "sequence": (P(("data", "model"), None), P(), P()),  # rows (tokens) over every device
}


def _loss(recipe):
    def loss(x, gamma, w1, w2):
        kw = dict(recipe=recipe, enabled=recipe is not None)
        y = fp8jax.layernorm_mlp(x, gamma, None, w1, w2, layernorm_type="rmsnorm", **kw)
        return jnp.sum(y * jnp.sin(y))

    return jax.value_and_grad(loss, (0, 1, 2, 3))


def _args(rows=ROWS):
    return (rand((rows, HIDDEN), 1), 1 + 0.1 * rand((HIDDEN,), 2), rand((HIDDEN, 1, MLP), 3) * 0.06,
            rand((MLP, HIDDEN), 4) * 0.04)  # fmt: skip


def _sharded(recipe, layout, rows=ROWS):
    mesh = make_mesh()
    xs, w1s, w2s = LAYOUTS[layout]
    shard = [NamedSharding(mesh, s) for s in (xs, P(), w1s, w2s)]
    fn = jax.jit(_loss(recipe), in_shardings=shard)
    args = [jax.device_put(a, s) for a, s in zip(_args(rows), shard, strict=True)]
    return fn, args


@pytest.mark.parametrize("name", list(RECIPES))
def test_too_few_rows_a_device_for_the_transposed_blocks_is_a_clear_error(name):
    """The weight gradient contracts the rows: x's transposed copy has blocks of 128 (32) rows,
    so each device must hold a multiple of them; 256 rows over 8 devices is 32 a device."""
    fn, args = _sharded(RECIPES[name], "sequence", rows=256 if name == "block" else 64)
    # raised by XLA's partitioner calling back into fp8jax: a JaxRuntimeError (automatic axes)
    with pytest.raises(JaxRuntimeError, match=r"block_cast_transpose: dim -2 of x .* straddle"):
        fn(*args)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", list(RECIPES))
def test_sharded_equals_one_device(name, layout):
    recipe = RECIPES[name]
    one = jax.jit(_loss(recipe))(*_args())
    fn, args = _sharded(recipe, layout)
    got = fn(*args)
    for a, c in zip(jax.tree.leaves(got), jax.tree.leaves(one), strict=True):
        scale = float(jnp.max(jnp.abs(c))) or 1.0
        np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=0, atol=1e-5 * scale)


def _max_all_reduces(hlo: str) -> list[str]:
    """The all-reduce instructions of ``hlo`` whose reduction takes a maximum (an amax)."""
    found = []
    for line in hlo.splitlines():
        if not re.search(r"\sall-reduce(?:-start)?\(", line):
            continue
        name = re.search(r"to_apply=%?([\w.\-]+)", line).group(1)
        body = re.search(rf"%?{re.escape(name)} \(.*?\n\}}", hlo, re.DOTALL)
        if body is None or "maximum" in body.group(0):
            found.append(line.strip()[:160])
    return found


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_no_amax_is_reduced_across_devices(layout):
    fn, args = _sharded(RECIPES["block"], layout)
    hlo = fn.lower(*args).compile().as_text()
    assert count(hlo, "all-reduce") > 0  # the gradients' sums are there
    assert _max_all_reduces(hlo) == []
    # the same check sees per-tensor scaling's amax reduction
    fn, args = _sharded(fp8jax.Float8CurrentScaling(), layout)
    assert _max_all_reduces(fn.lower(*args).compile().as_text())


# ---------------------------------------------------------------- the cast ops on a mesh

from fp8jax.ops.block import block_scaling as bs  # noqa: E402

_CASTS = {
    "block": lambda v: bs.block_cast_transpose(v, jnp.float8_e4m3fn),
    "block-2d": lambda v: bs.block_cast_transpose(v, jnp.float8_e4m3fn, bs.BLOCK_2D),
    "mxfp8": lambda v: bs.mxfp8_cast_transpose(v),
}


def _bits(a):
    a = np.asarray(a)
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a


@pytest.mark.parametrize("cast", list(_CASTS))
@pytest.mark.parametrize("spec", [P("data", None), P(None, "model"), P("data", "model")], ids=str)
def test_block_casts_split_where_each_device_holds_whole_blocks(cast, spec):
    """Rows and columns split into parts of whole blocks (1024 / 2 and 1024 / 4, each a multiple
    of 128), dims of 8 blocks (a multiple of the device count, so the Shardy rule carries the
    grids): each device casts its part, with no collective, and the result equals one device's
    bit for bit."""
    mesh = make_mesh()
    x = rand((1024, 1024), seed=7) * 3
    want = jax.jit(_CASTS[cast])(x)
    xs = jax.device_put(x, NamedSharding(mesh, spec))
    fn = jax.jit(_CASTS[cast])
    got = fn(xs)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(_bits(g), _bits(w))
    hlo = fn.lower(xs).compile().as_text()
    assert not re.search(r"all-reduce|all-gather|all-to-all|collective-permute", hlo)


@pytest.mark.parametrize("cast", list(_CASTS))
def test_a_ragged_dim_left_whole_beside_a_split_one(cast):
    """Columns 300 (ragged for every block) unsplit, rows split into whole blocks: no straddle
    error (an unsplit dim keeps its ragged last block on each device), the one-device bits."""
    mesh = make_mesh()
    x = rand((256, 300), seed=3) * 3
    want = jax.jit(_CASTS[cast])(x)
    got = jax.jit(_CASTS[cast])(jax.device_put(x, NamedSharding(mesh, P("data", None))))
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(_bits(g), _bits(w))


def test_the_whole_blocks_predicate():
    from fp8jax.ops.base import partition

    # an abstract 2 x 4 mesh: the predicate reads only the axis sizes, never a device
    mesh = jax.sharding.AbstractMesh((2, 4), ("data", "model"))
    assert partition.whole_blocks(mesh, (), 300, 128)  # unsplit: ragged is fine
    assert partition.whole_blocks(mesh, ("data",), 256, 128)
    assert not partition.whole_blocks(mesh, ("model",), 256, 128)  # parts of 64
    assert not partition.whole_blocks(mesh, ("data",), 257, 1)  # uneven parts
    assert partition.whole_blocks(mesh, ("data", "model"), 1024, 128)


@pytest.mark.parametrize(
    ("cast", "shape", "spec", "dim"),
    [
        ("block", (64, 256), P(("data", "model"), None), "dim -2 of x \\(size 64\\) is split 8"),
        ("block", (256, 256), P(None, ("data", "model")), "dim -1 of x \\(size 256\\) is split 8"),
        ("mxfp8", (256, 64), P(None, ("data", "model")), "dim -1 of x \\(size 64\\) is split 8"),
        ("block-2d", (128, 256), P("model", None), "dim -2 of x \\(size 128\\) is split 4"),
    ],
)
def test_a_block_straddling_two_devices_is_a_clear_error(cast, shape, spec, dim):
    mesh = make_mesh()
    xs = jax.device_put(rand(shape), NamedSharding(mesh, spec))
    with pytest.raises(JaxRuntimeError, match=f"block_cast_transpose: {dim} ways .* straddle"):
        jax.jit(_CASTS[cast])(xs)


@pytest.mark.parametrize("cast", ["block", "block-2d"])
def test_a_split_finer_than_the_blocks_is_a_clear_error(cast):
    """256 rows are two 128-row blocks; split 4 ways, a block would straddle two devices. (With
    the block count in the Shardy rule, Shardy cut the mesh axis into sub-axes that JAX's custom
    partitioning cannot express, and JAX failed first with an internal KeyError; a dim of fewer
    blocks than a multiple of the device count now keeps its grid out of the rule.)"""
    mesh = make_mesh()
    xs = jax.device_put(rand((256, 512)), NamedSharding(mesh, P("model", None)))
    match = r"dim -2 of x \(size 256\) is split 4 ways .* straddle"
    with pytest.raises(JaxRuntimeError, match=match):
        jax.jit(_CASTS[cast])(xs)


@pytest.mark.parametrize("spec", [P("data", None), P(None, "model")], ids=str)
@pytest.mark.parametrize("cast", list(_CASTS))
def test_dims_of_fewer_blocks_than_devices_split_whole(cast, spec):
    """256 rows over "data" (one 128-row block a device), 512 columns over "model" (one block
    each): dims of fewer blocks than devices, whose grids the plan splits. The one-device bits;
    the codes stay split, and at most a float32 scale grid is gathered (to the sharding
    propagation chose for it)."""
    mesh = make_mesh()
    x = rand((256, 512), seed=5) * 3
    xs = jax.device_put(x, NamedSharding(mesh, spec))
    fn = jax.jit(_CASTS[cast])
    for got, want in zip(fn(xs), jax.jit(_CASTS[cast])(x), strict=True):
        np.testing.assert_array_equal(_bits(got), _bits(want))
    hlo = fn.lower(xs).compile().as_text()
    assert not re.search(r"all-reduce|all-to-all|collective-permute", hlo)
    gathered = re.findall(r"= (\w+)\[[\d,]*\]\S* all-gather\(", hlo)
    assert set(gathered) <= {"f32", "f8e8m0fnu"}, gathered


# ---------------------------------------------------------------- block_gemm's CUDA plan on a mesh


@pytest.mark.parametrize("combo", ["1x128-128x128", "mxfp8"])
@pytest.mark.parametrize(
    ("a_spec", "b_spec", "out_spec"),
    [
        (P("data", None), P("model", None), P("data", "model")),  # DP x TP: both rows split
        (P(("data", "model"), None), P(), P(("data", "model"), None)),  # sequence: M over 8
        (P(None, "model"), P(None, "model"), P()),  # K split: partial products, one psum
        (P("model", "data"), P(None, "data"), P("model", None)),  # M and K split
    ],
    ids=["dp-tp", "sequence", "split-k", "split-m-k"],
)
def test_block_gemm_cuda_plan_keeps_whole_block_splits(combo, a_spec, b_spec, out_spec,
                                                       monkeypatch):  # fmt: skip
    """The CUDA path's partitioning, run on 8 CPU devices with the emulated cuBLASLt handler of
    tests/ops/test_block_gemm.py: M and N stay split where each device holds whole blocks (each
    device multiplies its own output tile: no collective, the reference's bits); a split K stays
    split, each device's float32 partial product summed by one all-reduce (the reference within
    the float32 summation order, then one bfloat16 rounding)."""
    from test_block_gemm import _emulated_block_kernel, _operands

    from fp8jax.ops.gemms import blockwise as bg

    mesh = make_mesh()
    aq, a_s, a_block, bq, b_s, b_block = _operands(combo, m=2048, n=1024, k=512, seed=3)
    want = bs.block_scaled_matmul(aq, a_s, a_block, bq, b_s, b_block, jnp.bfloat16)
    monkeypatch.setattr(jax.ffi, "ffi_call", lambda t, r: _emulated_block_kernel(t, r, traced=True))
    call = bg._partitioned_cuda(a_block, b_block, jnp.dtype(jnp.bfloat16))
    args = [jax.device_put(v, NamedSharding(mesh, spec))
            for v, spec in ((aq, a_spec), (a_s, a_spec), (bq, b_spec), (b_s, b_spec))]  # fmt: skip
    fn = jax.jit(call)
    got = fn(*args)
    assert got.sharding.is_equivalent_to(NamedSharding(mesh, out_spec), 2)
    hlo = fn.lower(*args).compile().as_text()
    assert not re.search(r"all-gather|all-to-all|collective-permute", hlo)
    if a_spec[1] is None:  # K whole: the reference's bits, no collective at all
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
        assert "all-reduce" not in hlo
    else:
        assert "all-reduce" in hlo
        np.testing.assert_allclose(np.asarray(got, np.float32), np.asarray(want, np.float32),
                                   rtol=2**-7, atol=1e-3)  # fmt: skip
