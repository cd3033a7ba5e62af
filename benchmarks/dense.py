"""FP8 dense layers, forward + backward: fp8jax vs BF16 vs XLA's own FP8 path, in one run.

The workload is an MLP block on ``--tokens`` tokens (default 16384): ``hidden -> ffn -> hidden``
(4096 -> 16384 -> 4096) with a GELU between, no bias, bf16 activations and params. One step is
the loss, the gradients of both weights and of the input (forward, dgrad and wgrad of each
layer: 6 GEMMs), and for the FP8 variants everything FP8 adds: the quantization of every GEMM
operand and the delayed-scaling state update.

  bf16     plain ``jnp`` matmuls in bf16 (float32 accumulation)
  fp8jax   two ``fp8jax.flax.DenseGeneral`` layers; grads w.r.t. params, input and probes, then
           ``update_fp8_variables`` (one kernel launch for both layers)
  xla_fp8  ``nn.Dense(dot_general_cls=flax.linen.fp8_ops.Fp8DirectDotGeneralOp)``: XLA's own FP8
           path (quantize-dequantize patterns that XLA rewrites to FP8 GEMMs); its state update
           is the gradient of its ``_overwrite_with_gradient`` collection

Each variant is jitted; each measurement runs it ``--inner`` times back to back and waits once;
the median of ``--iters`` measurements is reported, with TFLOP/s over the 6 GEMMs and the ratios
(targets: fp8jax >= 1.5x BF16 and >= 1.1x XLA FP8). Without a CUDA device it writes
``{"skipped": true}`` and exits 0, unless ``--allow-cpu`` (tiny sizes, to smoke-test the script).

  python benchmarks/dense.py --json out/dense.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from typing import Any

import flax.linen as nn
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
from flax.linen import fp8_ops

import fp8jax
from fp8jax.flax import DenseGeneral, update_fp8_variables
from fp8jax.recipe import DelayedScaling, Format

GPU_SIZES = {"tokens": 16384, "hidden": 4096, "ffn": 16384}
CPU_SIZES = {"tokens": 256, "hidden": 128, "ffn": 512}
TARGETS = {"fp8jax_vs_bf16": 1.5, "fp8jax_vs_xla_fp8": 1.1}
BF16 = jnp.bfloat16
RECIPE = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16, amax_compute_algo="max")


def _loss(out: jax.Array) -> jax.Array:
    return jnp.mean(jnp.square(out.astype(jnp.float32)))


class _Fp8jaxMlp(nn.Module):
    hidden: int
    ffn: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kw = dict(use_bias=False, dtype=BF16, param_dtype=BF16)
        h = DenseGeneral(features=self.ffn, name="up", **kw)(x)
        return DenseGeneral(features=self.hidden, name="down", **kw)(jax.nn.gelu(h))


class _XlaFp8Mlp(nn.Module):
    hidden: int
    ffn: int

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kw = dict(
            use_bias=False, dtype=BF16, param_dtype=BF16,
            dot_general_cls=fp8_ops.Fp8DirectDotGeneralOp,
        )  # fmt: skip
        h = nn.Dense(self.ffn, name="up", **kw)(x)
        return nn.Dense(self.hidden, name="down", **kw)(jax.nn.gelu(h))


def _bf16_step(params: dict[str, jax.Array], x: jax.Array) -> Any:
    def loss(params, x):
        h = jnp.dot(x, params["up"], preferred_element_type=jnp.float32).astype(BF16)
        out = jnp.dot(jax.nn.gelu(h), params["down"], preferred_element_type=jnp.float32)
        return _loss(out.astype(BF16))

    return jax.value_and_grad(loss, argnums=(0, 1))(params, x)


def _variants(sizes: dict[str, int]) -> dict[str, tuple[Callable[..., Any], tuple[Any, ...]]]:
    """name -> (jitted step, its arguments)."""
    t, hdim, f = sizes["tokens"], sizes["hidden"], sizes["ffn"]
    kx, k1, k2 = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (t, hdim), jnp.float32).astype(BF16)
    bf16_params = {
        "up": (jax.random.normal(k1, (hdim, f), jnp.float32) / hdim**0.5).astype(BF16),
        "down": (jax.random.normal(k2, (f, hdim), jnp.float32) / f**0.5).astype(BF16),
    }

    model = _Fp8jaxMlp(hidden=hdim, ffn=f)
    with fp8jax.autocast(enabled=True, recipe=RECIPE):
        v = model.init(jax.random.key(1), x)

    @jax.jit
    def fp8jax_step(params, fp8_meta, fp8_probe, x):
        def loss(params, fp8_probe, x):
            variables = {"params": params, "fp8_meta": fp8_meta, "fp8_probe": fp8_probe}
            with fp8jax.autocast(enabled=True, recipe=RECIPE):
                return _loss(model.apply(variables, x))

        value, (grads, probe_grads, dx) = jax.value_and_grad(loss, argnums=(0, 1, 2))(
            params, fp8_probe, x
        )
        return value, grads, dx, update_fp8_variables(fp8_meta, probe_grads, RECIPE)

    xla_model = _XlaFp8Mlp(hidden=hdim, ffn=f)
    xv = xla_model.init(jax.random.key(1), x)

    @jax.jit
    def xla_fp8_step(variables, x):
        return jax.value_and_grad(lambda v, x: _loss(xla_model.apply(v, x)), argnums=(0, 1))(
            variables, x
        )

    # Warm the FP8 states for a few steps, so the timed step quantizes with realistic scales.
    meta = v["fp8_meta"]
    for _ in range(3):
        meta = fp8jax_step(v["params"], meta, v["fp8_probe"], x)[3]
        grads = xla_fp8_step(xv, x)[1][0]
        xv = {**xv, fp8_ops.OVERWRITE_WITH_GRADIENT: grads[fp8_ops.OVERWRITE_WITH_GRADIENT]}
    return {
        "bf16": (jax.jit(_bf16_step), (bf16_params, x)),
        "fp8jax": (fp8jax_step, (v["params"], meta, v["fp8_probe"], x)),
        "xla_fp8": (xla_fp8_step, (xv, x)),
    }


def benchmark(args: argparse.Namespace, sizes: dict[str, int]) -> dict[str, Any]:
    flops = 6 * 2 * sizes["tokens"] * sizes["hidden"] * sizes["ffn"]
    raw: dict[str, list[float]] = {}
    losses: dict[str, float] = {}
    for name, (fn, fargs) in _variants(sizes).items():
        losses[name] = float(fn(*fargs)[0])
        raw[name] = time_op(lambda fn=fn, fargs=fargs: fn(*fargs), **_timing(args))
    med = {name: statistics.median(t) for name, t in raw.items()}
    results = [
        {
            "name": name,
            "median_ms": med[name] * 1e3,
            "min_ms": min(raw[name]) * 1e3,
            "tflops": flops / med[name] / 1e12,
            "speedup_vs_bf16": med["bf16"] / med[name],
            "loss": losses[name],
        }
        for name in raw
    ]
    ratios = {
        "fp8jax_vs_bf16": med["bf16"] / med["fp8jax"],
        "fp8jax_vs_xla_fp8": med["xla_fp8"] / med["fp8jax"],
    }
    finite = all(jnp.isfinite(v) for v in losses.values())
    close = abs(losses["fp8jax"] - losses["bf16"]) <= 0.1 * abs(losses["bf16"])
    return {
        "config": {
            **sizes,
            "gemms_per_step": 6,
            "flops_per_step": flops,
            "dtype": "bfloat16",
            "recipe": repr(RECIPE),
            **_timing(args),
        },
        "checks": {
            "losses_finite": bool(finite),
            "fp8jax_loss_within_10pct_of_bf16": bool(close),
            **{f"meets_{k}_{v}x": ratios[k] >= v for k, v in TARGETS.items()},
        },
        "results": results,
        "ratios": ratios,
        "targets": TARGETS,
        "raw_timings_s": raw,
    }


def _timing(args: argparse.Namespace) -> dict[str, int]:
    return {"iters": args.iters, "inner": args.inner, "warmup": args.warmup}


def print_table(report: dict[str, Any]) -> None:
    env, cfg = report["env"], report["config"]
    print(f"{env['device']} ({env['platform']}), driver {env['driver']}, jax {env['jax']}")
    print(
        f"MLP fwd+bwd: {cfg['tokens']} tokens, {cfg['hidden']} -> {cfg['ffn']} -> "
        f"{cfg['hidden']}, bf16, {cfg['gemms_per_step']} GEMMs"
    )
    print(f"{'variant':<10}{'median ms':>12}{'TFLOP/s':>10}{'vs bf16':>10}{'loss':>12}")
    for r in report["results"]:
        print(
            f"{r['name']:<10}{r['median_ms']:>12.3f}{r['tflops']:>10.1f}"
            f"{r['speedup_vs_bf16']:>10.2f}{r['loss']:>12.5g}"
        )
    ratios = report["ratios"]
    print(
        f"fp8jax: {ratios['fp8jax_vs_bf16']:.2f}x BF16 (target {TARGETS['fp8jax_vs_bf16']}x), "
        f"{ratios['fp8jax_vs_xla_fp8']:.2f}x XLA FP8 (target {TARGETS['fp8jax_vs_xla_fp8']}x)"
    )
    print("checks:", ", ".join(f"{k}={v}" for k, v in report["checks"].items()))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, help=f"default {GPU_SIZES['tokens']} (CPU: tiny)")
    p.add_argument("--hidden", type=int, help=f"default {GPU_SIZES['hidden']}")
    p.add_argument("--ffn", type=int, help=f"default {GPU_SIZES['ffn']}")
    add_timing_args(p, iters=20, inner=5, what="steps")
    args = p.parse_args(argv)
    check_timing_args(p, args)

    gpu = on_gpu()
    if not gpu and not args.allow_cpu:
        report: dict[str, Any] = skipped_report("dense")
    else:
        sizes = dict(GPU_SIZES if gpu else CPU_SIZES)
        for key in sizes:
            if getattr(args, key) is not None:
                if getattr(args, key) < 16:
                    p.error(f"--{key} must be >= 16")
                sizes[key] = getattr(args, key)
        report = {"benchmark": "dense", "skipped": False, "env": environment()}
        report.update(benchmark(args, sizes))
        print_table(report)
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
