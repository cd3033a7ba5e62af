"""LayerNormMLP with the GELU epilogues (fp8jax/ops/gemms/gemm_epilogue.py) and the GEMM options
(fp8jax/ops/gemms/gemm_options.py): when the fused path is taken, what the CUDA lowering of a train
step calls, its numerics against the separate kernels, and the small-GEMM policy of every layer.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _shared import rand

import fp8jax
from fp8jax import DelayedScaling, Float8CurrentScaling, ops
from fp8jax.functional import _core
from fp8jax.functional.mlp import fused_path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
import structure  # benchmarks/structure.py: the lowered program's counts

pytestmark = pytest.mark.usefixtures("float32_matmuls")

RECIPE = DelayedScaling(amax_history_len=4)
BF16 = jnp.bfloat16
H, INTER = 32, 64


def _args(dtype=BF16, acts=("gelu",), seed=0):
    k = len(acts)
    x = (rand((4, 8, H), seed, 2.0) + 0.5).astype(dtype)
    gamma, beta = 1.0 + rand((H,), seed + 1, 0.1), rand((H,), seed + 2, 0.1)
    w1 = rand((H, k, INTER), seed + 3, H**-0.5).astype(dtype)
    w2 = rand((INTER, H), seed + 4, INTER**-0.5).astype(dtype)
    b1, b2 = rand((k, INTER), seed + 5, 0.1).astype(dtype), rand((H,), seed + 6, 0.1)
    return x, gamma, beta, w1, w2, b1, b2


def _setup(recipe=RECIPE):
    """The layer's FP8 setup under ``recipe`` and the enclosing options."""
    meta = fp8jax.init_fp8_meta(recipe, n_roles=6) if isinstance(recipe, DelayedScaling) else None
    setup, _, _ = _core.resolve("test", recipe, None, meta, None, 6, ("norm", "activation"))
    return setup


def test_when_the_fused_path_is_taken():
    s = _setup()
    assert not fused_path(s, ("gelu",), BF16, False)  # opt-in
    with ops.gemm_options(fused_epilogues=True):
        _fused_where_it_applies(s)


def _fused_where_it_applies(s):
    assert fused_path(s, ("gelu",), BF16, False)
    assert fused_path(s, ("gelu",), jnp.float16, False)
    assert not fused_path(s, ("gelu",), jnp.float32, False)  # cuBLASLt: a 16-bit epilogue dtype
    assert not fused_path(s, ("gelu_exact",), BF16, False)  # cuBLASLt's GELU is the tanh one
    assert not fused_path(s, ("relu",), BF16, False)
    assert not fused_path(s, ("gelu", "linear"), BF16, False)
    assert not fused_path(s, ("gelu",), BF16, True)  # dropout between activation and cast
    assert not fused_path(_setup(Float8CurrentScaling()), ("gelu",), BF16, False)
    assert not fused_path(_setup(fp8jax.Float8BlockScaling()), ("gelu",), BF16, False)
    with ops.gemm_options(fused_epilogues=False):
        assert not fused_path(s, ("gelu",), BF16, False)
    for family in ("gemm", "activation"):
        with ops.implementation(**{family: "xla"}):
            assert not fused_path(_setup(), ("gelu",), BF16, False)


def _step(x, gamma, beta, w1, w2, b1, b2, meta, probe):
    def loss(x, w1, w2, b1, b2, probe):
        y = fp8jax.layernorm_mlp(x, gamma, beta, w1, w2, b1, b2, meta, RECIPE, probe=probe)
        return jnp.sum(y.astype(jnp.float32) * jnp.cos(jnp.arange(y.size).reshape(y.shape)))

    return jax.grad(loss, argnums=(0, 1, 2, 3, 4, 5))(x, w1, w2, b1, b2, probe)


def _cuda_targets(**options):
    """The fp8jax custom calls of the train step lowered for CUDA, per call site
    (benchmarks/structure.py's counter)."""
    args = _args()
    meta, probe = fp8jax.init_fp8_meta(RECIPE, n_roles=6), jnp.zeros((6,), jnp.float32)
    with ops.gemm_options(**options):
        text = jax.jit(_step).trace(*args, meta, probe).lower(lowering_platforms=("cuda",))
    return structure.lowered_counts(text.as_text())


