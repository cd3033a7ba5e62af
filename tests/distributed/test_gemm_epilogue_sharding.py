"""The MLP's GELU-epilogue GEMMs (``fp8jax/ops/gemms/gemm_epilogue.py``) on 8 emulated devices.

Per layout, against one device: M and N stay split as the operands are, a split K is gathered
(the GELU needs whole sums), the amax is made global with one all-reduce over the mesh and the
bias gradient with one over M's axes. Integer-valued FP8 operands make every GEMM sum exact, so
the FP8 outputs, the GELU input and the amax are the same bits as on one device; the bias
gradient sums rows in another order (float32, then one 16-bit rounding): within one rounding.
Then the layer: a bfloat16 ``LayerNormMLP`` with the fused path, data x tensor parallel and
FSDP, against one device.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _hlo import all_reduce_group_sizes, count
from _shared import make_mesh, normal
from conftest import needs_devices
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import fp8jax
from fp8jax.ops.gemms import gemm_epilogue as ge

pytestmark = needs_devices(8)

M, N, K = 32, 48, 64
E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2

# name: (a spec [M, K], b spec [N, K], out spec [M, N], all-gathers); M or N split: the amax is
# all-reduced over the whole mesh (8 devices)
LAYOUTS = {
    "dp": (P("data"), P(), P("data"), 0),
    "tp_column": (P(), P("model"), P(None, "model"), 0),
    "dp_tp": (P("data"), P("model"), P("data", "model"), 0),
    "k_split": (P(None, "model"), P(None, "model"), P(), 2),  # both gathered along K
}


def _first(spec):
    return spec[0] if len(spec) else None


def _ints(rng, shape, dtype):
    return jnp.asarray(rng.integers(-4, 5, shape).astype(np.float32), dtype)


def _one(x):
    return jax.device_put(x, jax.devices()[0])


def _same(got, want):
    for g, w in zip(got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_gemm_gelu_split(layout):
    a_spec, b_spec, out_spec, gathers = LAYOUTS[layout]
    mesh = make_mesh()
    rng = np.random.default_rng(0)
    a, b = _ints(rng, (M, K), E4M3), _ints(rng, (N, K), E4M3)
    bias = _ints(rng, (N,), jnp.bfloat16)
    s, scale = jnp.float32(0.25), jnp.float32(16.0)

    def f(a, b, bias):
        return ge.gemm_gelu(a, b, s, s, scale, fp8_dtype=E4M3, bias=bias)

    want = f(_one(a), _one(b), _one(bias))
    bias_spec = P(_first(b_spec))
    args = (jax.device_put(a, NamedSharding(mesh, a_spec)),
            jax.device_put(b, NamedSharding(mesh, b_spec)),
            jax.device_put(bias, NamedSharding(mesh, bias_spec)))  # fmt: skip
    fn = jax.jit(f)
    got = fn(*args)
    _same(got, want)
    assert got[0].sharding.is_equivalent_to(NamedSharding(mesh, out_spec), 2)
    hlo = fn.lower(*args).compile().as_text()
    assert count(hlo, "all-gather") == gathers
    splits = _first(a_spec) is not None or _first(b_spec) is not None
    assert all_reduce_group_sizes(hlo) == ([8] if splits else [])  # the amax, over the mesh


@pytest.mark.parametrize("layout", ["dp", "tp_column", "dp_tp"])
def test_gemm_dgelu_split(layout):
    a_spec, b_spec, out_spec, _ = LAYOUTS[layout]
    mesh = make_mesh()
    rng = np.random.default_rng(1)
    a, b = _ints(rng, (M, K), E5M2), _ints(rng, (N, K), E4M3)
    aux = normal(rng, (M, N), jnp.float16)
    s, scale = jnp.float32(0.5), jnp.float32(4.0)

    def f(a, b, aux):
        return ge.gemm_dgelu(a, b, s, s, aux, scale, fp8_dtype=E5M2, dbias_dtype=jnp.bfloat16)

    want = f(_one(a), _one(b), _one(aux))
    args = (jax.device_put(a, NamedSharding(mesh, a_spec)),
            jax.device_put(b, NamedSharding(mesh, b_spec)),
            jax.device_put(aux, NamedSharding(mesh, out_spec)))  # fmt: skip
    fn = jax.jit(f)
    got = fn(*args)
    _same(got[:3], want[:3])
    # each device's bias gradient comes out of the epilogue in bfloat16: the partials' roundings
    # (half a bf16 step of each) add up, then one more rounding of the total
    h = np.asarray(aux, np.float64)
    t = np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h**3))
    dgelu = 0.5 * (1 + t) + 0.5 * h * (1 - t * t) * np.sqrt(2 / np.pi) * (1 + 3 * 0.044715 * h * h)
    dh = (np.asarray(a, np.float64) @ np.asarray(b, np.float64).T * 0.25) * dgelu
    parts = np.abs(dh.reshape(2, M // 2, N).sum(axis=1)).sum(axis=0) if _first(a_spec) else 0
    total = np.asarray(want[3], np.float64)
    tol = 2.0**-8 * (parts + np.abs(total)) + 1e-6
    assert np.all(np.abs(np.asarray(got[3], np.float64) - total) <= tol)
    hlo = fn.lower(*args).compile().as_text()
    assert count(hlo, "all-gather") == 0
    sizes = all_reduce_group_sizes(hlo)
    assert 8 in sizes  # the amax
    if _first(a_spec) is not None:  # rows split: the bias gradient's partial sums, over "data"
        assert 2 in sizes


@fp8jax.ops.gemm_options(fused_epilogues=True)  # opt-in
def test_layernorm_mlp_fused_path_on_a_mesh():
    """The layer with the fused path (bf16, gelu, delayed scaling) jitted on a 2 x 4 mesh with
    its input split over the batch and GEMM1's kernel over its output columns (tensor
    parallelism): the loss and every gradient as on one device, to bfloat16 precision."""
    mesh = make_mesh()
    rng = np.random.default_rng(2)
    h, inter = 32, 64
    x = normal(rng, (8, 4, h), jnp.bfloat16)
    gamma, beta = jnp.ones((h,)), jnp.zeros((h,))
    w1 = normal(rng, (h, 1, inter), jnp.bfloat16, h**-0.5)
    w2 = normal(rng, (inter, h), jnp.bfloat16, inter**-0.5)
    b1 = normal(rng, (1, inter), jnp.bfloat16, 0.1)
    recipe = fp8jax.DelayedScaling(amax_history_len=4)
    meta = fp8jax.init_fp8_meta(recipe, n_roles=6)._replace(
        scale=jnp.array([16.0, 256.0, 2.0**14, 64.0, 256.0, 2.0**14])
    )

    def loss(x, w1, w2, b1, probe):
        y = fp8jax.layernorm_mlp(x, gamma, beta, w1, w2, b1, None, meta, recipe, probe=probe)
        return jnp.sum(y.astype(jnp.float32) ** 2)

    grad = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4)))
    probe = jnp.zeros((6,), jnp.float32)
    want = grad(*(_one(v) for v in (x, w1, w2, b1, probe)))
    specs = (P("data"), P(None, None, "model"), P("model"), P(None, "model"), P())
    args = [jax.device_put(v, NamedSharding(mesh, sp))
            for v, sp in zip((x, w1, w2, b1, probe), specs, strict=True)]  # fmt: skip
    lowered = grad.lower(*args).as_text()
    assert "fp8jax_activation_cast_transpose" not in lowered  # the fused path, not the kernels
    got = grad(*args)
    np.testing.assert_allclose(float(got[0]), float(want[0]), rtol=1e-2)
    for g, w in zip(jax.tree.leaves(got[1]), jax.tree.leaves(want[1]), strict=True):
        g, w = np.asarray(g, np.float64), np.asarray(w, np.float64)
        assert np.linalg.norm(g - w) <= 0.02 * np.linalg.norm(w) + 1e-6
