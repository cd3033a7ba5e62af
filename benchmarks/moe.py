"""A mixture-of-experts layer's forward + backward, FP8 against BF16 (issue 47): fp8jax.moe under
DelayedScaling with the grouped GEMM on Hopper's tensor cores (``gemm_options(
grouped_tensor_cores=True)``) and on the CUDA cores, against the same layer with FP8 off (its
expert GEMMs XLA's BF16 ``ragged_dot``), at two sizes:

  mixtral   hidden 4096, expert FFN 14336, 8 experts, top-2, 16384 tokens (Mixtral 8x7B)
  deepseek  hidden 7168, expert FFN 2048, 32 experts (one GPU's share of DeepSeek-V3's 256 under
            8-way expert parallelism), top-8, 4096 tokens

On a GPU it times the three variants in one run (bfloat16 compute, float32 weights: mixed
precision as Flax's ``dtype=bfloat16``; the router in float32, included); without one,
``predicted()`` is the cost model's time of each variant at the same sizes
(benchmarks/cost_model.py, from the program lowered for CUDA), and ``tests/benchmarks/
test_moe_benchmark.py`` holds its ratios.

  python benchmarks/moe.py [--json PATH] [--allow-cpu]   # --allow-cpu: tiny sizes, CPU timings
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any

import cost_model
import jax
import jax.numpy as jnp
import numpy as np
from _common import (
    add_timing_args,
    check_timing_args,
    environment,
    on_gpu,
    skipped_report,
    time_op,
    write_json,
)

import fp8jax
from fp8jax.functional.moe import MoEConfig

RECIPE = fp8jax.DelayedScaling(amax_history_len=16)
#: name -> (tokens, hidden, expert FFN, experts, top-k)
SIZES = {
    "mixtral": (16384, 4096, 14336, 8, 2),
    "deepseek": (4096, 7168, 2048, 32, 8),
}
CPU_SIZES = {"tiny": (256, 128, 128, 4, 2)}
VARIANTS = ("fp8_tensor_cores", "fp8_cuda_cores", "bf16")


def _args(size: tuple[int, ...]) -> tuple[Any, ...]:
    """The layer's arguments as shapes (the program is lowered without allocating)."""
    t, h, i, e, _ = size
    f32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.float32)
    params = {"gate_kernel": f32(h, e), "wi_0": f32(e, h, i), "wi_1": f32(e, h, i),
              "wo": f32(e, i, h)}  # fmt: skip
    meta = jax.eval_shape(lambda: fp8jax.init_fp8_meta(RECIPE, 6 * e))
    return params, meta, f32(6 * e), jax.ShapeDtypeStruct((t, h), jnp.bfloat16)


def step(size: tuple[int, ...], variant: str):
    """The forward + backward of the layer (gradients of every param and of the input, as in a
    stack of layers; the FP8 observations)."""
    _, _, _, e, k = size
    cfg = MoEConfig(num_experts=e, num_experts_per_tok=k)
    fp8 = variant != "bf16"

    def fn(params, meta, probe, x):
        def loss(params, probe, x):
            out = fp8jax.moe(x, params, cfg, fp8_meta=meta, recipe=RECIPE, probe=probe,
                             enabled=fp8, dtype=jnp.bfloat16).out  # fmt: skip
            return jnp.mean(out.astype(jnp.float32) ** 2)

        return jax.grad(loss, argnums=(0, 1, 2))(params, probe, x)

    return fn


def _options(variant: str):
    return fp8jax.ops.gemm_options(grouped_tensor_cores=variant == "fp8_tensor_cores")


def lowered(size: tuple[int, ...], variant: str) -> str:
    """The step's HLO lowered for CUDA (no GPU needed)."""
    with _options(variant):
        traced = jax.jit(step(size, variant)).trace(*_args(size))
        return traced.lower(lowering_platforms=("cuda",)).as_text(dialect="hlo")


def predicted(name: str) -> dict[str, Any]:
    """The cost model's H100 milliseconds of each variant at ``SIZES[name]``, its ratios and
    where the FP8 step's time goes."""
    preds = {v: cost_model.predict(lowered(SIZES[name], v)) for v in VARIANTS}
    ms = {v: p.total_s * 1e3 for v, p in preds.items()}
    return {
        "predicted_ms": ms,
        "predicted_ratios": {
            "fp8_vs_bf16": ms["bf16"] / ms["fp8_tensor_cores"],
            "cuda_cores_vs_bf16": ms["bf16"] / ms["fp8_cuda_cores"],
        },
        "fp8_by_kind_ms": {
            k: v * 1e3 for k, v in preds["fp8_tensor_cores"].by_kind().items() if v > 1e-5
        },
    }


def measure(name: str, size: tuple[int, ...], args) -> dict[str, Any]:
    t, h, i, e, k = size
    r = np.random.default_rng(0)
    params = {
        "gate_kernel": jnp.asarray(r.standard_normal((h, e)) / np.sqrt(h), jnp.float32),
        "wi_0": jnp.asarray(r.standard_normal((e, h, i)) / np.sqrt(h), jnp.float32),
        "wi_1": jnp.asarray(r.standard_normal((e, h, i)) / np.sqrt(h), jnp.float32),
        "wo": jnp.asarray(r.standard_normal((e, i, h)) / np.sqrt(i), jnp.float32),
    }
    meta = fp8jax.init_fp8_meta(RECIPE, 6 * e)
    x = jnp.asarray(r.standard_normal((t, h)), jnp.bfloat16)
    probe = jnp.zeros((6 * e,), jnp.float32)
    row: dict[str, Any] = {"sizes": dict(tokens=t, hidden=h, ffn=i, experts=e, top_k=k)}
    for variant in VARIANTS:
        with _options(variant):
            fn = jax.jit(step(size, variant))
            fn(params, meta, probe, x)  # compiled under the variant's options
        times = time_op(lambda fn=fn: fn(params, meta, probe, x), iters=args.iters,
                        inner=args.inner, warmup=args.warmup)  # fmt: skip
        row[variant] = {"median_ms": statistics.median(times) * 1e3}
    base = row["bf16"]["median_ms"]
    row["fp8_vs_bf16"] = base / row["fp8_tensor_cores"]["median_ms"]
    row["cuda_cores_vs_bf16"] = base / row["fp8_cuda_cores"]["median_ms"]
    print(f"{name}: " + " ".join(f"{v}={row[v]['median_ms']:.2f}ms" for v in VARIANTS)
          + f" fp8/bf16 x{row['fp8_vs_bf16']:.2f}")  # fmt: skip
    return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_timing_args(p, iters=5, inner=2, what="steps")
    args = p.parse_args(argv)
    check_timing_args(p, args)
    if not on_gpu() and not args.allow_cpu:
        report = skipped_report("moe")
        report["predicted"] = {name: predicted(name) for name in SIZES}
        write_json(args.json, report)
        return report
    sizes = SIZES if on_gpu() else CPU_SIZES
    report = {
        "benchmark": "moe",
        "environment": environment(),
        "results": {name: measure(name, s, args) for name, s in sizes.items()},
        "predicted": {name: predicted(name) for name in SIZES},
    }
    write_json(args.json, report)
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
