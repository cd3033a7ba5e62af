"""Shared helpers of the benchmark scripts: environment record, timing loop, JSON report.

Imported by the scripts in this folder (``python benchmarks/NAME.py`` puts the folder on
``sys.path``); not a benchmark itself (tools/gpu_check.sh skips ``_*.py``).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import jaxlib

import fp8jax

REPO = Path(__file__).resolve().parent.parent


def _run(cmd: list[str]) -> str | None:
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=30, check=True, cwd=REPO)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def on_gpu() -> bool:
    """Whether JAX's default backend is a CUDA GPU."""
    return jax.default_backend() in ("gpu", "cuda")


def environment() -> dict[str, Any]:
    """Device, driver, versions and commit: what makes a result comparable to another."""
    dev = jax.devices()[0]
    driver = _run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"])
    try:
        import flax

        flax_version = flax.__version__
    except ImportError:
        flax_version = None
    return {
        "device": dev.device_kind,
        "platform": dev.platform,
        "device_count": jax.device_count(),
        "driver": driver.splitlines()[0] if driver else "unknown",
        "jax": jax.__version__,
        "jaxlib": getattr(jaxlib, "__version__", "unknown"),
        "flax": flax_version,
        "fp8jax": fp8jax.__version__,
        "fp8_support": list(fp8jax.fp8_support()),
        "git_commit": os.environ.get("FP8JAX_GIT_COMMIT")
        or _run(["git", "rev-parse", "HEAD"])
        or "unknown",
        "source_digest": source_digest(),
        "python": sys.version.split()[0],
        "timestamp": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def source_digest() -> str:
    """A hash of the sources that make a result (fp8jax/, cpp/, benchmarks/, examples/,
    tools/): names the tree where git is missing (a device machine gets the files, not .git);
    ``python -c "import _common; print(_common.source_digest())"`` in benchmarks/ names yours."""
    h = hashlib.sha256()
    for top in ("fp8jax", "cpp", "benchmarks", "examples", "tools"):
        for path in sorted((REPO / top).rglob("*")):
            if path.is_file() and path.suffix in (".py", ".cc", ".cu", ".h", ".cuh", ".sh"):
                h.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


def time_steps(
    step: Callable[[Any, Any], tuple[Any, Any]],
    state: Any,
    batches: list[Any],
    *,
    iters: int,
    inner: int,
    warmup: int,
) -> tuple[Any, list[float], list[float]]:
    """Trains: ``state, loss = step(state, batch)`` over ``batches`` in turn, ``warmup`` steps,
    then ``iters`` measurements of ``inner`` back-to-back steps (each waits for the state).
    Returns the state, seconds per step of each measurement, and every step's loss."""
    losses = []
    k = 0
    for _ in range(warmup):
        state, loss = step(state, batches[k % len(batches)])
        losses.append(loss)
        k += 1
    jax.block_until_ready(state)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        for _ in range(inner):
            state, loss = step(state, batches[k % len(batches)])
            losses.append(loss)
            k += 1
        jax.block_until_ready(state)
        times.append((time.perf_counter() - t0) / inner)
    return state, times, [float(x) for x in losses]


def time_op(fn: Callable[[], Any], *, iters: int, inner: int, warmup: int) -> list[float]:
    """Seconds per call of ``fn``, one entry per measurement of ``inner`` back-to-back calls."""
    for _ in range(warmup):
        jax.block_until_ready(fn())
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        out = None
        for _ in range(inner):
            out = fn()
        jax.block_until_ready(out)
        times.append((time.perf_counter() - t0) / inner)
    return times


def skipped_report(name: str) -> dict[str, Any]:
    """The report of a GPU benchmark run without a CUDA device (and without --allow-cpu)."""
    msg = f"no CUDA device, skipped (JAX backend is {jax.default_backend()!r}; --allow-cpu)"
    print(f"{name}: {msg}")
    return {"benchmark": name, "skipped": True, "reason": msg}


def write_json(path: Path | None, report: dict[str, Any]) -> None:
    """Writes ``report`` to ``path`` (if given), creating its folder."""
    if path is None:
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {path}")


def add_timing_args(p: Any, *, iters: int, inner: int, what: str = "calls") -> None:
    """Adds --json, --iters, --inner, --warmup and --allow-cpu, shared by every benchmark."""
    p.add_argument("--json", type=Path, help="write the report here")
    p.add_argument("--iters", type=int, default=iters, help="measurements; the median is reported")
    p.add_argument("--inner", type=int, default=inner, help=f"back-to-back {what} per measurement")
    p.add_argument("--warmup", type=int, default=3, help=f"untimed {what} after compiling")
    p.add_argument("--allow-cpu", action="store_true", help="run on CPU (smoke test, tiny sizes)")


def check_timing_args(p: Any, args: Any) -> None:
    """Rejects --iters/--inner below 1 through the parser's own error."""
    for name in ("iters", "inner"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1")
