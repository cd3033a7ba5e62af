"""LayerNorm / RMSNorm with the fused FP8 cast against XLA's norm-then-cast and a device copy.

The norms are memory-bound, so each op is reported as GB/s of the *minimum* traffic it needs
and as a ratio of a plain device copy's GB/s, all in one run on the same bf16 ``x [m, h]``
(16384 x 4096 by default; a small shape on CPU):

  copy                 jax.device_put(x, may_alias=False) (2 B read + 2 B written per element)
  fp8jax_norm_fp8      norm_forward_fp8, kernel: q and q_t (2 B read + 1 B + 1 B written)
  xla_norm_fp8         the same op as XLA's compilation of its reference (norm, then cast and
                       transpose; XLA fuses what it can)
  fp8jax_norm          norm_forward, kernel (2 B + 2 B)
  xla_norm             norm_forward, XLA (2 B + 2 B)
  fp8jax_backward      norm_backward, kernel (dy, x read, dx written: 2 + 2 + 2 B)
  xla_backward         norm_backward, XLA

Checks before timing: the kernel's ``q`` is bit-identical to ``quantize(norm_forward(x))`` of
the kernel (the op's contract), and the kernel's ``y`` is within bf16 rounding of XLA's.
Without a CUDA device it writes ``{"skipped": true}`` and exits 0, unless ``--allow-cpu``.

  python benchmarks/norm.py --json out/norm.json [--norm-type rmsnorm] [--rows M --hidden H]
"""

from __future__ import annotations

import argparse
import statistics
import sys
from collections.abc import Callable
from typing import Any

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

from fp8jax import ops

E4M3 = jnp.float8_e4m3fn
GPU_SHAPE = (16384, 4096)
CPU_SHAPE = (512, 1024)


def device_copy(x: jax.Array) -> Callable[[], jax.Array]:
    dev = next(iter(x.devices()))
    try:
        jax.block_until_ready(jax.device_put(x, dev, may_alias=False))
        return lambda: jax.device_put(x, dev, may_alias=False)
    except TypeError:  # a jax without may_alias
        return lambda: x.copy()


