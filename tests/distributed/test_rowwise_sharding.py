"""Float8RowwiseScaling on 8 emulated devices (automatic axes; the reference path, issue 49):
``layernorm_mlp`` (forward and every gradient) under data, tensor (column- then row-parallel),
fully-sharded and sequence layouts equals the one-device result within float32 summation order.
The row-wise casts and GEMMs are ``jnp`` definitions that XLA partitions: a row amax over a
split dim is a max all-reduce (exact), a split contraction a sum. Under explicit axes
(``jax.make_mesh``), ``dense`` with FSDP; the layers and the MoE block on both kinds of mesh
are in the mesh matrix (tests/distributed/_matrix.py, ``ROWWISE_CASES``). ``rowwise_gemm``'s
cuBLASLt plan (opt-in, emulated handler): row splits kept, a split K summed by one all-reduce,
never a gathered operand; typed as its rule under explicit axes. The row-wise cast's kernel
(``fp8jax_rowwise_quantize``) on its own: rows split freely with no collective, a split K
gathered first, the one-device bits either way (automatic and explicit axes)."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _shared import make_mesh, rand
from conftest import needs_devices
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import fp8jax
from fp8jax.ops.block import rowwise as rw

pytestmark = needs_devices(8)

ROWS, HIDDEN, MLP = 256, 128, 256
RECIPES = {
    "rowwise": fp8jax.Float8RowwiseScaling(),
    "hp-wgrad": fp8jax.Float8RowwiseScaling(wgrad_high_precision=True),
}
# name: (x, w1 (hidden, 1, mlp), w2 (mlp, hidden)) specs on a ("data", "model") = (2, 4) mesh
LAYOUTS = {
    "data": (P("data", None), P(), P()),
    "tensor": (P("data", None), P(None, None, "model"), P("model", None)),  # K of GEMM 2 split
    "fsdp": (P("data", None), P("data", None, None), P("data", None)),
    "sequence": (P(("data", "model"), None), P(), P()),  # rows (tokens) over every device
}


def _loss(recipe):
    def loss(x, gamma, w1, w2):
        y = fp8jax.layernorm_mlp(x, gamma, None, w1, w2, layernorm_type="rmsnorm", recipe=recipe)
        return jnp.sum(y * jnp.sin(y))

    return jax.value_and_grad(loss, (0, 1, 2, 3))


def _args():
    return (rand((ROWS, HIDDEN), 1), 1 + 0.1 * rand((HIDDEN,), 2), rand((HIDDEN, 1, MLP), 3) * 0.06,
            rand((MLP, HIDDEN), 4) * 0.04)  # fmt: skip


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", list(RECIPES))
def test_sharded_equals_one_device(name, layout):
    recipe = RECIPES[name]
    one = jax.jit(_loss(recipe))(*_args())
    mesh = make_mesh()
    xs, w1s, w2s = LAYOUTS[layout]
    shard = [NamedSharding(mesh, s) for s in (xs, P(), w1s, w2s)]
    fn = jax.jit(_loss(recipe), in_shardings=shard)
    got = fn(*[jax.device_put(a, s) for a, s in zip(_args(), shard, strict=True)])
    for a, c in zip(jax.tree.leaves(got), jax.tree.leaves(one), strict=True):
        scale = float(jnp.max(jnp.abs(c))) or 1.0
        np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=0, atol=1e-5 * scale)


# ------------------------------------------------------------ rowwise_gemm's CUDA plan on a mesh


def _rows(spec):
    """The spec of an operand's [rows, 1] scales: split as its rows."""
    return P(spec[0] if len(spec) else None, None)


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
def test_rowwise_gemm_cuda_plan_keeps_row_and_k_splits(a_spec, b_spec, out_spec, monkeypatch):
    """The CUDA path's partitioning, run on 8 CPU devices with the emulated cuBLASLt handler of
    tests/ops/test_rowwise_gemm.py: M and N stay split (each device multiplies its own output
    tile with its rows' scales: no collective, the reference's bits); a split K stays split,
    each device's float32 partial product summed by one all-reduce (the reference within the
    float32 summation order, then one bfloat16 rounding). The codes are never gathered."""
    from test_rowwise_gemm import _emulated_rowwise_kernel, _operands, rg

    from fp8jax.ops.block.rowwise import rowwise_scaled_matmul

    mesh = make_mesh()
    aq, a_s, bq, b_s = _operands(m=512, n=256, k=384, seed=3)
    want = rowwise_scaled_matmul(aq, a_s, bq, b_s, jnp.bfloat16)
    monkeypatch.setattr(jax.ffi, "ffi_call", _emulated_rowwise_kernel)
    call = rg._partitioned_cuda(jnp.dtype(jnp.bfloat16))
    args = [jax.device_put(v, NamedSharding(mesh, spec)) for v, spec in
            ((aq, a_spec), (a_s, _rows(a_spec)), (bq, b_spec), (b_s, _rows(b_spec)))]  # fmt: skip
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


