"""The FP8 GEMM's sharding rule (``fp8jax/ops/gemms/_gemm_partition.py``) on 8 emulated devices.

The rule wraps the single-device 2-D GEMM (``gemm._gemm_2d``: the XLA dot on CPU, cuBLASLt on
CUDA); these tests call it directly, so they hold whether or not ``gemm`` routes through it yet.
Per layout: the result equals the single-device GEMM within one rounding of the output (the
sums run in another order when K is split, and may when the block shape changes), its sharding
is the expected one, and the compiled HLO has only the collectives a BF16 dot needs (an
all-reduce over the K axes; FSDP: one gather of the weight).
"""

from __future__ import annotations

import importlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _hlo import all_reduce_group_sizes, count
from _shared import make_mesh, normal
from conftest import needs_devices
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

gemm_mod = importlib.import_module("fp8jax.ops.gemms.gemm")
gemm_partition = importlib.import_module("fp8jax.ops.gemms._gemm_partition")

N_DEVICES = 8
pytestmark = needs_devices(N_DEVICES)

M, K, N = 32, 64, 48

# name: (a spec [M, K], b spec [N, K], out spec, all-reduce group sizes, all-gathers)
LAYOUTS = {
    "dp": (P("data"), P(), P("data"), [], 0),
    "tp_column": (P(), P("model"), P(None, "model"), [], 0),
    "tp_row": (P(None, "model"), P(None, "model"), P(), [4], 0),
    "dp_tp_column": (P("data"), P("model"), P("data", "model"), [], 0),
    "dp_tp_row": (P("data", "model"), P(None, "model"), P("data"), [4], 0),
    "k_split_a_only": (P(None, ("data", "model")), P(), P(), [8], 0),
    "fsdp_weight_k": (P("data"), P(None, "data"), P("data"), [], 1),
    "replicated": (P(), P(), P(), [], 0),
}


def _operands(seed=0):
    rng = np.random.default_rng(seed)
    return normal(rng, (M, K), jnp.float8_e4m3fn, 8.0), normal(rng, (N, K), jnp.float8_e5m2, 8.0)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize(
    ("out_dtype", "has_bias"),
    [(jnp.bfloat16, True), (jnp.float32, False), (jnp.float32, True)],
    ids=["bf16-bias", "f32", "f32-bias"],
)
def test_partitioned_gemm(layout, out_dtype, has_bias):
    a_spec, b_spec, out_spec, reduce_groups, gathers = LAYOUTS[layout]
    mesh = make_mesh()
    a, b = _operands()
    sa, sb = jnp.full((1,), 0.37, jnp.float32), jnp.float32(0.011)
    bias = jnp.linspace(-3, 3, N).astype(out_dtype) if has_bias else None
    op = gemm_partition.partitioned_gemm(
        gemm_mod._gemm_2d, jnp.dtype(out_dtype), "split", has_bias, 1, 0
    )
    one = jax.devices()[0]
    want = gemm_mod.gemm(
        *(jax.device_put(v, one) for v in (a, b, sa, sb)),
        out_dtype=out_dtype,
        bias=None if bias is None else jax.device_put(bias, one),
        accumulate="split",
    )

    args = (
        jax.device_put(a, NamedSharding(mesh, a_spec)),
        jax.device_put(b, NamedSharding(mesh, b_spec)),
    )
    f = jax.jit(lambda a, b: op(a, b, sa, sb, bias))
    got = f(*args)

    assert got.dtype == want.dtype and got.shape == (M, N)
    assert got.sharding.is_equivalent_to(NamedSharding(mesh, out_spec), 2), got.sharding
    # Within one rounding of the output: with K split the float32 partials are added in another
    # order; without, the same sums run as a dot of another block shape, which XLA:CPU (jax
    # >= 0.12) and cuBLASLt may order differently too.
    g, w = np.asarray(got, np.float32), np.asarray(want, np.float32)
    ulp = float(jnp.finfo(out_dtype).eps)
    np.testing.assert_allclose(g, w, rtol=ulp, atol=ulp * float(np.abs(w).max()))
    hlo = f.lower(*args).compile().as_text()
    assert all_reduce_group_sizes(hlo) == reduce_groups, hlo
    assert count(hlo, "all-gather") == gathers, hlo
    for other in ("all-to-all", "collective-permute", "reduce-scatter"):
        assert count(hlo, other) == 0, hlo


def test_single_device_is_the_bare_gemm():
    a, b = _operands(1)
    op = gemm_partition.partitioned_gemm(
        gemm_mod._gemm_2d, jnp.dtype(jnp.bfloat16), "fast", False, 0, 0
    )
    f = jax.jit(lambda a, b: op(a, b, jnp.float32(1.0), jnp.float32(2.0)))
    assert "CustomSPMDPartitioning" not in f.lower(a, b).as_text()
    want = gemm_mod.gemm(a, b, jnp.float32(1.0), jnp.float32(2.0))
    np.testing.assert_array_equal(np.asarray(f(a, b), np.float32), np.asarray(want, np.float32))


def test_sharding_rule_strings():
    assert gemm_partition.gemm_sharding_rule(0, 0, False) == "m k, n k, ,  -> m n"
    assert gemm_partition.gemm_sharding_rule(1, 0, True) == "m k, n k, sa, , n -> m n"


