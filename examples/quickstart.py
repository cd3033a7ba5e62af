"""fp8jax quickstart (placeholder): FP8 round trip of a bf16 activation tensor.

Run with ``bash tools/demo.sh`` (sets up .venv) or ``python examples/quickstart.py``.
"""

import jax
import jax.numpy as jnp

import fp8jax
from fp8jax.recipe import fp8_max


def main() -> None:
    supported, reason = fp8jax.fp8_support()
    print(f"backend: {jax.default_backend()}, fp8_support: {supported} ({reason})")

    x = jax.random.normal(jax.random.key(0), (1024, 768), jnp.float32).astype(jnp.bfloat16)
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
    scale = (fp8_max(jnp.float8_e4m3fn) / amax).reshape(1)

    q, scale_inv, amax_seen = fp8jax.ops.quantize(x, scale, jnp.float8_e4m3fn)
    y = fp8jax.ops.dequantize(q, scale_inv, jnp.float32)

    xf = x.astype(jnp.float32)
    rel = jnp.abs(y - xf) / jnp.maximum(jnp.abs(xf), 1e-30)
    normal = jnp.abs(xf) * scale[0] >= 2.0**-6  # lands in E4M3's normal range
    print(f"x: {x.shape} {x.dtype} -> q: {q.shape} {q.dtype}, scale {float(scale[0]):.4g}")
    print(f"amax reported by quantize: {float(amax_seen[0]):.4g} (expected {float(amax):.4g})")
    print(f"max relative error, normal range: {float(jnp.max(rel, where=normal, initial=0)):.4g}")
    print("  (bound: half an E4M3 ulp, 2**-4 = 0.0625)")
    print(f"max relative error, all elements: {float(jnp.max(rel)):.4g} (tiny values flush to 0)")


if __name__ == "__main__":
    main()
