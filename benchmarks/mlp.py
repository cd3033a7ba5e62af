"""LayerNormMLP forward + backward: fp8jax FP8 vs the BF16 Flax block vs XLA's own FP8 path.

The workload is a Transformer MLP block on ``--tokens`` tokens (default 16384): LayerNorm ->
``hidden -> ffn`` (4096 -> 16384) -> GELU -> ``ffn -> hidden``, no bias, bf16 activations and
params. One step is the loss, the gradients of the params and of the input, and for fp8jax the
delayed-scaling state update.

  bf16     ``nn.LayerNorm -> nn.DenseGeneral -> gelu -> nn.Dense`` in bf16
  fp8jax   ``fp8jax.flax.LayerNormMLP`` (norm and GELU fused with their FP8 casts), grads w.r.t.
           params, input and probes, then ``update_fp8_variables``
  xla_fp8  the bf16 block with ``dot_general_cls=Fp8DirectDotGeneralOp``: XLA's own FP8 path

Median of ``--iters`` measurements of ``--inner`` back-to-back steps; ratios in the same run
(target: fp8jax >= 1.5x BF16). Without a CUDA device it writes ``{"skipped": true}`` and exits
0, unless ``--allow-cpu`` (tiny sizes, to smoke-test the script).

  python benchmarks/mlp.py --json out/mlp.json
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
from fp8jax.flax import LayerNormMLP, update_fp8_variables
from fp8jax.recipe import DelayedScaling, Format

GPU_SIZES = {"tokens": 16384, "hidden": 4096, "ffn": 16384}
CPU_SIZES = {"tokens": 256, "hidden": 128, "ffn": 512}
TARGETS = {"fp8jax_vs_bf16": 1.5}
BF16 = jnp.bfloat16
RECIPE = DelayedScaling(fp8_format=Format.HYBRID, amax_history_len=16, amax_compute_algo="max")


def _loss(out: jax.Array) -> jax.Array:
    return jnp.mean(jnp.square(out.astype(jnp.float32)))


class _FlaxMlp(nn.Module):
    """The BF16 block from Flax layers (``dot_general_cls``: XLA's FP8 path)."""

    hidden: int
    ffn: int
    dot_general_cls: Any = None

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        kw = dict(
            use_bias=False, dtype=BF16, param_dtype=BF16, dot_general_cls=self.dot_general_cls
        )
        ln = nn.LayerNorm(dtype=BF16, param_dtype=BF16, name="ln")(x)
        h = nn.Dense(self.ffn, name="up", **kw)(ln)
        return nn.Dense(self.hidden, name="down", **kw)(nn.gelu(h))


def _variants(sizes: dict[str, int]) -> dict[str, tuple[Callable[..., Any], tuple[Any, ...]]]:
    """name -> (jitted step, its arguments)."""
    t, hdim, f = sizes["tokens"], sizes["hidden"], sizes["ffn"]
    x = jax.random.normal(jax.random.key(0), (t, hdim), jnp.float32).astype(BF16)

    model = LayerNormMLP(
        intermediate_dim=f,
        activations=("gelu",),
        intermediate_dropout_rate=0.0,
        dtype=BF16,
        param_dtype=BF16,
    )
    with fp8jax.autocast(enabled=True, recipe=RECIPE):
        v = model.init(jax.random.key(1), x)
    p = v["params"]
    # the same params in the Flax blocks (so the losses are comparable)
    flax_params = {
        "params": {
            "ln": {"scale": p["scale"], "bias": p["ln_bias"]},
            "up": {"kernel": p["wi_kernel"].reshape(hdim, f)},
            "down": {"kernel": p["wo_kernel"]},
        }
    }

    plain = _FlaxMlp(hdim, f)
    pv = flax_params

    @jax.jit
    def bf16_step(v, x):
        return jax.value_and_grad(lambda v, x: _loss(plain.apply(v, x)), argnums=(0, 1))(v, x)

    @jax.jit
    def fp8jax_step(params, fp8_meta, fp8_probe, x):
        def loss(params, fp8_probe, x):
            variables = {"params": params, "fp8_meta": fp8_meta, "fp8_probe": fp8_probe}
            with fp8jax.autocast(enabled=True, recipe=RECIPE):
                return _loss(model.apply(variables, x)[0])

        value, (grads, probe_grads, dx) = jax.value_and_grad(loss, argnums=(0, 1, 2))(
            params, fp8_probe, x
        )
        return value, grads, dx, update_fp8_variables(fp8_meta, probe_grads, RECIPE)

    xla_model = _FlaxMlp(hdim, f, fp8_ops.Fp8DirectDotGeneralOp)
    xv = {**xla_model.init(jax.random.key(1), x), **flax_params}

    @jax.jit
    def xla_fp8_step(variables, x):
        return jax.value_and_grad(lambda v, x: _loss(xla_model.apply(v, x)), argnums=(0, 1))(
            variables, x
        )

    meta = v["fp8_meta"]
    for _ in range(3):  # realistic scales for the timed steps
        meta = fp8jax_step(v["params"], meta, v["fp8_probe"], x)[3]
        grads = xla_fp8_step(xv, x)[1][0]
        xv = {**xv, fp8_ops.OVERWRITE_WITH_GRADIENT: grads[fp8_ops.OVERWRITE_WITH_GRADIENT]}
    return {
        "bf16": (bf16_step, (pv, x)),
        "fp8jax": (fp8jax_step, (v["params"], meta, v["fp8_probe"], x)),
        "xla_fp8": (xla_fp8_step, (xv, x)),
    }


def benchmark(args: argparse.Namespace, sizes: dict[str, int]) -> dict[str, Any]:
    flops = 6 * 2 * sizes["tokens"] * sizes["hidden"] * sizes["ffn"]
    timing = {"iters": args.iters, "inner": args.inner, "warmup": args.warmup}
    raw: dict[str, list[float]] = {}
    losses: dict[str, float] = {}
    for name, (fn, fargs) in _variants(sizes).items():
        losses[name] = float(fn(*fargs)[0])
        raw[name] = time_op(lambda fn=fn, fargs=fargs: fn(*fargs), **timing)
    med = {name: statistics.median(t) for name, t in raw.items()}
    ratios = {
        "fp8jax_vs_bf16": med["bf16"] / med["fp8jax"],
        "fp8jax_vs_xla_fp8": med["xla_fp8"] / med["fp8jax"],
    }
    close = abs(losses["fp8jax"] - losses["bf16"]) <= 0.1 * abs(losses["bf16"])
    return {
        "config": {
            **sizes,
            "gemms_per_step": 6,
            "flops_per_step": flops,
            "dtype": "bfloat16",
            "recipe": repr(RECIPE),
            **timing,
        },
        "checks": {
            "fp8jax_loss_within_10pct_of_bf16": bool(close),
            **{f"meets_{k}_{v}x": ratios[k] >= v for k, v in TARGETS.items()},
        },
        "results": [
            {
                "name": n,
                "median_ms": med[n] * 1e3,
                "tflops": flops / med[n] / 1e12,
                "speedup_vs_bf16": med["bf16"] / med[n],
                "loss": losses[n],
            }
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
    add_timing_args(p, iters=20, inner=5, what="steps")
    args = p.parse_args(argv)
    check_timing_args(p, args)
    gpu = on_gpu()
    if not gpu and not args.allow_cpu:
        report: dict[str, Any] = skipped_report("mlp")
    else:
        sizes = dict(GPU_SIZES if gpu else CPU_SIZES)
        for key in sizes:
            if getattr(args, key) is not None:
                sizes[key] = getattr(args, key)
        report = {"benchmark": "mlp", "skipped": False, "env": environment()}
        report.update(benchmark(args, sizes))
        env, cfg = report["env"], report["config"]
        print(
            f"{env['device']} ({env['platform']}), jax {env['jax']}; LayerNormMLP fwd+bwd, "
            f"{cfg['tokens']} tokens, {cfg['hidden']} -> {cfg['ffn']} -> {cfg['hidden']}"
        )
        for r in report["results"]:
            print(
                f"  {r['name']:<8}{r['median_ms']:>10.3f} ms {r['tflops']:>8.2f} TFLOP/s "
                f"{r['speedup_vs_bf16']:>6.2f}x bf16  loss {r['loss']:.5g}"
            )
        print("checks:", report["checks"])
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
