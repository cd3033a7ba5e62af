"""Kernel vs XLA, per op: the same results (compared in one run) and the time of each.

For every op family, on the same inputs, the op runs jitted under
``fp8jax.ops.implementation("kernel")`` and under ``"xla"`` (XLA's compilation of its jnp
reference). Reported per op and shape: whether the outputs are bit-identical (required for the
casts; the GEMM may differ within its stated tolerance on a GPU, where cuBLASLt and XLA's dot sum
in other orders: the largest difference relative to the largest output is reported), and the
median time of each implementation with their ratio. The state update's histories must be
identical and its scales within ``SCALE_ULPS`` float32 ulps (``scale_ulps``): XLA compiles a
float32 division on a GPU to PTX ``div.full`` (within 2 ulps), the kernel divides correctly
rounded like the CPU reference (measured on an H200: identical histories, scales not identical).

Exits 1 when a cast or the state update differs beyond that, so ``tools/gpu_check.sh`` shows it.
Without a CUDA device it writes ``{"skipped": true}`` and exits 0, unless ``--allow-cpu`` (small
sizes).

  python benchmarks/implementations.py --json out/bench/implementations.json
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

import fp8jax
from fp8jax import ops

E4M3 = jnp.float8_e4m3fn
RECIPE = fp8jax.DelayedScaling(amax_history_len=1024)
SCALE_ULPS = 2


def _ulps(a: np.ndarray, b: np.ndarray) -> int:
    """The largest distance in float32 ulps between same-signed finite arrays ``a`` and ``b``."""
    ia = np.asarray(a, np.float32).view(np.int32).astype(np.int64)
    ib = np.asarray(b, np.float32).view(np.int32).astype(np.int64)
    return int(np.max(np.abs(ia - ib), initial=0))


def _cases(big: bool) -> list[tuple[str, str, Callable[..., Any], tuple[jax.Array, ...]]]:
    """(op, shape label, function, inputs) for every op family."""
    rng = np.random.default_rng(0)
    m = (8192, 8192) if big else (256, 384)
    x = jnp.asarray(rng.standard_normal(m) * 100, jnp.bfloat16)
    s = jnp.float32(0.5)
    q = ops.quantize(x, s, E4M3)[0]
    rows = 4096 if big else 64
    hist = jnp.asarray(rng.exponential(size=(rows, RECIPE.amax_history_len)), jnp.float32)
    amax = jnp.asarray(rng.exponential(size=rows), jnp.float32)
    label = "x".join(map(str, m))
    return [
        ("quantize", label, lambda x, s: ops.quantize(x, s, E4M3), (x, s)),
        ("dequantize", label, lambda q, s: ops.dequantize(q, s, jnp.bfloat16), (q, s)),
        ("cast_transpose", label, lambda x, s: ops.cast_transpose(x, s, E4M3), (x, s)),
        ("cast_transpose_dbias", label, lambda g, s: ops.cast_transpose_dbias(g, s, E4M3), (x, s)),
        (
            "update_fp8_states",
            f"{rows}x{RECIPE.amax_history_len}",
            lambda h, a: ops.update_fp8_states(h, jnp.ones_like(a), a, RECIPE),
            (hist, amax),
        ),
        ("gemm", f"{m[0]}x{m[0]}x{m[1]}", lambda a, b, s: ops.gemm(a, b, s, s), (q, q, s)),
    ]


def compare(args: Any) -> dict[str, Any]:
    rows, ok = [], True
    for op, shape, fn, inputs in _cases(on_gpu()):
        outs, times = {}, {}
        for impl in ("kernel", "xla"):
            with ops.implementation(impl):
                f = jax.jit(fn)
                outs[impl] = [np.asarray(o) for o in jax.tree.leaves(f(*inputs))]
                t = time_op(lambda f=f, xs=inputs: f(*xs), **vars(args))
            times[impl] = statistics.median(t) * 1e3
        # dbias (a float32 sum) is the one output whose order of operations the kernel and XLA
        # do not share; it is reported as max_rel_diff, everything else must be identical.
        exact = 4 if op == "cast_transpose_dbias" else None
        identical = all(
            k.tobytes() == x.tobytes()
            for k, x in zip(outs["kernel"][:exact], outs["xla"][:exact], strict=True)
        )
        last = -1 if op == "cast_transpose_dbias" else 0
        k, x = (np.asarray(o[last], np.float64) for o in (outs["kernel"], outs["xla"]))
        finite = np.isfinite(k) & np.isfinite(x)
        scale = max(float(np.max(np.abs(k[finite]), initial=0.0)), 1e-30)
        rel = float(np.max(np.abs(k - x)[finite], initial=0.0)) / scale
        ulps = None
        if op == "update_fp8_states":
            ulps = _ulps(outs["kernel"][1], outs["xla"][1])
            hist_same = outs["kernel"][0].tobytes() == outs["xla"][0].tobytes()
            ok = ok and hist_same and ulps <= SCALE_ULPS
        elif op != "gemm" and not identical:
            ok = False
        rows.append(
            {
                "op": op,
                "shape": shape,
                "bit_identical": identical,
                "max_rel_diff": rel,
                "scale_ulps": ulps,
                "kernel_ms": times["kernel"],
                "xla_ms": times["xla"],
                "xla_over_kernel": times["xla"] / times["kernel"],
            }
        )
        print(
            f"{op:18s} {shape:16s} identical={identical!s:5s} rel={rel:.2e} "
            f"kernel {times['kernel']:.3f} ms  xla {times['xla']:.3f} ms"
        )
    return {
        "benchmark": "implementations",
        "environment": environment(),
        "checks": {"casts_identical_and_update_within_ulps": ok},
        "results": rows,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_timing_args(p, iters=10, inner=5)
    args = p.parse_args(argv)
    check_timing_args(p, args)
    if not on_gpu() and not args.allow_cpu:
        write_json(args.json, skipped_report("implementations"))
        return 0
    timing = argparse.Namespace(iters=args.iters, inner=args.inner, warmup=args.warmup)
    report = compare(timing)
    write_json(args.json, report)
    return 0 if report["checks"]["casts_identical_and_update_within_ulps"] else 1


if __name__ == "__main__":
    sys.exit(main())