# name: (x spec [M, K], w_q spec [K, N], g spec [M, N], y and dx specs (the layouts the rule
#        gives them), all-gathers with reuse, without, all-reduce groups: the K-split psums of
#        both GEMMs, the same with and without reuse).
# The forward GEMM is y = x . w_t^T with w_t = w_q^T; the dgrad GEMM is dx = g . w_q^T, with
# reuse = (w_t, x_t).
DGRAD_LAYOUTS = {
    "fsdp_weight_n": (P("data"), P(None, "data"), P("data"), P("data"), P("data"), 1, 2, []),
    "fsdp_weight_k": (P("data"), P("data", None), P("data"), P("data"), P("data"), 1, 2, []),
    "fsdp_x_tp_row": (
        P("data", "model"), P("model", "data"), P("data"), P("data"), P("data", "model"), 1, 2, [4]
    ),
    "fsdp_x_tp_column": (
        P("data"), P("data", "model"), P("data", "model"), P("data", "model"), P("data"), 1, 2, [4]
    ),
    "tp_column": (P(), P(None, "model"), P(None, "model"), P(None, "model"), P(), 0, 0, [4]),
    "tp_row": (P(None, "model"), P("model"), P(), P(), P(None, "model"), 0, 0, [4]),
    "dp": (P("data"), P(), P("data"), P("data"), P("data"), 0, 0, []),
}  # fmt: skip


@pytest.mark.parametrize("layout", list(DGRAD_LAYOUTS))
def test_dgrad_reuses_the_forward_gather(layout):
    """Under FSDP the dgrad GEMM takes the forward GEMM's gathered ``w_t`` (one all-gather in
    all) where a plain ``gemm`` on ``w_q`` gathers the other layout again; elsewhere ``reuse``
    changes nothing. Results equal one device's (bit for bit when no K is split)."""
    x_spec, w_spec, g_spec, y_spec, dx_spec, gathers, gathers_plain, groups = DGRAD_LAYOUTS[layout]
    mesh = make_mesh()
    rng = np.random.default_rng(3)
    x = normal(rng, (M, K), jnp.float8_e4m3fn, 8.0)
    w_q = normal(rng, (K, N), jnp.float8_e4m3fn, 8.0)
    g = normal(rng, (M, N), jnp.float8_e5m2, 8.0)
    s = jnp.float32(0.5)

    def step(x, w_q, g, reuse):
        w_t, x_t = w_q.T, x.T
        y = gemm_mod.gemm(x, w_t, s, s, out_dtype=jnp.float32)
        if reuse:
            dx = gemm_mod.gemm_reusing(g, w_q, s, s, reuse=(w_t, x_t), out_dtype=jnp.float32)
        else:
            dx = gemm_mod.gemm(g, w_q, s, s, out_dtype=jnp.float32, accumulate="split")
        return y, dx

    want = step(x, w_q, g, False)
    put = lambda v, spec: jax.device_put(v, NamedSharding(mesh, spec))
    args = (put(x, x_spec), put(w_q, w_spec), put(g, g_spec))
    hlos = {}
    for reuse in (True, False):
        out = (NamedSharding(mesh, y_spec), NamedSharding(mesh, dx_spec))
        f = jax.jit(lambda x, w, g, reuse=reuse: step(x, w, g, reuse), out_shardings=out)
        got = f(*args)
        for gv, wv in zip(got, want, strict=True):
            np.testing.assert_allclose(np.asarray(gv), np.asarray(wv), rtol=1e-6)
        hlos[reuse] = f.lower(*args).compile().as_text()
    assert count(hlos[True], "all-gather") == gathers, hlos[True]
    assert count(hlos[False], "all-gather") == gathers_plain, hlos[False]
    # row parallel: the forward's psum; column parallel: the dgrad's; FSDP adds none
    assert all_reduce_group_sizes(hlos[True]) == groups, hlos[True]
    assert all_reduce_group_sizes(hlos[False]) == groups, hlos[False]
    for other in ("all-to-all", "collective-permute", "reduce-scatter"):
        assert count(hlos[True], other) == 0, hlos[True]


def test_sharding_rule_with_reuse():
    rule = gemm_partition.gemm_sharding_rule(0, 0, False, True)
    assert rule == "m k, n k, , , r0 r1, r2 r3 -> m n"


@pytest.mark.parametrize(
    ("a_spec", "b_spec", "out_spec"),
    [
        (P("data"), P("model"), P("data", "model")),  # DP x column-parallel TP
        (P("data", "model"), P(None, "model"), P("data", None)),  # row parallel: K split, psum
        (P("data"), P("data"), P("data", None)),  # FSDP: the weight is gathered
    ],
    ids=["dp_tp_column", "tp_row", "fsdp"],
)
def test_explicit_sharding_mode(a_spec, b_spec, out_spec):
    """On a mesh with explicit axes (``jax.make_mesh``'s default) the GEMM's result type
    carries the sharding its rule gives: M as ``a``'s rows, N as ``b``'s rows not used by M."""
    mesh = make_mesh(explicit=True)
    a, b = _operands(7)
    sa, sb = jnp.float32(0.5), jnp.float32(0.25)
    want = gemm_mod.gemm(a, b, sa, sb, out_dtype=jnp.float32)
    with jax.set_mesh(mesh):
        args = (jax.device_put(a, a_spec), jax.device_put(b, b_spec))
        f = jax.jit(lambda a, b: gemm_mod.gemm(a, b, sa, sb, out_dtype=jnp.float32))
        got = f(*args)
        assert jax.typeof(got).sharding.spec == out_spec
    assert got.sharding.spec == out_spec
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-7, atol=1e-6)