def test_the_cuda_lowering_of_a_train_step_has_the_fused_epilogues():
    """The step lowered for CUDA (no GPU needed): GEMM1 is cuBLASLt's GELU epilogue, GEMM2's dgrad
    its DGELU epilogue, and neither activation kernel runs (the activation's transposed copies
    are transposes of FP8 codes); with the option off, the reverse."""
    fused, plain = _cuda_targets(fused_epilogues=True), _cuda_targets()
    assert fused["fp8jax_gemm_gelu"] == 1 and fused["fp8jax_gemm_dgelu"] == 1
    assert plain["fp8jax_gemm_gelu"] == plain["fp8jax_gemm_dgelu"] == 0
    # the two fused GEMMs replace two plain ones; everything else is the same program
    assert fused["fp8jax_gemm"] == plain["fp8jax_gemm"] - 2
    assert not [t for t in fused if "activation" in t]
    assert plain["fp8jax_activation_cast_transpose"] == 1
    assert plain["fp8jax_dactivation_cast_transpose_dbias"] == 1
    assert fused["fp8_xla_transposes"] == 2 and plain["fp8_xla_transposes"] == 0
    for target in ("fp8jax_layernorm_forward_fp8", "fp8jax_cast_transpose_dbias",
                   "fp8jax_norm_backward", "fp8jax_cast_transpose"):  # fmt: skip
        assert fused[target] == plain[target] > 0


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def test_fused_numerics_match_the_separate_kernels():
    """On CPU the fused path computes its definition; against the separate kernels it differs by
    the bfloat16 roundings it skips and the float16 GELU input, far inside FP8's resolution:
    the output within 2%, every gradient within 5%, the observations within 1%."""
    args = _args()
    meta = fp8jax.init_fp8_meta(RECIPE, n_roles=6)._replace(
        scale=jnp.array([16.0, 256.0, 2.0**15, 64.0, 256.0, 2.0**15])
    )
    probe = jnp.zeros((6,), jnp.float32)

    def run():
        y = fp8jax.layernorm_mlp(*args, meta, RECIPE)
        return y, jax.jit(_step)(*args, meta, probe)

    with ops.gemm_options(fused_epilogues=True):
        y_fused, g_fused = run()
    y_plain, g_plain = run()
    assert y_fused.dtype == y_plain.dtype == BF16
    assert _rel(y_fused, y_plain) < 0.02
    for got, want in zip(g_fused[:-1], g_plain[:-1], strict=True):
        assert got.dtype == want.dtype and got.shape == want.shape
        assert _rel(got, want) < 0.05
    np.testing.assert_allclose(np.asarray(g_fused[-1]), np.asarray(g_plain[-1]), rtol=0.01)
    assert np.all(np.isfinite(np.asarray(g_fused[-1])))


def test_fused_path_under_remat_and_vmap():
    """The residuals (codes and the float16 GELU input) survive ``jax.checkpoint`` with
    fp8jax's policy, and a vmapped call equals the loop."""
    x, gamma, beta, w1, w2, b1, b2 = _args()
    meta = fp8jax.init_fp8_meta(RECIPE, n_roles=6)

    def f(x, w1, probe):
        y = fp8jax.layernorm_mlp(x, gamma, beta, w1, w2, b1, b2, meta, RECIPE, probe=probe)
        return jnp.sum(y.astype(jnp.float32))

    probe = jnp.zeros((6,), jnp.float32)
    with ops.gemm_options(fused_epilogues=True):
        _remat_and_vmap(f, x, w1, probe, gamma, beta, w2, b1, b2, meta)


