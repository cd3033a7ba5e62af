"""fp8jax.ops.gemms.fixed_groups: the gated LayerNormMLP's GEMM1 with the activation pair as its
own dim.

On one device it runs the very 2-D GEMMs the layer's 2-D form runs (each device reshapes its
block), so the gated block's outputs and every gradient are the same bits either way; under
``vmap`` it falls back to the 2-D form. Its sharding is tested on 8 devices in
tests/distributed/test_mlp_parallel.py. The norm and activation ops run their XLA form here
(only the GEMM family matters), so this runs wherever the FP8 GEMM kernel does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _shared import rand

import fp8jax
from fp8jax import DelayedScaling, Float8CurrentScaling, ops
from fp8jax.functional.mlp import layernorm_mlp_observed
from fp8jax.ops.gemms import fixed_groups

H, INTER, ROWS = 16, 32, 24
RECIPE = DelayedScaling(amax_history_len=4)


@pytest.fixture(autouse=True)
def _kernel_gemm():
    with ops.implementation("xla", gemm="kernel"):
        yield


def _args(bias=True):
    x = rand((2, ROWS // 2, H), 0, 2.0)
    gamma, beta = 1.0 + rand((H,), 1, 0.1), rand((H,), 2, 0.1)
    w1, w2 = rand((H, 2, INTER), 3, H**-0.5), rand((INTER, H), 4, INTER**-0.5)
    b1 = rand((2, INTER), 5, 0.1) if bias else None
    b2 = rand((H,), 6, 0.1) if bias else None
    return x, gamma, beta, w1, w2, b1, b2


def _run(args, recipe, grouped, monkeypatch):
    """The gated block's output and the gradients of every argument and of the probe."""
    monkeypatch.setattr(fixed_groups, "usable", lambda impl: grouped and impl == "kernel")
    meta = fp8jax.init_fp8_meta(recipe, n_roles=6) if isinstance(recipe, DelayedScaling) else None
    # a scale other than one, so that the scales reach every GEMM
    if meta is not None:
        meta = meta._replace(scale=jnp.linspace(0.5, 4.0, 6, dtype=jnp.float32))
    idx = [i for i, a in enumerate(args) if a is not None]

    def loss(xs, probe):
        full = list(args)
        for i, v in zip(idx, xs, strict=True):
            full[i] = v
        x, gamma, beta, w1, w2, b1, b2 = full
        y, _, _ = layernorm_mlp_observed(
            x, gamma, beta, w1, w2, b1, b2, meta, recipe, probe=probe, layernorm_type="layernorm",
            epsilon=1e-6, zero_centered_gamma=False, activations=("silu", "linear"),
            dropout_mask=None, return_layernorm_output=False, dtype=None, enabled=None,
        )  # fmt: skip
        return jnp.sum(y * jnp.cos(jnp.arange(y.size, dtype=y.dtype).reshape(y.shape))), y

    fn = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))
    (grads, probe_grad), y = fn([args[i] for i in idx], jnp.zeros((6,), jnp.float32))
    return y, grads, probe_grad


@pytest.mark.parametrize("bias", [True, False])
def test_same_bits_as_the_2d_form(bias, monkeypatch):
    args = _args(bias)
    y, grads, probe = _run(args, RECIPE, True, monkeypatch)
    y2, grads2, probe2 = _run(args, RECIPE, False, monkeypatch)
    np.testing.assert_array_equal(y, y2)
    for g, g2 in zip(grads, grads2, strict=True):
        assert g.shape == g2.shape and g.dtype == g2.dtype
        np.testing.assert_array_equal(g, g2)
    np.testing.assert_array_equal(probe, probe2)  # every role's amax


def test_used_for_gated_delayed_scaling_only(monkeypatch):
    """The grouped GEMMs run for a gated block under delayed scaling with the kernel GEMM; not
    under current scaling (whose activation-gradient cast is 2-D) nor the XLA GEMM."""
    monkeypatch.setattr(fixed_groups, "usable", fixed_groups.usable)
    assert fixed_groups.usable("kernel") and not fixed_groups.usable("xla")
    calls = []
    real = fixed_groups.gemm_n
    monkeypatch.setattr(fixed_groups, "gemm_n", lambda *a, **k: calls.append(1) or real(*a, **k))
    x, gamma, beta, w1, w2, b1, b2 = _args()
    for recipe, used in ((RECIPE, True), (Float8CurrentScaling(), False)):
        calls.clear()
        meta = fp8jax.init_fp8_meta(RECIPE, n_roles=6) if used else None
        jax.eval_shape(
            lambda x, meta, recipe=recipe: fp8jax.layernorm_mlp(
                x, gamma, beta, w1, w2, b1, b2, meta, recipe, activations=("silu", "linear")
            ),
            x,
            meta,
        )
        assert bool(calls) == used, recipe


def test_vmap_falls_back_to_the_2d_form():
    """Under ``vmap`` (no partitioning rule there) the grouped GEMMs batch as the 2-D GEMMs."""
    x, gamma, beta, w1, w2, b1, b2 = _args()
    xs = jnp.stack([x, 0.5 * x + 1.0])
    meta = fp8jax.init_fp8_meta(RECIPE, n_roles=6)

    def f(x):
        return fp8jax.layernorm_mlp(
            x, gamma, beta, w1, w2, b1, b2, meta, RECIPE, activations=("silu", "linear")
        )

    def loss(w1, probe, x):
        y = fp8jax.layernorm_mlp(
            x, gamma, beta, w1, w2, b1, b2, meta, RECIPE, activations=("silu", "linear"),
            probe=probe,
        )  # fmt: skip
        return jnp.sum(y**2)

    grad = jax.grad(loss, argnums=(0, 1))
    probe = jnp.zeros((6,), jnp.float32)
    batched = jax.jit(jax.vmap(f))(xs)
    dw1, _ = jax.jit(jax.vmap(grad, in_axes=(None, None, 0)))(w1, probe, xs)
    for i in range(2):
        np.testing.assert_allclose(batched[i], jax.jit(f)(xs[i]), rtol=1e-6, atol=1e-6)
        one, _ = jax.jit(grad)(w1, probe, xs[i])
        np.testing.assert_allclose(dw1[i], one, rtol=1e-5, atol=1e-6)