def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    m, h = args.rows, args.hidden
    layer = args.norm_type == "layernorm"
    key = jax.random.key(0)
    x = jax.block_until_ready((jax.random.normal(key, (m, h)) * 3 + 0.5).astype(jnp.bfloat16))
    dy = jax.block_until_ready(jax.random.normal(jax.random.fold_in(key, 1), (m, h), jnp.bfloat16))
    g = 1 + 0.1 * jax.random.normal(jax.random.fold_in(key, 2), (h,))
    b = 0.1 * jax.random.normal(jax.random.fold_in(key, 3), (h,)) if layer else None
    scale = jnp.float32(40.0)
    kw = dict(norm_type=args.norm_type, epsilon=1e-5)

    def fwd(impl):
        return jax.jit(lambda x, g, b: ops.norm_forward(x, g, b, implementation=impl, **kw))

    def fwd8(impl):
        return jax.jit(
            lambda x, g, b, s: ops.norm_forward_fp8(x, g, b, s, E4M3, implementation=impl, **kw)
        )

    def bwd(impl):
        return jax.jit(
            lambda dy, x, mu, rs, g: ops.norm_backward(
                dy, x, mu, rs, g, norm_type=args.norm_type, implementation=impl
            )
        )

    f_k, f_x = fwd("kernel"), fwd("xla")
    f8_k, f8_x = fwd8("kernel"), fwd8("xla")
    b_k, b_x = bwd("kernel"), bwd("xla")
    y, mu, rs = f_k(x, g, b)
    q, q_t = f8_k(x, g, b, scale)[:2]
    wq = ops.quantize(y, scale, E4M3, implementation="kernel")[0]
    same_q = bool(jnp.array_equal(q.view(jnp.uint8), wq.view(jnp.uint8)))
    same_qt = bool(jnp.array_equal(q_t.view(jnp.uint8), wq.T.view(jnp.uint8)))
    yx = np.asarray(f_x(x, g, b)[0], np.float32)
    y_close = bool(np.allclose(np.asarray(y, np.float32), yx, rtol=2**-7, atol=1e-3))
    del q, q_t, wq, yx

    n = m * h
    cases: list[tuple[str, Callable[[], Any], int]] = [
        ("copy", device_copy(x), 4),
        ("fp8jax_norm_fp8", lambda: f8_k(x, g, b, scale), 4),
        ("xla_norm_fp8", lambda: f8_x(x, g, b, scale), 4),
        ("fp8jax_norm", lambda: f_k(x, g, b), 4),
        ("xla_norm", lambda: f_x(x, g, b), 4),
        ("fp8jax_backward", lambda: b_k(dy, x, mu, rs, g), 6),
        ("xla_backward", lambda: b_x(dy, x, mu, rs, g), 6),
    ]
    raw: dict[str, list[float]] = {}
    results = []
    for name, fn, bpe in cases:
        times = time_op(fn, iters=args.iters, inner=args.inner, warmup=args.warmup)
        raw[name] = times
        med = statistics.median(times)
        results.append(
            {
                "name": name,
                "median_us": med * 1e6,
                "min_us": min(times) * 1e6,
                "min_bytes": n * bpe,
                "gb_per_s": n * bpe / med / 1e9,
            }
        )
    copy = results[0]["gb_per_s"]
    for r in results:
        r["ratio_to_copy"] = r["gb_per_s"] / copy
    return {
        "config": {
            "rows": m,
            "hidden": h,
            "norm_type": args.norm_type,
            "dtype": "bfloat16",
            "fp8_dtype": "float8_e4m3fn",
            "iters": args.iters,
            "inner": args.inner,
            "warmup": args.warmup,
        },
        "checks": {
            "q_is_quantize_of_norm_forward": same_q,
            "q_t_is_transpose": same_qt,
            "y_close_to_xla": y_close,
        },
        "results": results,
        "raw_timings_s": raw,
    }


def print_table(report: dict[str, Any]) -> None:
    env, cfg = report["env"], report["config"]
    print(f"{env['device']} ({env['platform']}), driver {env['driver']}, jax {env['jax']}")
    print(f"{cfg['norm_type']} of bf16 [{cfg['rows']}, {cfg['hidden']}]")
    print(f"{'op':<20}{'median us':>12}{'GB/s':>10}{'vs copy':>10}")
    for r in report["results"]:
        print(
            f"{r['name']:<20}{r['median_us']:>12.1f}{r['gb_per_s']:>10.1f}"
            f"{r['ratio_to_copy']:>10.2f}"
        )
    print("checks:", ", ".join(f"{k}={v}" for k, v in report["checks"].items()))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, help=f"default {GPU_SHAPE[0]} ({CPU_SHAPE[0]} on CPU)")
    p.add_argument("--hidden", type=int, help=f"default {GPU_SHAPE[1]} ({CPU_SHAPE[1]} on CPU)")
    p.add_argument("--norm-type", choices=("layernorm", "rmsnorm"), default="layernorm")
    add_timing_args(p, iters=30, inner=10, what="calls")
    args = p.parse_args(argv)
    check_timing_args(p, args)

    gpu = on_gpu()
    if not gpu and not args.allow_cpu:
        report: dict[str, Any] = skipped_report("norm")
    else:
        default = GPU_SHAPE if gpu else CPU_SHAPE
        args.rows = args.rows or default[0]
        args.hidden = args.hidden or default[1]
        if args.rows < 1 or args.hidden < 1:
            p.error("--rows and --hidden must be >= 1")
        report = {"benchmark": "norm", "skipped": False, "env": environment()}
        report.update(benchmark(args))
        print_table(report)
        if not all(report["checks"].values()):
            write_json(args.json, report)
            return 1
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