def _remat_and_vmap(f, x, w1, probe, gamma, beta, w2, b1, b2, meta):
    plain = jax.grad(f, argnums=(0, 1, 2))(x, w1, probe)
    remat = jax.checkpoint(f, policy=fp8jax.save_fp8_operands)
    remat = jax.grad(remat, argnums=(0, 1, 2))(x, w1, probe)
    for a, b in zip(plain, remat, strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    ys = jax.vmap(lambda xi: fp8jax.layernorm_mlp(xi, gamma, beta, w1, w2, b1, b2, meta, RECIPE))(x)
    for i in range(x.shape[0]):
        want = fp8jax.layernorm_mlp(x[i], gamma, beta, w1, w2, b1, b2, meta, RECIPE)
        np.testing.assert_array_equal(np.asarray(ys[i]), np.asarray(want))


# ------------------------------------------------------------------ GEMM options


def test_gemm_options_nest_validate_and_key_jit():
    assert ops.get_gemm_options() == ops.GemmOptions()
    with ops.gemm_options(autotune=False):
        with ops.gemm_options(min_fp8_flops=100):
            assert ops.get_gemm_options() == ops.GemmOptions(False, False, 100)
        assert ops.get_gemm_options().min_fp8_flops == 0
    with pytest.raises(ValueError, match="unknown option 'auto_tune'"):
        ops.gemm_options(auto_tune=False)
    with pytest.raises(TypeError, match="autotune must be a bool"):
        ops.gemm_options(autotune=1)
    with pytest.raises(ValueError, match="min_fp8_flops must be a non-negative int"):
        ops.gemm_options(min_fp8_flops=-1)
    with pytest.raises(ValueError, match="min_fp8_flops must be a non-negative int"):
        ops.gemm_options(min_fp8_flops=1e9)
    traces = []

    @jax.jit
    def f(x):
        traces.append(ops.get_gemm_options())
        return x

    f(1.0)
    with ops.gemm_options(fused_epilogues=True):
        f(1.0)
    f(1.0)
    assert len(traces) == 2  # the options are part of jit's cache key


def _fp8_calls(fn, *args) -> list[str]:
    text = jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()
    return re.findall(r"custom_call @(fp8jax_\w+)", text)


# Each layer's GEMMs: dense 32 x 48 x 64; layernorm_dense 32 x 48 x 32; layernorm_mlp 32 x 64 x 32
# and 32 x 32 x 64. ``enabled``: None (FP8, current scaling) or False (FP8 off).
def _layer(name, enabled=None):
    recipe = Float8CurrentScaling()
    x, xn = rand((32, 64), 1), rand((32, H), 2)
    w, wn = rand((64, 48), 3, 0.1), rand((H, 48), 4, 0.1)
    _, gamma, beta, w1, w2, b1, b2 = _args(jnp.float32)
    kw = dict(recipe=recipe, enabled=enabled)
    return {
        "dense": (lambda: fp8jax.dense(x, w, **kw), 2 * 32 * 48 * 64),
        "layernorm_dense": (lambda: fp8jax.layernorm_dense(xn, gamma, beta, wn, **kw),
                            2 * 32 * 48 * H),
        "layernorm_mlp": (lambda: fp8jax.layernorm_mlp(xn, gamma, beta, w1, w2, b1, b2, **kw),
                          2 * 32 * INTER * H),
    }[name]  # fmt: skip


@pytest.mark.parametrize("name", ["dense", "layernorm_dense", "layernorm_mlp"])
def test_small_gemms_stay_in_high_precision(name):
    """A layer whose largest GEMM is below ``min_fp8_flops`` runs as with FP8 off (the same bits,
    no fp8jax call in its program); at the threshold it is FP8 again; 0 (the default) never
    keeps anything in high precision."""
    fn, flops = _layer(name)
    fp8_calls = _fp8_calls(fn)
    assert "fp8jax_gemm" in fp8_calls
    with ops.gemm_options(min_fp8_flops=flops + 1):
        assert _fp8_calls(fn) == []
        small = fn()
    off, _ = _layer(name, enabled=False)
    np.testing.assert_array_equal(np.asarray(small), np.asarray(off()))
    with ops.gemm_options(min_fp8_flops=flops):
        assert _fp8_calls(fn) == fp8_calls
    with ops.gemm_options(min_fp8_flops=0):
        assert _fp8_calls(fn) == fp8_calls


def test_a_small_delayed_scaling_layer_leaves_its_state_as_it_is():
    """Under delayed scaling the small layer's probe gets a zero gradient: its amax history
    records 0, which changes no scale (fp8jax.ops.update_fp8_states keeps a scale whose history
    max is 0)."""
    x, w = rand((8, 16), 0), rand((16, 16), 1, 0.2)
    meta = fp8jax.init_fp8_meta(RECIPE)._replace(scale=jnp.full((3,), 4.0))

    def loss(w, probe):
        return jnp.sum(fp8jax.dense(x, w, None, meta, RECIPE, probe=probe))

    with ops.gemm_options(min_fp8_flops=2**30):
        _, probe_grad = jax.grad(loss, argnums=(0, 1))(w, jnp.zeros((3,), jnp.float32))
    np.testing.assert_array_equal(np.asarray(probe_grad), np.zeros(3))
    new = fp8jax.update_fp8_meta(meta, probe_grad, RECIPE)
    np.testing.assert_array_equal(np.asarray(new.scale), np.asarray(meta.scale))


# ------------------------------------------------------------ compiled memory on CPU


def _step_temp_bytes(model, x, fp8: bool) -> int:
    """XLA:CPU's temporary bytes of ``model``'s compiled gradient step on ``x`` (params and
    probes differentiated), FP8 under ``RECIPE`` or off."""
    with fp8jax.autocast(enabled=fp8, recipe=RECIPE):
        variables = model.init(jax.random.key(0), x)

    def loss(params, probes, x):
        with fp8jax.autocast(enabled=fp8, recipe=RECIPE):
            out = model.apply({**variables, "params": params, "fp8_probe": probes}, x)
        out = out[0] if isinstance(out, tuple) else out
        return jnp.mean(out.astype(jnp.float32) ** 2)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1)))
    compiled = grad.lower(variables["params"], variables.get("fp8_probe", {}), x).compile()
    return compiled.memory_analysis().temp_size_in_bytes


@pytest.mark.parametrize("name", ["layernorm_mlp", "transformer_layer"])
def test_the_fp8_step_holds_less_than_bf16_on_cpu(name):
    """Issue 48: at B8 S256 H512 (bf16, delayed scaling) the FP8 step's compiled temporaries
    stay below the same layer's in BF16 with the default options (the fused epilogues, whose
    CPU reference holds float32 temporaries, are opt-in)."""
    from fp8jax.flax import LayerNormMLP, TransformerLayer

    x = jnp.zeros((8, 256, 512), BF16)
    model = {
        "layernorm_mlp": LayerNormMLP(intermediate_dim=2048, activations=("gelu",), dtype=BF16,
                                      intermediate_dropout_rate=0.0),
        "transformer_layer": TransformerLayer(
            hidden_size=512, mlp_hidden_size=2048, num_attention_heads=8, hidden_dropout=0.0,
            attention_dropout=0.0, intermediate_dropout=0.0, dtype=BF16,
        ),
    }[name]  # fmt: skip
    fp8, bf16 = _step_temp_bytes(model, x, True), _step_temp_bytes(model, x, False)
    assert fp8 < bf16, (fp8, bf16)
