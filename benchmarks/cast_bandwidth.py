"""Memory bandwidth of fp8jax's FP8 casts against a device copy and XLA's own cast, in one run.

Casting is memory-bound, so the honest yardstick is the copy: every op below is timed on the
same bf16 tensor (64M elements by default) in the same process, and reported as GB/s and as a
ratio of the copy's GB/s.

  copy            jax.device_put(x, may_alias=False): a pure device-to-device copy (2 B + 2 B)
  xla_scale_bf16  jit(x * 1.0001 in f32, back to bf16): one fused XLA elementwise pass (2 B + 2 B)
  fp8jax_quantize fp8jax.ops.quantize(x, scale, e4m3): q and amax (2 B read + 1 B written)
  fp8jax_cast_transpose  fp8jax.ops.cast_transpose on x as (8192, 8192): q and q.T (2 B + 2 B)
  xla_cast        jit((x * scale).clip(-448, 448).astype(e4m3)) (2 B + 1 B)
  xla_cast_amax   the same plus max(|x|), what quantize returns (2 B + 1 B)

Each measurement runs the op ``--inner`` times back to back (async dispatch keeps the GPU busy),
waits with ``block_until_ready``, and records the time per call; the median of ``--iters`` such
measurements is reported. Without a CUDA device it writes ``{"skipped": true}`` and exits 0,
unless ``--allow-cpu`` (a tiny size, to smoke-test the script).

  python benchmarks/cast_bandwidth.py --json out/cast_bandwidth.json
"""

from __future__ import annotations

import argparse
import math
import statistics
import sys
from collections.abc import Callable
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

import fp8jax

E4M3 = jnp.float8_e4m3fn
E4M3_MAX = 448.0
GPU_ELEMENTS = 64 * 2**20
CPU_ELEMENTS = 2**16


def matrix_shape(n: int) -> tuple[int, int]:
    """The most square (rows, cols) with power-of-two rows: (8192, 8192) for 64M elements."""
    rows = 1 << (math.isqrt(n).bit_length() - 1)
    while n % rows:
        rows //= 2
    return rows, n // rows


def device_copy(x: jax.Array) -> Callable[[], jax.Array]:
    dev = next(iter(x.devices()))
    try:
        jax.block_until_ready(jax.device_put(x, dev, may_alias=False))
        return lambda: jax.device_put(x, dev, may_alias=False)
    except TypeError:  # a jax without may_alias: an explicit copy
        return lambda: x.copy()


def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    n = args.elements
    rows, cols = matrix_shape(n)
    x32 = jax.random.normal(jax.random.key(0), (n,), jnp.float32) * 4.0
    x = jax.block_until_ready(x32.astype(jnp.bfloat16))
    del x32
    x2d = x.reshape(rows, cols)
    amax = float(jnp.max(jnp.abs(x).astype(jnp.float32)))
    scale = jnp.full((1,), E4M3_MAX / amax, jnp.float32)

    xla_scale = jax.jit(lambda v: (v.astype(jnp.float32) * 1.0001).astype(v.dtype))
    quantize = jax.jit(lambda v, s: fp8jax.ops.quantize(v, s, E4M3))
    cast_t = jax.jit(lambda v, s: fp8jax.ops.cast_transpose(v, s, E4M3))
    xla_cast = jax.jit(lambda v, s: (v * s[0]).clip(-E4M3_MAX, E4M3_MAX).astype(E4M3))
    xla_cast_amax = jax.jit(
        lambda v, s: (
            (v * s[0]).clip(-E4M3_MAX, E4M3_MAX).astype(E4M3),
            jnp.max(jnp.abs(v)).astype(jnp.float32),
        )
    )

    # Sanity before timing: the kernel must produce what XLA's cast produces, bit for bit.
    q = quantize(x, scale)[0]
    same = bool(jnp.array_equal(q.view(jnp.uint8), xla_cast(x, scale).view(jnp.uint8)))
    q2, qt, _, _ = cast_t(x2d, scale)
    same_t = bool(
        jnp.array_equal(q2.view(jnp.uint8), q.reshape(rows, cols).view(jnp.uint8))
        and jnp.array_equal(qt.view(jnp.uint8), q2.T.view(jnp.uint8))
    )
    del q, q2, qt

    # (name, callable, bytes per element moved)
    ops: list[tuple[str, Callable[[], Any], int]] = [
        ("copy", device_copy(x), 2 + 2),
        ("xla_scale_bf16", lambda: xla_scale(x), 2 + 2),
        ("fp8jax_quantize", lambda: quantize(x, scale), 2 + 1),
        ("fp8jax_cast_transpose", lambda: cast_t(x2d, scale), 2 + 2),
        ("xla_cast", lambda: xla_cast(x, scale), 2 + 1),
        ("xla_cast_amax", lambda: xla_cast_amax(x, scale), 2 + 1),
    ]
    raw: dict[str, list[float]] = {}
    results = []
    for name, fn, bpe in ops:
        times = time_op(fn, iters=args.iters, inner=args.inner, warmup=args.warmup)
        raw[name] = times
        med = statistics.median(times)
        results.append(
            {
                "name": name,
                "median_us": med * 1e6,
                "min_us": min(times) * 1e6,
                "bytes": n * bpe,
                "gb_per_s": n * bpe / med / 1e9,
            }
        )
    by_name = {r["name"]: r for r in results}
    for r in results:
        r["ratio_to_copy"] = r["gb_per_s"] / by_name["copy"]["gb_per_s"]
        r["ratio_to_xla_scale_bf16"] = r["gb_per_s"] / by_name["xla_scale_bf16"]["gb_per_s"]
    return {
        "config": {
            "elements": n,
            "matrix_shape": [rows, cols],
            "dtype": "bfloat16",
            "fp8_dtype": "float8_e4m3fn",
            "iters": args.iters,
            "inner": args.inner,
            "warmup": args.warmup,
        },
        "checks": {"quantize_equals_xla_cast": same, "cast_transpose_consistent": same_t},
        "results": results,
        "raw_timings_s": raw,
    }


def print_table(report: dict[str, Any]) -> None:
    env, cfg = report["env"], report["config"]
    print(f"{env['device']} ({env['platform']}), driver {env['driver']}, jax {env['jax']}")
    print(f"{cfg['elements']:,} bf16 elements, cast_transpose as {tuple(cfg['matrix_shape'])}")
    print(f"{'op':<24}{'median us':>12}{'GB/s':>10}{'vs copy':>10}{'vs xla x*c':>12}")
    for r in report["results"]:
        print(
            f"{r['name']:<24}{r['median_us']:>12.1f}{r['gb_per_s']:>10.1f}"
            f"{r['ratio_to_copy']:>10.2f}{r['ratio_to_xla_scale_bf16']:>12.2f}"
        )
    print("checks:", ", ".join(f"{k}={v}" for k, v in report["checks"].items()))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--elements", type=int, help=f"default {GPU_ELEMENTS} ({CPU_ELEMENTS} on CPU)")
    add_timing_args(p, iters=50, inner=10, what="calls")
    args = p.parse_args(argv)
    check_timing_args(p, args)

    gpu = on_gpu()
    if not gpu and not args.allow_cpu:
        report: dict[str, Any] = skipped_report("cast_bandwidth")
    else:
        if args.elements is None:
            args.elements = GPU_ELEMENTS if gpu else CPU_ELEMENTS
        if args.elements < 4:
            p.error("--elements must be >= 4")
        report = {"benchmark": "cast_bandwidth", "skipped": False, "env": environment()}
        report.update(benchmark(args))
        print_table(report)
    write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
