"""Ragged grouped GEMM throughput: fp8jax.ops.grouped_gemm (its tensor-core and CUDA-core paths)
against jax.lax.ragged_dot, a loop of dense GEMMs and one dense FP8 GEMM of the same FLOPs, with
uneven and empty groups, in one run.

Every method computes a mixture of experts' forward GEMM: ``out[T, N]``, row ``t`` of group
``g`` being ``x[t] . w[g]``, with ``T`` rows sorted by group and ``group_sizes`` on the device:

  fp8jax_tc    fp8jax.ops.grouped_gemm on E4M3 operands (per-group scales), bf16 result, under
               gemm_options(grouped_tensor_cores=True): CUTLASS's Hopper grouped GEMM where it
               runs (an sm_90 GPU, a CUTLASS build; the report's ``tensor_core_path``)
  fp8jax       the same on fp8jax's own kernel (the CUDA cores; on CPU its CPU kernel)
  ragged_dot   jax.lax.ragged_dot of the bf16 operands, bf16 result
  dense_loop   one lax.dot of each group's rows (static slices from host-side sizes: what a
               user without a ragged GEMM writes; it recompiles whenever the sizes change)
  dense_fp8    one fp8jax.ops.gemm of [T, K] x [N, K] E4M3 codes: the dense FP8 GEMM of the same
               FLOPs, the grouped GEMM's ceiling

Group sizes: ``even`` (T / G each), ``uneven`` (a skewed split, one group empty) and
``one-hot`` (every row in one group, the others empty). TFLOP/s count the useful FLOPs
(``2 T N K``), not the masked ones XLA's CPU ``ragged_dot`` spends. ``tc_error``: the
tensor-core result against the CUDA-core kernel's (exact float32 sums), as the largest
difference over the largest magnitude (docs/design.md states the tolerance).

  python benchmarks/grouped_gemm.py --allow-cpu --json out/grouped_gemm.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
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
from jax import lax

import fp8jax
from fp8jax.ops.gemms._grouped_tensor_cores import tensor_cores
from fp8jax.ops.gemms.grouped_gemm import has_cuda_kernel

E4M3 = jnp.float8_e4m3fn
# (T, K, N, G): tokens x top-k rows, hidden, expert width, experts
GPU_SHAPES = [(16384, 4096, 2048, 8), (32768, 7168, 2048, 32)]
CPU_SHAPES = [(512, 128, 128, 8)]
METHODS = ("fp8jax_tc", "fp8jax", "ragged_dot", "dense_loop", "dense_fp8")


def split(t: int, g: int, kind: str) -> list[int]:
    """Group sizes summing to ``t``: ``even``, ``uneven`` (skewed, one empty) or ``one-hot``."""
    if kind == "even":
        return [t // g + (i < t % g) for i in range(g)]
    if kind == "one-hot":
        return [t if i == g // 2 else 0 for i in range(g)]
    weights = np.array([0 if i == 1 else 2.0 ** -(i % 4) for i in range(g)])
    sizes = np.floor(weights / weights.sum() * t).astype(int)
    sizes[0] += t - sizes.sum()
    return [int(s) for s in sizes]


def methods(x, w, sizes: list[int]) -> dict[str, Any]:
    """The methods on ``x [T, K]`` and ``w [G, K, N]`` (bf16), jitted."""
    g = w.shape[0]
    gs = jnp.asarray(sizes, jnp.int32)
    xq, wq_t = x.astype(E4M3), jnp.swapaxes(w, 1, 2).astype(E4M3)  # w_t [G, N, K]: "NT"
    one = jnp.ones((g,), jnp.float32)
    fp8 = jax.jit(lambda a, b, s: fp8jax.ops.grouped_gemm(a, b, s, one, one))
    with fp8jax.ops.gemm_options(grouped_tensor_cores=True):  # chosen while tracing
        tc = jax.jit(lambda a, b, s: fp8jax.ops.grouped_gemm(a, b, s, one, one))
        tc.lower(xq, wq_t, gs)
    ragged = jax.jit(lambda a, b, s: lax.ragged_dot(a, b, s))
    dense_b = wq_t.reshape(-1, wq_t.shape[2])[: wq_t.shape[1]]  # [N, K]: the same FLOPs
    dense = jax.jit(lambda a, b: fp8jax.ops.gemm(a, b, one[0], one[0]))
    bounds = np.concatenate([[0], np.cumsum(sizes)])

    @jax.jit
    def loop(a, b):
        parts = [a[bounds[i] : bounds[i + 1]] @ b[i] for i in range(g) if sizes[i]]
        return jnp.concatenate(parts, axis=0)

    return {
        "fp8jax_tc": lambda: tc(xq, wq_t, gs),
        "fp8jax": lambda: fp8(xq, wq_t, gs),
        "ragged_dot": lambda: ragged(x, w, gs),
        "dense_loop": lambda: loop(x, w),
        "dense_fp8": lambda: dense(xq, dense_b),
    }


def _probe(shape):
    t, k, n, g = shape
    return jax.ShapeDtypeStruct((t, k), jnp.bfloat16), jax.ShapeDtypeStruct((g, k, n), jnp.bfloat16)


def tensor_core_path(x, w) -> bool:
    """Whether ``fp8jax_tc`` runs on the tensor cores here."""
    config = ("rows", None, None, jnp.dtype(jnp.bfloat16))
    a = jax.ShapeDtypeStruct(x.shape, E4M3)
    b = jax.ShapeDtypeStruct((w.shape[0], w.shape[2], w.shape[1]), E4M3)
    with fp8jax.ops.gemm_options(grouped_tensor_cores=True):
        sa = jax.ShapeDtypeStruct((w.shape[0],), jnp.float32)
        return on_gpu() and tensor_cores(config, a, b, sa, "fast")


def measure(shape, kind: str, args) -> dict[str, Any]:
    t, k, n, g = shape
    sizes = split(t, g, kind)
    r = np.random.default_rng(0)
    x = jnp.asarray(r.standard_normal((t, k)), jnp.bfloat16)
    w = jnp.asarray(r.standard_normal((g, k, n)) / np.sqrt(k), jnp.bfloat16)
    fns = methods(x, w, sizes)
    want = np.asarray(fns["ragged_dot"](), np.float32)
    got = np.asarray(fns["fp8jax"](), np.float32)
    tc = np.asarray(fns["fp8jax_tc"](), np.float32)
    rel = float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))
    flops = 2 * t * k * n
    row: dict[str, Any] = {"shape": dict(T=t, K=k, N=n, G=g), "groups": kind, "sizes": sizes}
    row["fp8_vs_bf16_rel_error"] = rel
    row["tc_error"] = float(np.abs(tc - got).max() / max(np.abs(got).max(), 1e-30))
    for name in METHODS:
        times = time_op(fns[name], iters=args.iters, inner=args.inner, warmup=args.warmup)
        sec = statistics.median(times)
        row[name] = {"median_s": sec, "tflops": flops / sec / 1e12}
    base = row["ragged_dot"]["median_s"]
    row["speedup_vs_ragged_dot"] = base / row["fp8jax"]["median_s"]
    row["speedup_vs_dense_loop"] = row["dense_loop"]["median_s"] / row["fp8jax"]["median_s"]
    row["tc_vs_ragged_dot"] = base / row["fp8jax_tc"]["median_s"]
    row["tc_speedup_vs_cuda_cores"] = row["fp8jax"]["median_s"] / row["fp8jax_tc"]["median_s"]
    row["tc_vs_dense_fp8_tflops"] = row["fp8jax_tc"]["tflops"] / row["dense_fp8"]["tflops"]
    print(
        f"T={t} K={k} N={n} G={g} {kind:8s} "
        + " ".join(f"{m}={row[m]['median_s'] * 1e3:.3f}ms" for m in METHODS)
        + f" fp8jax/ragged_dot x{row['speedup_vs_ragged_dot']:.2f} rel.err {rel:.3g}"
    )
    return row


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_timing_args(p, iters=5, inner=5)
    args = p.parse_args(argv)
    check_timing_args(p, args)
    if not on_gpu() and not args.allow_cpu:
        report = skipped_report("grouped_gemm")
        write_json(args.json, report)
        return report
    shapes = GPU_SHAPES if on_gpu() else CPU_SHAPES
    rows = [measure(s, kind, args) for s in shapes for kind in ("even", "uneven", "one-hot")]
    report = {
        "benchmark": "grouped_gemm",
        "environment": environment(),
        "fp8jax_path": ("CUDA kernel" if has_cuda_kernel() else "XLA reference")
        if on_gpu()
        else "CPU kernel",
        "tensor_core_path": tensor_core_path(*_probe(shapes[0])),
        "results": rows,
    }
    write_json(args.json, report)
    return report


if __name__ == "__main__":
    main(sys.argv[1:])
