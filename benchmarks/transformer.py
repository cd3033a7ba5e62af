"""One TransformerLayer train step: fp8jax FP8 vs fp8jax with FP8 off vs a BF16 Flax layer.

The workload is one pre-LN encoder layer with a causal mask (default batch 8 x sequence 2048,
hidden 4096, FFN 16384, 32 heads, BF16 params and activations, relu MLP, no relative bias): the
loss, the gradients of the params and of the input, and for FP8 the delayed-scaling update.

  fp8jax_fp8   ``fp8jax.flax.TransformerLayer`` inside ``autocast(enabled=True)``
  fp8jax_bf16  the same module with FP8 off (plain high-precision GEMMs)
  flax_bf16    the layer from plain Flax layers (benchmarks/transformer_memory.py's twin)

Median of ``--iters`` measurements of ``--inner`` back-to-back steps, ratios in the same run
(target: FP8 >= 1.6x the BF16 layers) and, where the backend reports it, peak device memory per
variant. Without a CUDA device it writes ``{"skipped": true}`` unless ``--allow-cpu`` (tiny).

  python benchmarks/transformer.py --json out/transformer.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from typing import Any

import jax
import jax.numpy as jnp
from _common import (
    add_timing_args,
    check_timing_args,
    environment,
    on_gpu,
    skipped_report,
    time_op,
    write_json,
)
from transformer_memory import Bf16Twin

import fp8jax
from fp8jax.flax import TransformerLayer, update_fp8_variables
from fp8jax.recipe import DelayedScaling

GPU_SIZES = {"batch": 8, "seq": 2048, "hidden": 4096, "ffn": 16384, "heads": 32}
CPU_SIZES = {"batch": 2, "seq": 64, "hidden": 128, "ffn": 512, "heads": 4}
TARGETS = {"fp8_vs_flax_bf16": 1.6}
BF16 = jnp.bfloat16
RECIPE = DelayedScaling(amax_history_len=16)


def _loss(out: jax.Array) -> jax.Array:
    return jnp.mean(jnp.square(out.astype(jnp.float32)))


def _variants(s: dict[str, int]) -> dict[str, tuple[Any, tuple[Any, ...]]]:
    x = jax.random.normal(jax.random.key(0), (s["batch"], s["seq"], s["hidden"])).astype(BF16)
    layer = TransformerLayer(
        hidden_size=s["hidden"], mlp_hidden_size=s["ffn"], num_attention_heads=s["heads"],
        hidden_dropout=0.0, attention_dropout=0.0, intermediate_dropout=0.0,
        enable_relative_embedding=False, dtype=BF16, param_dtype=BF16,
    )  # fmt: skip
    with fp8jax.autocast(enabled=True, recipe=RECIPE):
        v = layer.init(jax.random.key(1), x, deterministic=True)

    def make(enabled: bool):
        @jax.jit
        def step(params, meta, probes, x):
            def loss(params, probes, x):
                variables = {"params": params, "fp8_meta": meta, "fp8_probe": probes}
                with fp8jax.autocast(enabled=enabled, recipe=RECIPE):
                    return _loss(layer.apply(variables, x, deterministic=True))

            value, (g, pg, dx) = jax.value_and_grad(loss, argnums=(0, 1, 2))(params, probes, x)
            return value, g, dx, update_fp8_variables(meta, pg, RECIPE) if enabled else meta

        return step

    fp8_step, off_step = make(True), make(False)
    meta = v["fp8_meta"]
    for _ in range(3):  # realistic scales for the timed steps
        meta = fp8_step(v["params"], meta, v["fp8_probe"], x)[3]
    twin = Bf16Twin(s["heads"], s["ffn"])
    tp = twin.init(jax.random.key(2), x)

    @jax.jit
    def twin_step(p, x):
        return jax.value_and_grad(lambda p, x: _loss(twin.apply(p, x)), argnums=(0, 1))(p, x)

    return {
        "fp8jax_fp8": (fp8_step, (v["params"], meta, v["fp8_probe"], x)),
        "fp8jax_bf16": (off_step, (v["params"], meta, v["fp8_probe"], x)),
        "flax_bf16": (twin_step, (tp, x)),
    }


def _peak_bytes() -> int | None:
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use")


def benchmark(args: argparse.Namespace, sizes: dict[str, int]) -> dict[str, Any]:
    timing = {"iters": args.iters, "inner": args.inner, "warmup": args.warmup}
    raw: dict[str, list[float]] = {}
    peak: dict[str, int | None] = {}
    losses: dict[str, float] = {}
    for name, (fn, fargs) in _variants(sizes).items():
        losses[name] = float(fn(*fargs)[0])
        raw[name] = time_op(lambda fn=fn, fargs=fargs: fn(*fargs), **timing)
        peak[name] = _peak_bytes()  # cumulative high-water mark where the backend reports one
    med = {n: statistics.median(t) for n, t in raw.items()}
    ratios = {
        "fp8_vs_flax_bf16": med["flax_bf16"] / med["fp8jax_fp8"],
        "fp8_vs_fp8jax_bf16": med["fp8jax_bf16"] / med["fp8jax_fp8"],
    }
    return {
        "config": {**sizes, "dtype": "bfloat16", "recipe": repr(RECIPE), **timing},
        "checks": {f"meets_{k}_{v}x": ratios[k] >= v for k, v in TARGETS.items()},
        "results": [
            {"name": n, "median_ms": med[n] * 1e3, "loss": losses[n], "peak_bytes": peak[n]}
            for n in raw
        ],
        "ratios": ratios,
        "targets": TARGETS,
        "raw_timings_s": raw,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for key in GPU_SIZES:
        p.add_argument(f"--{key}", type=int, help=f"default {GPU_SIZES[key]} (CPU: tiny)")
    add_timing_args(p, iters=10, inner=3, what="steps")
    args = p.parse_args(argv)
    check_timing_args(p, args)
    if not on_gpu() and not args.allow_cpu:
        report: dict[str, Any] = skipped_report("transformer")
    else:
        sizes = dict(GPU_SIZES if on_gpu() else CPU_SIZES)
        sizes.update({k: getattr(args, k) for k in sizes if getattr(args, k) is not None})
        report = {"benchmark": "transformer", "skipped": False, "env": environment()}
        report.update(benchmark(args, sizes))
        print(f"{report['env']['device']}: TransformerLayer train step, {sizes}")
        for r in report["results"]:
            print(f"  {r['name']:<12}{r['median_ms']:>10.2f} ms  loss {r['loss']:.5g}")
        print("ratios:", {k: round(v, 3) for k, v in report["ratios"].items()})
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
