"""Every kernel inside a loop body and in a chain of calls: what XLA records into a CUDA graph.

On a GPU, XLA captures consecutive custom calls and the bodies of ``scan``/``while`` into command
buffers (CUDA graphs) when the handler declares itself graph-compatible, as every fp8jax handler
does. A handler must then call nothing the CUDA runtime refuses during stream capture (the first
GPU run found ``cudaStreamGetDevice`` refused there). Here each op runs in a ``lax.scan`` body next
to the others, and its results must equal the same op called alone, outside any loop. On CPU the
test checks the same equality (no graphs there).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from _shared import normal
from _values import assert_fp8_equal

import fp8jax
from fp8jax import ops

E4M3 = jnp.float8_e4m3fn
E5M2 = jnp.float8_e5m2
RECIPE = fp8jax.DelayedScaling(amax_history_len=4)


def _step(x, g, gamma, beta, hist, scale):
    """One of each kernel, chained the way a layer chains them; every output."""
    y, mu, rsigma = ops.norm_forward(x, gamma, beta, norm_type="layernorm", epsilon=1e-6)
    out = [y, mu, rsigma]
    out += ops.norm_forward_fp8(x, gamma, beta, scale, E4M3, norm_type="layernorm", epsilon=1e-6)
    q, s_inv, amax = ops.quantize(y, scale, E4M3)
    c, ct, c_sinv, c_amax = ops.cast_transpose(x, scale, E4M3)
    dbias_out = ops.cast_transpose_dbias(g, scale, E5M2)
    out += [q, s_inv, amax, c, ct, c_sinv, c_amax, *dbias_out]
    out += ops.activation_cast_transpose(x[:, None], scale, E4M3, ("gelu",))
    out += ops.dactivation_cast_transpose_dbias(g, x[:, None], scale, E5M2, ("gelu",))
    out += [ops.activation(x[:, None], ("gelu",)), ops.dactivation(g, x[:, None], ("gelu",))]
    out += [ops.gemm(q, c, s_inv, c_sinv, out_dtype=jnp.float32, accumulate="split")]
    out += ops.norm_backward(g, x, mu, rsigma, gamma, norm_type="layernorm")
    amaxes = jnp.stack([amax, dbias_out[3]])
    out += ops.update_fp8_states(hist, jnp.stack([scale, scale]), amaxes, RECIPE)
    out += [ops.dequantize(q, s_inv, jnp.float32)]
    return tuple(out)


def test_every_kernel_in_a_scan_body_equals_the_op_alone():
    rng = np.random.default_rng(0)
    n, rows, h = 3, 64, 128
    xs = normal(rng, (n, rows, h), jnp.bfloat16)
    gs = normal(rng, (n, rows, h), jnp.bfloat16)
    gamma = jnp.asarray(rng.uniform(0.5, 1.5, h), jnp.float32)
    beta = normal(rng, h)
    hist = jnp.asarray(rng.uniform(0.1, 4.0, (2, RECIPE.amax_history_len)), jnp.float32)
    scale = jnp.float32(2.0)

    @jax.jit
    def looped(xs, gs):
        def body(carry, xg):
            return carry, _step(xg[0], xg[1], gamma, beta, hist, scale)

        return jax.lax.scan(body, 0, (xs, gs))[1]

    got = looped(xs, gs)
    for i in range(n):
        want = _step(xs[i], gs[i], gamma, beta, hist, scale)
        for a, b in zip(got, want, strict=True):
            a, b = np.asarray(a[i]), np.asarray(b)
            if a.dtype in (np.dtype(E4M3), np.dtype(E5M2)):
                assert_fp8_equal(a, b)
            elif a.shape == (rows, rows):  # the GEMM: cuBLASLt may pick another algorithm
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5 * np.abs(b).max())
            else:
                np.testing.assert_array_equal(a, b)
