"""fp8jax's CPU kernels against XLA:CPU's compilation of their own jnp references, in one run.

Every fp8jax op has a pure-jnp reference (``*_reference`` in ``fp8jax/ops``) that defines its
numerics bit for bit. On a machine without a GPU the choice is between the FFI kernel and
``jax.jit`` of that reference, so the reference is the yardstick: each case below times both, on
the same inputs, interleaved (kernel, reference, kernel, ...) so that a change in the machine's
load hits both alike, and reports the ratio of the medians, kernel / XLA (below 1: the kernel is
faster). The outputs of the two are compared bit for bit before timing.

  quantize         q, scale_inv, amax of x (f32 or bf16) with E4M3 or E5M2
  dequantize       float(q) * scale_inv rounded to f32 or bf16
  cast_transpose   q and its transpose (last two dims), scale_inv, amax
  cast_transpose_dbias  cast_transpose of a 2-D g plus its float32 column sums (dbias); the
                   kernel's fixed summation order differs from XLA's, so dbias is compared
                   within the float32 bound of a sum, the other outputs bit for bit
  update_fp8_states  the delayed-scaling update of n [n, L] histories ("max")
  layernorm, rmsnorm, layernorm_fp8, layernorm_bwd   the norms (fp8jax/ops/fused/norm.py) on
                   bf16/f32 [m, h]: forward, forward fused with the E4M3 cast and transpose,
                   backward. These match their references within the tolerance of a different
                   summation order (tests/ops/test_norm.py), not bit for bit: they are checked
                   with that tolerance ("close") instead.

The default is a quick run on small shapes (seconds; what CI runs); ``--full`` times the whole
table, bf16[2048, 2048] and odd shapes included. On a shared machine run it at a quiet moment and
repeat: the JSON records the load average before and after.

  python benchmarks/cpu_kernels.py --full --json out/cpu_kernels.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from _common import add_timing_args, check_timing_args, environment, write_json

import fp8jax
from fp8jax.ops.casts.cast_transpose import cast_transpose_dbias_reference, cast_transpose_reference
from fp8jax.ops.casts.quantize import dequantize_reference, quantize_reference
from fp8jax.ops.casts.scaling import update_fp8_states_reference
from fp8jax.ops.fused.norm import (
    norm_backward_reference,
    norm_forward_fp8_reference,
    norm_forward_reference,
)
from fp8jax.recipe import DelayedScaling

FP8 = {"e4m3": jnp.float8_e4m3fn, "e5m2": jnp.float8_e5m2}
WIDE = {"f32": jnp.float32, "bf16": jnp.bfloat16}

# (shape) per op; the quick set keeps CI in seconds, the full set is the table of the docs.
QUICK_SHAPES = [(256, 256), (67, 129)]
FULL_SHAPES = [(512, 512), (2048, 2048), (1023, 2049), (4, 3, 127, 65)]
QUICK_NORMS = [(256, 1024)]
FULL_NORMS = [(2048, 4096), (8192, 1024), (1023, 4097)]
QUICK_HISTORIES = [(64, 16)]
FULL_HISTORIES = [(64, 16), (256, 1024), (4096, 16)]


def _input(shape: tuple[int, ...], dtype: Any, seed: int) -> jax.Array:
    x = jax.random.normal(jax.random.key(seed), shape, jnp.float32) * 4.0
    return jax.block_until_ready(x.astype(dtype))


def _same_bits(a: Any, b: Any) -> bool:
    la, lb = jax.tree.leaves(a), jax.tree.leaves(b)
    if len(la) != len(lb):
        return False
    for u, v in zip(la, lb, strict=True):
        u, v = np.asarray(u), np.asarray(v)
        if u.shape != v.shape or u.dtype != v.dtype:
            return False
        if u.tobytes() != v.tobytes():
            return False
    return True


def _same_but_dbias(a: Any, b: Any) -> bool:
    """cast_transpose_dbias: all but dbias bit for bit; dbias within the float32 error bound of
    a sum of m terms (the kernel and XLA add in different orders)."""
    if not _same_bits(a[:4], b[:4]):
        return False
    da, db = np.asarray(a[4], np.float64), np.asarray(b[4], np.float64)
    m = a[0].shape[0]
    return bool(np.all(np.abs(da - db) <= 2 * m * np.finfo(np.float32).eps * (np.abs(db) + 1)))


def _cases(full: bool) -> list[dict[str, Any]]:
    """(name, description, kernel thunk, reference thunk) for every case of the table."""
    shapes = FULL_SHAPES if full else QUICK_SHAPES
    fp8s = ("e4m3", "e5m2") if full else ("e4m3",)
    cases = []
    for shape in shapes:
        for wide in ("f32", "bf16"):
            x = _input(shape, WIDE[wide], seed=len(cases))
            amax = float(jnp.max(jnp.abs(x.astype(jnp.float32))))
            for f in fp8s:
                dt = FP8[f]
                scale = jnp.full((1,), float(fp8jax.recipe.fp8_max(dt)) / amax, jnp.float32)
                q, s_inv, _ = quantize_reference(x, scale, dt)
                ops: list[tuple[str, Callable, Callable, tuple]] = [
                    (
                        "quantize",
                        jax.jit(lambda v, s, dt=dt: fp8jax.ops.quantize(v, s, dt)),
                        jax.jit(lambda v, s, dt=dt: quantize_reference(v, s, dt)),
                        (x, scale),
                    ),
                    (
                        "dequantize",
                        jax.jit(lambda v, s, w=WIDE[wide]: fp8jax.ops.dequantize(v, s, w)),
                        jax.jit(lambda v, s, w=WIDE[wide]: dequantize_reference(v, s, w)),
                        (q, s_inv),
                    ),
                ]
                if len(shape) >= 2:
                    ops.append(
                        (
                            "cast_transpose",
                            jax.jit(lambda v, s, dt=dt: fp8jax.ops.cast_transpose(v, s, dt)),
                            jax.jit(lambda v, s, dt=dt: cast_transpose_reference(v, s, dt)),
                            (x, scale),
                        )
                    )
                if len(shape) == 2:
                    ops.append(
                        (
                            "cast_transpose_dbias",
                            jax.jit(lambda v, s, dt=dt: fp8jax.ops.cast_transpose_dbias(v, s, dt)),
                            jax.jit(lambda v, s, dt=dt: cast_transpose_dbias_reference(v, s, dt)),
                            (x, scale),
                        )
                    )
                for op, kern, ref, args in ops:
                    cases.append(
                        {
                            "op": op,
                            "same": _same_but_dbias if op == "cast_transpose_dbias" else _same_bits,
                            "wide": wide,
                            "fp8": f,
                            "shape": list(shape),
                            "kernel": (lambda k=kern, a=args: k(*a)),
                            "reference": (lambda r=ref, a=args: r(*a)),
                        }
                    )
    for shape in FULL_NORMS if full else QUICK_NORMS:
        for wide in ("f32", "bf16"):
            cases.extend(_norm_cases(shape, wide, seed=len(cases)))
    for n, length in FULL_HISTORIES if full else QUICK_HISTORIES:
        recipe = DelayedScaling(amax_history_len=length, amax_compute_algo="max")
        key = jax.random.key(n + length)
        hist = jnp.abs(jax.random.normal(key, (n, length), jnp.float32)) * 10.0
        scales = jnp.ones((n,), jnp.float32)
        amaxes = jnp.abs(jax.random.normal(jax.random.fold_in(key, 1), (n,), jnp.float32))
        fp8_maxes = jnp.full((n,), recipe.fp8_max(backward=False), jnp.float32)
        kern = jax.jit(lambda h, s, a, r=recipe: fp8jax.ops.update_fp8_states(h, s, a, r))
        ref = jax.jit(lambda h, s, a, m, r=recipe: update_fp8_states_reference(h, s, a, m, r))
        cases.append(
            {
                "op": "update_fp8_states",
                "wide": "f32",
                "fp8": "-",
                "shape": [n, length],
                "kernel": (lambda k=kern, a=(hist, scales, amaxes): k(*a)),
                "reference": (lambda r=ref, a=(hist, scales, amaxes, fp8_maxes): r(*a)),
            }
        )
    return cases


def _close(a: Any, b: Any) -> bool:
    """Equal within the norms' tolerance: one output-dtype ulp, or 64 float32 ulps of the
    largest magnitude (FP8 codes: at most one code step apart)."""
    for u, v in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True):
        u, v = np.asarray(u), np.asarray(v)
        if u.shape != v.shape or u.dtype != v.dtype:
            return False
        if u.dtype.itemsize == 1:  # FP8 codes
            if np.abs(u.view(np.int8).astype(int) - v.view(np.int8).astype(int)).max() > 1:
                return False
            continue
        u, v = u.astype(np.float32), v.astype(np.float32)
        rtol = float(jnp.finfo(a.dtype if hasattr(a, "dtype") else u.dtype).eps)
        atol = 64 * float(np.finfo(np.float32).eps) * max(1.0, float(np.abs(v).max(initial=0)))
        if not np.allclose(u, v, rtol=max(rtol, 2**-7), atol=atol):
            return False
    return True


def _norm_cases(shape: tuple[int, int], wide: str, seed: int) -> list[dict[str, Any]]:
    m, h = shape
    key = jax.random.key(seed)
    x = jax.block_until_ready((jax.random.normal(key, shape) * 3 + 0.5).astype(WIDE[wide]))
    dy = jax.block_until_ready(jax.random.normal(jax.random.fold_in(key, 1), shape, WIDE[wide]))
    g = 1 + 0.1 * jax.random.normal(jax.random.fold_in(key, 2), (h,))
    b = 0.1 * jax.random.normal(jax.random.fold_in(key, 3), (h,))
    scale = jnp.float32(40.0)
    e4 = FP8["e4m3"]
    ln = dict(norm_type="layernorm", epsilon=1e-5)
    rms = dict(norm_type="rmsnorm", epsilon=1e-5)
    _, mu, rs = norm_forward_reference(x, g, b, **ln)
    ops: list[tuple[str, str, Callable, Callable, tuple]] = [
        (
            "layernorm",
            "-",
            jax.jit(lambda x, g, b: fp8jax.ops.norm_forward(x, g, b, **ln)),
            jax.jit(lambda x, g, b: norm_forward_reference(x, g, b, **ln)),
            (x, g, b),
        ),
        (
            "rmsnorm",
            "-",
            jax.jit(lambda x, g: fp8jax.ops.norm_forward(x, g, None, **rms)),
            jax.jit(lambda x, g: norm_forward_reference(x, g, None, **rms)),
            (x, g),
        ),
        (
            "layernorm_fp8",
            "e4m3",
            jax.jit(lambda x, g, b, s: fp8jax.ops.norm_forward_fp8(x, g, b, s, e4, **ln)),
            jax.jit(lambda x, g, b, s: norm_forward_fp8_reference(x, g, b, s, e4, **ln)),
            (x, g, b, scale),
        ),
        (
            "layernorm_bwd",
            "-",
            jax.jit(
                lambda *a: fp8jax.ops.norm_backward(*a, norm_type="layernorm")  # type: ignore
            ),
            jax.jit(lambda *a: norm_backward_reference(*a, norm_type="layernorm")),
            (dy, x, mu, rs, g),
        ),
    ]
    return [
        {
            "op": op,
            "wide": wide,
            "fp8": f,
            "shape": [m, h],
            "compare": "close",
            "kernel": (lambda k=kern, a=args: k(*a)),
            "reference": (lambda r=ref, a=args: r(*a)),
        }
        for op, f, kern, ref, args in ops
    ]


def _time(fn: Callable[[], Any], inner: int) -> float:
    """Seconds per call, each call waited for: XLA:CPU may run independent dispatches at once,
    so waiting only for the last would let calls overlap (and compete for the cores)."""
    t0 = time.perf_counter()
    for _ in range(inner):
        jax.block_until_ready(fn())
    return (time.perf_counter() - t0) / inner


def benchmark(args: argparse.Namespace) -> dict[str, Any]:
    load_before = os.getloadavg()
    results = []
    for case in _cases(args.full):
        kern, ref, same = case.pop("kernel"), case.pop("reference"), case.pop("same", _same_bits)
        if case.pop("compare", "bits") == "close":
            case["bit_identical"] = False
            case["within_tolerance"] = _close(kern(), ref())
        else:
            case["bit_identical"] = same(kern(), ref())
        for _ in range(args.warmup):
            jax.block_until_ready(kern())
            jax.block_until_ready(ref())
        tk, tr = [], []
        for _ in range(args.iters):  # interleaved, so that load changes hit both
            tk.append(_time(kern, args.inner))
            tr.append(_time(ref, args.inner))
        mk, mr = statistics.median(tk), statistics.median(tr)
        case.update(
            kernel_ms=mk * 1e3,
            xla_ms=mr * 1e3,
            ratio=mk / mr,
            raw_kernel_s=tk,
            raw_xla_s=tr,
        )
        results.append(case)
    return {
        "config": {
            "full": args.full,
            "iters": args.iters,
            "inner": args.inner,
            "warmup": args.warmup,
            "cpu_count": os.cpu_count(),
            "xla_flags": os.environ.get("XLA_FLAGS", ""),
            "loadavg_before": list(load_before),
            "loadavg_after": list(os.getloadavg()),
        },
        "results": results,
    }


def _ok(r: dict[str, Any]) -> bool:
    return bool(r["bit_identical"] or r.get("within_tolerance", False))


def print_table(report: dict[str, Any]) -> None:
    env, cfg = report["env"], report["config"]
    print(f"{env['device']} ({env['platform']}), jax {env['jax']}, {cfg['cpu_count']} CPUs")
    before = " ".join(f"{v:.2f}" for v in cfg["loadavg_before"])
    after = " ".join(f"{v:.2f}" for v in cfg["loadavg_after"])
    print(f"load average before {before}, after {after}")
    print(f"{'op':<22}{'in':<5}{'fp8':<6}{'shape':<18}{'kernel ms':>10}{'XLA ms':>10}{'ratio':>7}")
    for r in report["results"]:
        shape = "x".join(str(d) for d in r["shape"])
        flag = "" if _ok(r) else "  NOT BIT-IDENTICAL"
        if "within_tolerance" in r:
            flag = "  (close)" if _ok(r) else "  NOT WITHIN TOLERANCE"
        print(
            f"{r['op']:<22}{r['wide']:<5}{r['fp8']:<6}{shape:<18}"
            f"{r['kernel_ms']:>10.3f}{r['xla_ms']:>10.3f}{r['ratio']:>7.2f}{flag}"
        )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--full", action="store_true", help="the whole table (default: a quick run)")
    add_timing_args(p, iters=5, inner=3, what="calls (each waited for)")
    args = p.parse_args(argv)
    check_timing_args(p, args)
    # On a GPU machine too, the CPU kernels are what is timed: everything runs on the host.
    with jax.default_device(jax.devices("cpu")[0]):
        report: dict[str, Any] = {"benchmark": "cpu_kernels", "skipped": False}
        report["env"] = environment()
        cpu = jax.devices("cpu")[0]
        report["env"].update(device=cpu.device_kind, platform=cpu.platform)
        report.update(benchmark(args))
    print_table(report)
    write_json(args.json, report)
    return 0 if all(_ok(r) for r in report["results"]) else 1


if __name__ == "__main__":
    sys.exit(main())
