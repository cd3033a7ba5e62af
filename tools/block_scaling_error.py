"""Quantization error of each FP8 scaling granularity on heavy-tailed inputs (issue 21):
per-tensor current scaling, Float8BlockScaling's 1 x 128 and 128 x 128 blocks (power-of-two and
float32 scales) and MXFP8's 1 x 32 blocks, all E4M3, on inputs shaped like a Transformer's
activations. Prints the markdown table of docs/numerics.md ("Block scaling").

    python tools/block_scaling_error.py [--rows 4096] [--cols 1024] [--seed 0]
"""

from __future__ import annotations

import argparse

import jax.numpy as jnp
import numpy as np

from fp8jax.ops import quantize_reference
from fp8jax.ops.block import block_scaling as bs

E4M3 = jnp.dtype(jnp.float8_e4m3fn)


def inputs(rows: int, cols: int, seed: int) -> dict[str, np.ndarray]:
    """The test tensors: Gaussian; Gaussian with 1% outlier channels 100x larger (LLM
    activations); Student-t with 3 degrees of freedom (heavy tails everywhere); Gaussian rows
    whose scale spans 2**-8 .. 2**8 (per-token magnitude differences)."""
    r = np.random.default_rng(seed)
    g = r.standard_normal((rows, cols))
    outlier = g.copy()
    outlier[:, r.choice(cols, max(1, cols // 100), replace=False)] *= 1000.0
    t3 = r.standard_t(3, (rows, cols))
    spread = g * np.exp2(r.uniform(-8, 8, (rows, 1)))
    return {"gaussian": g, "outlier channels (1%, x1000)": outlier, "student-t (3)": t3,
            "rows spanning 2^+-8": spread}  # fmt: skip


def schemes():
    """name -> fn(x float32 jnp) -> dequantized float64 numpy."""

    def per_tensor(x):
        amax = float(jnp.max(jnp.abs(x)))
        scale = jnp.float32(448.0 / amax)
        q, sinv, _ = quantize_reference(x, scale, E4M3)
        return np.asarray(q.astype(jnp.float32), np.float64) * float(sinv)

    def blocks(block, pow2):
        def fn(x):
            q, s = bs.block_quantize(x, E4M3, block, power_2_scale=pow2)
            return np.asarray(bs.block_dequantize(q, s, block), np.float64)

        return fn

    def mxfp8(x):
        q, s = bs.mxfp8_quantize(x, E4M3)
        return np.asarray(bs.block_dequantize(q, s, bs.MXFP8_BLOCK), np.float64)

    return {
        "per-tensor (current)": per_tensor,
        "1 x 128, power-of-two": blocks(bs.BLOCK_1D, True),
        "1 x 128, float32": blocks(bs.BLOCK_1D, False),
        "128 x 128, power-of-two": blocks(bs.BLOCK_2D, True),
        "MXFP8 1 x 32": mxfp8,
    }


def errors(rows: int = 4096, cols: int = 1024, seed: int = 0) -> dict[str, dict[str, tuple]]:
    """input name -> scheme name -> (mean relative error of the nonzero inputs, fraction of them
    that quantize to 0). The mean of |error| / |x| weighs every element alike, so it shows
    what the small values of a tensor lose to a scale set by its large ones (a norm-wise
    error would be decided by the few largest)."""
    out: dict[str, dict[str, tuple]] = {}
    for name, x in inputs(rows, cols, seed).items():
        x32 = x.astype(np.float32)
        ref = x32.astype(np.float64)
        row = {}
        for scheme, fn in schemes().items():
            d = fn(jnp.asarray(x32))
            nz = ref != 0
            rel = float(np.mean(np.abs(d - ref)[nz] / np.abs(ref)[nz]))
            lost = float(np.mean(d[nz] == 0))
            row[scheme] = (rel, lost)
        out[name] = row
    return out


def table(result: dict[str, dict[str, tuple]]) -> str:
    names = list(next(iter(result.values())))
    lines = ["| input | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
    for inp, row in result.items():
        cells = [f"{row[n][0]:.2%}" + (f" ({row[n][1]:.1%} to 0)" if row[n][1] >= 0.001 else "")
                 for n in names]  # fmt: skip
        lines.append(f"| {inp} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=4096)
    p.add_argument("--cols", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    print(table(errors(a.rows, a.cols, a.seed)))


if __name__ == "__main__":
    main()
