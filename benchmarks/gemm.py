"""FP8 GEMM throughput: fp8jax.ops.gemm against BF16 and against XLA's own FP8 path, in one run.

Every method computes ``out[M, N] = a[M, K] @ b[N, K].T`` with a bfloat16 result, on the same data,
in the same process; the report gives TFLOP/s (``2*M*N*K / time``) and the ratios:

  bf16       lax.dot_general of bf16 [M, K] and [N, K] (the "NT" layout), bf16 result
  fp8jax     fp8jax.ops.gemm(E4M3, E4M3, scales, out_dtype=bf16, accumulate="fast"): cuBLASLt
  xla_fp8    Flax's direct FP8 path, the ops inside flax.linen.fp8_ops.Fp8DirectDotGeneralOp on
             already-quantized operands: fp8_ops.quantized_dot (lax.dot_general of the E4M3
             tensors with a bf16 result, which XLA's GEMM rewriter turns into its own cuBLASLt FP8
             call) followed by fp8_ops.out_dq (the scales); the input quantization is left out,
             as it is for fp8jax

Default shapes (M, N, K): cubes of 2048, 4096, 8192 and 16384, and LLM projections
(16384, 4096, 4096), (16384, 14336, 4096) and (16384, 4096, 14336). The target is fp8jax >= 1.75x
the BF16 throughput at 8192^3 on an H100.

Each measurement runs a method ``--inner`` times back to back and waits with
``block_until_ready``; the median of ``--iters`` measurements after ``--warmup`` calls is
reported. Checks before timing: fp8jax agrees with the XLA FP8 result, and (on a GPU) the XLA path
really compiled to an FP8 cuBLASLt call rather than a silent BF16 fallback. Without a CUDA device
it writes ``{"skipped": true}`` and exits 0, unless ``--allow-cpu`` (tiny sizes, a smoke test).

  python benchmarks/gemm.py --json out/gemm.json
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from _common import add_timing_args, check_timing_args, environment, time_op
from jax import lax

import fp8jax

E4M3 = jnp.float8_e4m3fn
NT = (((1,), (1,)), ((), ()))
GPU_SHAPES = [
    (2048, 2048, 2048),
    (4096, 4096, 4096),
    (8192, 8192, 8192),
    (16384, 16384, 16384),
    (16384, 4096, 4096),
    (16384, 14336, 4096),
    (16384, 4096, 14336),
]
CPU_SHAPES = [(64, 48, 80), (128, 128, 128)]
TARGET_SHAPE = (8192, 8192, 8192)
TARGET_SPEEDUP = 1.75
METHODS = ("bf16", "fp8jax", "xla_fp8")


def _flax_fp8_ops() -> Any:
    from flax.linen import fp8_ops

    return fp8_ops


def make_methods() -> dict[str, Callable[..., jax.Array]]:
    """Jitted ``(x_bf16, w_bf16, a_q, b_q, a_scale_inv, b_scale_inv) -> bf16 [M, N]`` per method."""
    fp8_ops = _flax_fp8_ops()

    def bf16(x, w, a_q, b_q, sa, sb):
        del a_q, b_q, sa, sb
        return lax.dot_general(x, w, NT, preferred_element_type=jnp.bfloat16)

    def fp8jax_gemm(x, w, a_q, b_q, sa, sb):
        del x, w
        return fp8jax.ops.gemm(a_q, b_q, sa, sb, out_dtype=jnp.bfloat16, accumulate="fast")

    def xla_fp8(x, w, a_q, b_q, sa, sb):
        # Arguments as Fp8DirectDotGeneralOp passes them; the forward pass uses q_lhs, q_rhs.
        y = fp8_ops.quantized_dot(x, a_q, sa, w, b_q, sb, sa, jnp.zeros((1,)), NT, jnp.bfloat16)
        return fp8_ops.out_dq(jnp.bfloat16, sa, sb, y)

    return {"bf16": jax.jit(bf16), "fp8jax": jax.jit(fp8jax_gemm), "xla_fp8": jax.jit(xla_fp8)}


def make_operands(m: int, n: int, k: int, seed: int = 0) -> tuple[jax.Array, ...]:
    """bf16 ``x [M, K]``, ``w [N, K]`` and their E4M3 quantizations with per-tensor scale_inv."""
    kx, kw = jax.random.split(jax.random.key(seed))
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    w = (jax.random.normal(kw, (n, k), jnp.bfloat16) * 0.02).astype(jnp.bfloat16)
    out = [x, w]
    for t in (x, w):
        amax = jnp.max(jnp.abs(t).astype(jnp.float32))
        scale = 448.0 / amax
        q, scale_inv, _ = fp8jax.ops.quantize(t, scale.reshape(1), E4M3)
        out += [q, scale_inv]
    x, w, a_q, sa, b_q, sb = out
    return jax.block_until_ready((x, w, a_q, b_q, sa, sb))


def xla_fp8_uses_fp8_gemm(fn: Callable[..., jax.Array], args: tuple[jax.Array, ...]) -> bool:
    """Whether XLA compiled the FP8 dot to its cuBLASLt FP8 custom call (no BF16 fallback)."""
    hlo = fn.lower(*args).compile().as_text()
    return "cublas$lt$matmul$f8" in hlo


def benchmark(args: argparse.Namespace, on_gpu: bool) -> dict[str, Any]:
    methods = make_methods()
    raw: dict[str, dict[str, list[float]]] = {}
    results = []
    checks: dict[str, Any] = {}
    for m, n, k in args.shapes:
        name = f"{m}x{n}x{k}"
        operands = make_operands(m, n, k)
        outs = {meth: methods[meth](*operands) for meth in METHODS}
        ref = outs["xla_fp8"].astype(jnp.float32)
        diff = jnp.max(jnp.abs(outs["fp8jax"].astype(jnp.float32) - ref))
        rel = float(diff / jnp.maximum(jnp.max(jnp.abs(ref)), 1e-30))
        checks[f"{name}_fp8jax_vs_xla_fp8_max_rel_diff"] = rel
        checks[f"{name}_fp8jax_matches_xla_fp8"] = rel < 2.0**-6
        if on_gpu and name == "x".join(map(str, args.shapes[0])):
            checks["xla_fp8_uses_fp8_cublaslt"] = xla_fp8_uses_fp8_gemm(
                methods["xla_fp8"], operands
            )
            fp8jax_hlo = methods["fp8jax"].lower(*operands).compile().as_text()
            checks["fp8jax_calls_fp8jax_gemm"] = "fp8jax_gemm" in fp8jax_hlo
        del outs, ref
        flops = 2.0 * m * n * k
        row: dict[str, Any] = {"shape": name, "M": m, "N": n, "K": k}
        raw[name] = {}
        for meth in METHODS:
            call = functools.partial(methods[meth], *operands)
            times = time_op(call, iters=args.iters, inner=args.inner, warmup=args.warmup)
            raw[name][meth] = times
            med = statistics.median(times)
            row[f"{meth}_ms"] = med * 1e3
            row[f"{meth}_tflops"] = flops / med / 1e12
        row["fp8jax_over_bf16"] = row["fp8jax_tflops"] / row["bf16_tflops"]
        row["fp8jax_over_xla_fp8"] = row["fp8jax_tflops"] / row["xla_fp8_tflops"]
        row["xla_fp8_over_bf16"] = row["xla_fp8_tflops"] / row["bf16_tflops"]
        results.append(row)
        del operands, call
    target = next((r for r in results if (r["M"], r["N"], r["K"]) == TARGET_SHAPE), None)
    return {
        "config": {
            "shapes": [list(s) for s in args.shapes],
            "layout": "NT: a [M, K], b [N, K], out [M, N]",
            "fp8_dtype": "float8_e4m3fn x float8_e4m3fn",
            "out_dtype": "bfloat16",
            "fp8jax_accumulate": "fast",
            "xla_fp8_path": "flax.linen.fp8_ops.quantized_dot + out_dq (Fp8DirectDotGeneralOp)",
            "iters": args.iters,
            "inner": args.inner,
            "warmup": args.warmup,
        },
        "target": {
            "what": f"fp8jax_over_bf16 >= {TARGET_SPEEDUP} at {'x'.join(map(str, TARGET_SHAPE))}",
            "value": target["fp8jax_over_bf16"] if target else None,
            "met": None if target is None else target["fp8jax_over_bf16"] >= TARGET_SPEEDUP,
        },
        "checks": checks,
        "results": results,
        "raw_timings_s": raw,
    }


def print_table(report: dict[str, Any]) -> None:
    env = report["env"]
    print(f"{env['device']} ({env['platform']}), driver {env['driver']}, jax {env['jax']}")
    print(
        f"{'M x N x K':<22}{'bf16 TF/s':>11}{'fp8jax TF/s':>13}{'xla_fp8 TF/s':>14}"
        f"{'fp8jax/bf16':>13}{'fp8jax/xla':>12}"
    )
    for r in report["results"]:
        print(
            f"{r['shape']:<22}{r['bf16_tflops']:>11.1f}{r['fp8jax_tflops']:>13.1f}"
            f"{r['xla_fp8_tflops']:>14.1f}{r['fp8jax_over_bf16']:>13.2f}"
            f"{r['fp8jax_over_xla_fp8']:>12.2f}"
        )
    t = report["target"]
    verdict = {True: "met", False: "NOT met", None: "not measured"}[t["met"]]
    print(f"target {t['what']}: {t['value']} -> {verdict}")
    print("checks:", ", ".join(f"{k}={v}" for k, v in report["checks"].items()))


def _shape(text: str) -> tuple[int, int, int]:
    parts = text.lower().split("x")
    if len(parts) != 3 or not all(p.isdigit() and int(p) > 0 for p in parts):
        raise argparse.ArgumentTypeError(f"shape must be MxNxK with positive ints, got {text!r}")
    m, n, k = (int(p) for p in parts)
    return m, n, k


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--shapes", type=_shape, nargs="+", help="MxNxK shapes (default: the list in the doc)"
    )
    add_timing_args(p, iters=20, inner=5, what="calls")
    args = p.parse_args(argv)
    check_timing_args(p, args)

    on_gpu = jax.default_backend() in ("gpu", "cuda")
    if not on_gpu and not args.allow_cpu:
        msg = f"no CUDA device, skipped (JAX backend is {jax.default_backend()!r}; --allow-cpu)"
        print(f"gemm: {msg}")
        report: dict[str, Any] = {"benchmark": "gemm", "skipped": True, "reason": msg}
    else:
        if args.shapes is None:
            args.shapes = GPU_SHAPES if on_gpu else CPU_SHAPES
        report = {"benchmark": "gemm", "skipped": False, "env": environment()}
        report.update(benchmark(args, on_gpu))
        print_table(report)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
