"""The cost model's calibration: the bandwidths fitted on the measured ops
(``cost_model.MEASURED``), each fit and its residuals.

    python benchmarks/calibration.py      # the calibration and its residuals
"""

from __future__ import annotations

import functools
import math
import statistics
from collections.abc import Callable
from typing import Any

from attention_rates import CUDNN_ATTENTION_TFLOPS
from cost_model import (
    F32_OVER_BF16,
    LAUNCH_S,
    LINK_BYTES_S,
    MEASURED,
    SMALL_BYTES,
    TF32_OVER_BF16,
    Bandwidths,
    Unit,
    gemm_fits,
    gemm_seconds,
    lowered_hlo,
    predict,
)


def op_programs() -> dict[tuple[str, str], str]:
    """The HLO of each measured op (``MEASURED["ops_ms"]``) on bf16[8192, 8192], as the
    benchmarks called it, under each implementation."""
    import jax
    import jax.numpy as jnp

    from fp8jax import ops

    e4m3, bf16 = jnp.float8_e4m3fn, jnp.bfloat16
    x = jax.ShapeDtypeStruct((8192, 8192), bf16)
    q = jax.ShapeDtypeStruct((8192, 8192), e4m3)
    s = jax.ShapeDtypeStruct((), jnp.float32)
    row = jax.ShapeDtypeStruct((8192,), jnp.float32)
    h = jax.ShapeDtypeStruct((8192,), jnp.float32)
    norm = dict(norm_type="layernorm", epsilon=1e-5)
    cases: dict[str, tuple[Callable[..., Any], tuple[Any, ...]]] = {
        "quantize": (lambda x, s: ops.quantize(x, s, e4m3), (x, s)),
        "dequantize": (lambda q, s: ops.dequantize(q, s, bf16), (q, s)),
        "cast_transpose": (lambda x, s: ops.cast_transpose(x, s, e4m3), (x, s)),
        "cast_transpose_dbias": (lambda g, s: ops.cast_transpose_dbias(g, s, e4m3), (x, s)),
        "norm_forward_fp8": (
            lambda x, g, b, s: ops.norm_forward_fp8(x, g, b, s, e4m3, **norm),
            (x, h, h, s),
        ),
        "norm_forward": (lambda x, g, b: ops.norm_forward(x, g, b, **norm), (x, h, h)),
        "norm_backward": (
            lambda dy, x, mu, rs, g: ops.norm_backward(dy, x, mu, rs, g, norm_type="layernorm"),
            (x, x, row, row, h),
        ),
    }
    out = {}
    for op, (fn, args) in cases.items():
        for impl in ("kernel", "xla"):
            with ops.implementation(impl):
                out[(op, impl)] = lowered_hlo(fn, *args)
    return out


@functools.cache
def bandwidths() -> Bandwidths:
    """The bandwidths fitted on ``MEASURED["ops_ms"]`` (see :func:`calibration`)."""
    return _fit(op_programs())[0]


def _launch_s(units: list[Unit]) -> float:
    """The launch time inside a prediction's total (small fusions share one launch)."""
    small = [u for u in units if u.kind.endswith("fusion") and u.bytes < SMALL_BYTES]
    return LAUNCH_S * (len(units) - len(small) + bool(small))


def _fit(programs: dict[tuple[str, str], str]) -> tuple[Bandwidths, dict[str, Any]]:
    """XLA's two fusion bandwidths from the references' times, then each kernel's from its own
    time less what its program runs besides it (at XLA's bandwidths) and the launches."""
    probe = Bandwidths(1.0, 1.0, ())  # only the units' bytes are used
    units = {key: predict(text, probe).units for key, text in programs.items()}

    def split(us: list[Unit]) -> tuple[int, int, int]:  # plain, transposing, fp8jax bytes
        return (sum(u.bytes for u in us if u.kind == "fusion"),
                sum(u.bytes for u in us if u.kind == "fusion:transpose"),
                sum(u.bytes for u in us if u.kind.startswith("fp8jax:")))  # fmt: skip

    def seconds(key: tuple[str, str]) -> float:  # the measured time less the launches
        return MEASURED["ops_ms"][key] * 1e-3 - _launch_s(units[key])

    xla_runs = [(split(us), seconds(k)) for k, us in units.items() if k[1] == "xla"]
    xla = statistics.median(pb / t for (pb, tb, _), t in xla_runs if not tb)
    xla_t = statistics.median(tb / (t - pb / xla) for (pb, tb, _), t in xla_runs if tb)
    kernels = {}
    for (op, impl), us in units.items():
        if impl == "kernel":
            pb, tb, kb = split(us)
            kernels[op] = kb / (seconds((op, impl)) - pb / xla - tb / xla_t)
    bw = Bandwidths(xla, xla_t, tuple(sorted(kernels.items(), key=lambda kv: -len(kv[0]))))
    residuals = {
        f"{op}[{impl}]": {
            "measured_ms": MEASURED["ops_ms"][(op, impl)],
            "predicted_ms": predict(text, bw).total_s * 1e3,
        }
        for (op, impl), text in programs.items()
    }
    return bw, residuals


def calibration() -> dict[str, Any]:
    """What calibrates what: the GEMM fits (and the held-out shapes), the bandwidths, and the
    residual of every measured op under the fitted model."""
    bw, residuals = _fit(op_programs())
    gemm = {}
    for kind, (rate, t0) in gemm_fits().items():
        held = {
            "x".join(map(str, s)): {
                "measured_tflops": tf,
                "predicted_tflops": 2 * math.prod(s) / gemm_seconds(2 * math.prod(s), kind) / 1e12,
            }
            for s, tf in MEASURED["gemm_held_out"].get(kind, {}).items()
        }
        gemm[kind] = {"tflops_peak": rate / 1e12, "t0_us": t0 * 1e6, "held_out": held}
    return {
        "source": "docs/performance.md, H100 80GB HBM3, 2026-11-26, commit 5276131",
        "gemm": gemm,
        "xla_fusion_gbps": bw.xla / 1e9,
        "xla_transpose_fusion_gbps": bw.xla_transpose / 1e9,
        "fp8jax_kernel_gbps": {k: v / 1e9 for k, v in bw.kernels},
        "ops": residuals,
        "assumed": {
            "launch_us": LAUNCH_S * 1e6,
            "tf32_over_bf16": TF32_OVER_BF16,
            "f32_over_bf16": F32_OVER_BF16,
            "link_gbps": LINK_BYTES_S / 1e9,
            "cudnn_attention_tflops": {"/".join(k): v for k, v in CUDNN_ATTENTION_TFLOPS.items()},
        },
    }


if __name__ == "__main__":
    import json

    print(json.dumps(calibration(), indent=2, default=str))
