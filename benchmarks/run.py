"""Every benchmark in one run: ``python benchmarks/run.py [--out DIR] [--only NAME,...]``.

Runs each ``benchmarks/NAME.py`` that writes a JSON report (``--json``), each in its own process
(each sets up its own devices), with ``--allow-cpu`` where there is no GPU (tiny sizes: a smoke
run whose timings mean nothing; the structural and memory reports are exact anywhere). Prints
one table (status, seconds, the ratios each report states, e.g. FP8 vs BF16) and writes
``DIR/NAME.json`` per benchmark and ``DIR/suite.json`` (environment: device, driver, versions,
commit). Exits non-zero if any benchmark failed (with ``--check``, also when a structural target
of ``structure.py`` regresses). ``--jobs N`` runs N benchmarks at a time (for checks only: they
then share the machine, so their timings mean less). CI runs it on CPU:
``python benchmarks/run.py --check --jobs 2``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from _common import environment, on_gpu

HERE = Path(__file__).resolve().parent
# the two longest first (with --jobs 2 they overlap), then the cheap, exact reports, then the
# timed ones
ORDER = ("structure", "e2e", "mlp_memory", "transformer_memory", "cast_bandwidth", "gemm", "dense",
         "norm", "mlp", "transformer", "implementations", "cpu_kernels")  # fmt: skip


def scripts() -> list[Path]:
    """The benchmark scripts that write a JSON report, in ``ORDER`` (others after, by name)."""
    found = [
        p
        for p in sorted(HERE.glob("*.py"))
        if not p.name.startswith("_") and p.stem != "run" and "--json" in p.read_text()
    ]
    rank = {name: i for i, name in enumerate(ORDER)}
    return sorted(found, key=lambda p: (rank.get(p.stem, len(ORDER)), p.stem))


def ratios(report: Any, prefix: str = "") -> dict[str, float]:
    """The numbers a report calls a ratio or speedup, by key path."""
    out: dict[str, float] = {}
    if isinstance(report, dict):
        for k, v in report.items():
            path = f"{prefix}.{k}" if prefix else str(k)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                if "ratio" in path or "speedup" in path:
                    out[path] = float(v)
            else:
                out.update(ratios(v, path))
    elif isinstance(report, list):
        for i, v in enumerate(report):
            out.update(ratios(v, f"{prefix}[{i}]"))
    return out


def run_one(script: Path, out: Path, gpu: bool, timeout: int, check: bool) -> dict[str, Any]:
    path = out / f"{script.stem}.json"
    cmd = [sys.executable, str(script), "--json", str(path)]
    if check and script.stem == "structure":
        cmd.append("--check")
    if not gpu and "--allow-cpu" in script.read_text():
        cmd.append("--allow-cpu")
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=HERE)
        rc, log = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        rc, log = "timeout", f"{e}"
    (out / f"{script.stem}.log").write_text(log)
    report = json.loads(path.read_text()) if path.exists() else None
    skipped = bool(report and report.get("skipped"))
    return {
        "benchmark": script.stem,
        "rc": rc,
        "status": "ok" if rc == 0 and not skipped else ("skipped" if rc == 0 else "FAILED"),
        "seconds": round(time.perf_counter() - t0, 1),
        "json": str(path) if report is not None else None,
        "ratios": ratios(report) if report else {},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("bench_out"), help="reports go here")
    p.add_argument("--only", help="comma-separated benchmark names")
    p.add_argument("--timeout", type=int, default=900, help="seconds per benchmark")
    p.add_argument("--check", action="store_true", help="fail when a structural target regresses")
    p.add_argument("--jobs", type=int, default=1, help="benchmarks run at a time (default 1)")
    args = p.parse_args(argv)
    if args.jobs < 1:
        p.error(f"--jobs must be at least 1, got {args.jobs}")
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    chosen = scripts()
    if args.only:
        names = set(args.only.split(","))
        if unknown := names - {s.stem for s in chosen}:
            p.error(f"--only: unknown {sorted(unknown)}; known: {[s.stem for s in chosen]}")
        chosen = [s for s in chosen if s.stem in names]
    gpu = on_gpu()
    rows = []
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:  # each job waits on its own process
        runs = pool.map(lambda s: run_one(s, out, gpu, args.timeout, args.check), chosen)
        for row in runs:  # in ORDER, each as soon as it and those before it are done
            rows.append(row)
            shown = ", ".join(f"{k} {v:.3g}" for k, v in list(row["ratios"].items())[:4])
            print(f"{row['benchmark']:>20}  {row['status']:>7}  {row['seconds']:>7.1f} s  {shown}")
    suite = {"environment": environment(), "gpu": gpu, "jobs": args.jobs, "benchmarks": rows}
    (out / "suite.json").write_text(json.dumps(suite, indent=2) + "\n")
    print(f"wrote {out}/suite.json and one NAME.json and NAME.log per benchmark")
    return 1 if any(r["status"] == "FAILED" for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