@pytest.mark.parametrize(
    ("a_spec", "b_spec", "out_spec"),
    [
        (P("data"), P("model"), P("data", "model")),
        (P("data", "model"), P(None, "model"), P("data", None)),  # K split
    ],
    ids=["dp-tp", "split-k"],
)
def test_rowwise_gemm_explicit_sharding_typed_as_the_rule(a_spec, b_spec, out_spec, monkeypatch):
    """Opted in, on a mesh with explicit axes: the result's type carries the sharding the GEMM's
    rule gives (both platform branches typed alike); run here (CPU) it is the reference within
    float32 summation order (XLA's partitioned dot may sum its K = 256 products in another
    order: at most 256 * 2**-24 of the sum of their magnitudes)."""
    from test_rowwise_gemm import _fake_gpu, _operands, rg

    from fp8jax.ops.block.rowwise import rowwise_scaled_matmul

    _fake_gpu(monkeypatch, "9.0")  # the kernel branch is built, whatever this machine has
    mesh = make_mesh(explicit=True)
    aq, a_s, bq, b_s = _operands(m=256, n=128, k=256, seed=4)
    want = rowwise_scaled_matmul(aq, a_s, bq, b_s)
    with jax.set_mesh(mesh), fp8jax.ops.gemm_options(rowwise_cublaslt=True):
        args = (jax.device_put(aq, a_spec), jax.device_put(a_s, _rows(a_spec)),
                jax.device_put(bq, b_spec), jax.device_put(b_s, _rows(b_spec)))  # fmt: skip
        got = jax.jit(rg.rowwise_gemm)(*args)
        assert jax.typeof(got).sharding.spec == out_spec
    a8, b8 = (np.abs(np.asarray(q, np.float32)) for q in (aq, bq))
    mag = (a8 @ b8.T) * np.asarray(a_s) * np.asarray(b_s).T
    assert np.all(np.abs(np.asarray(got) - np.asarray(want)) <= 256 * 2.0**-24 * mag)


@pytest.mark.parametrize("name", list(RECIPES))
def test_explicit_axes_fsdp_dense_equals_one_device(name):
    """``jax.make_mesh``'s explicit axes, the tokens and the kernel's K both over ``data``
    (FSDP): the dgrad's scales (rows of the output gradient and of the kernel, both split
    over ``data``) are resharded as the output's rows and columns, and the high-precision
    wgrad's dot contracts the split tokens with its ``out_sharding`` stated (without it JAX
    refuses the dot as ambiguous)."""
    recipe = RECIPES[name]
    x, w = rand((ROWS, HIDDEN), 5), rand((HIDDEN, MLP), 6) * 0.06

    def loss(x, w):
        y = fp8jax.dense(x, w, recipe=recipe)
        return jnp.sum(y * jnp.sin(y))

    grad = jax.jit(jax.value_and_grad(loss, (0, 1)))
    one = grad(x, w)
    mesh = make_mesh(explicit=True)
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P("data", None)))
        ws = jax.device_put(w, NamedSharding(mesh, P("data", "model")))
        got = grad(xs, ws)
    assert jax.typeof(got[1][1]).sharding.spec == P("data", "model")
    for a, c in zip(jax.tree.leaves(got), jax.tree.leaves(one), strict=True):
        scale = float(jnp.max(jnp.abs(c))) or 1.0
        np.testing.assert_allclose(np.asarray(a), np.asarray(c), rtol=0, atol=1e-5 * scale)


# x [64, 96] specs on a ("data", "model") = (2, 4) mesh: whether K (the rows' length) is split
CAST_SPLITS = {
    "rows-data": (P("data", None), False),
    "rows-all": (P(("data", "model"), None), False),
    "k-model": (P(None, "model"), True),
    "rows-and-k": (P("data", "model"), True),
}
_COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")


def _cast_bits(out):
    return [np.asarray(a).view(np.uint8) for a in out]


@pytest.mark.parametrize("split", list(CAST_SPLITS))
def test_rowwise_quantize_kernel_split(split):
    """Each device casts its own rows (their scales stay with them: scale_inv is split like the
    rows, no collective); a split K is gathered before the kernel (an all-gather, no
    all-reduce). Either way every output has the one-device bits."""
    spec, k_split = CAST_SPLITS[split]
    x = rand((64, 96), 5).astype(jnp.bfloat16) * jnp.exp2(jnp.arange(64.0)[:, None] % 9)
    f = jax.jit(lambda a: rw.rowwise_quantize(a, jnp.float8_e4m3fn, implementation="kernel"))
    want = f(jax.device_put(x, jax.devices()[0]))
    xs = jax.device_put(x, NamedSharding(make_mesh(), spec))
    got = f(xs)
    for g, w in zip(_cast_bits(got), _cast_bits(want), strict=True):
        np.testing.assert_array_equal(g, w)
    hlo = f.lower(xs).compile().as_text()
    assert 'custom_call_target="fp8jax_rowwise_quantize"' in hlo
    found = {c for c in _COLLECTIVES if c in hlo}
    assert found == ({"all-gather"} if k_split else set()), found
    if not k_split:  # the rows' split, kept by q and scale_inv
        for out in got:
            assert out.sharding.spec[0] == spec[0]


@pytest.mark.parametrize("spec", [P("data", None), P("data", "model")], ids=["rows", "rows-k"])
def test_rowwise_quantize_kernel_explicit_axes(spec):
    """Under explicit axes the outputs' types carry x's split: q like x, scale_inv [M, 1] like
    x's rows (a split K is gathered inside the op, q keeps x's type)."""
    mesh = make_mesh(explicit=True)
    x = rand((64, 40), 6)
    want = rw.rowwise_quantize(x, jnp.float8_e5m2)
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, spec))
        q, s = jax.jit(lambda a: rw.rowwise_quantize(a, jnp.float8_e5m2))(xs)
        assert jax.typeof(s).sharding.spec == P("data", None)
        assert jax.typeof(q).sharding.spec == spec
    for g, w in zip(_cast_bits((q, s)), _cast_bits(want), strict=True):
        np.testing.assert_array_equal(g, w)
