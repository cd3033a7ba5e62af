"""Line coverage of the CUDA kernel bodies, from their run on the host.

``python tools/kernel_coverage.py [--build-dir DIR] [--min PERCENT]``

After the tests ran ``fp8jax._fp8jax_host_cuda`` built with ``FP8JAX_COVERAGE=ON`` (gcov
instrumentation; cpp/testing/host_cuda.h runs cpp/cuda/'s kernels on the CPU), reads gcov's counts
and reports, for every ``__global__`` function of cpp/cuda/, how many of its body's executable
lines ran. Exits 1 when the total is under ``--min`` (default 95) or when no counts are found.
"""

from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CUDA = ROOT / "cpp" / "cuda"
# After "__global__": the return type, launch bounds if any, the name and its "(".
SIGNATURE = re.compile(r"\s*void\s+(?:__launch_bounds__\s*\([^)]*\)\s*)?(\w+)\s*\(")


def kernel_bodies(path: Path) -> list[tuple[str, int, int]]:
    """``(name, first line, last line)`` of the body of every ``__global__`` function in
    ``path`` (1-based, the lines between its braces)."""
    text = path.read_text()
    found = []
    for m in re.finditer(r"__global__\b", text):
        name = SIGNATURE.match(text, m.end())
        if name is None:
            continue
        paren = name.end() - 1  # the parameter list's "("
        depth, i = 0, paren
        while True:  # past the parameter list
            depth += text[i] == "("
            depth -= text[i] == ")"
            i += 1
            if depth == 0:
                break
        i = text.index("{", i)
        start, depth = i, 0
        while True:
            depth += text[i] == "{"
            depth -= text[i] == "}"
            if depth == 0:
                break
            i += 1
        first = text.count("\n", 0, start) + 2
        last = text.count("\n", 0, i)
        found.append((name.group(1), first, last))
    return found


def gcov_counts(build_dir: Path) -> dict[Path, dict[int, int]]:
    """Executed count per line of every source gcov knows, summed over translation units."""
    counts: dict[Path, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    gcdas = [p for p in build_dir.rglob("*.gcda") if "host_cuda" in str(p)]
    for gcda in gcdas:
        out = subprocess.run(
            ["gcov", "--json-format", "--stdout", str(gcda)],
            capture_output=True,
            text=True,
            cwd=gcda.parent,
            check=True,
        ).stdout
        for doc in out.splitlines():
            if not doc.strip():
                continue
            for f in json.loads(doc)["files"]:
                path = Path(f["file"])
                if not path.is_absolute():
                    path = (gcda.parent / path).resolve()
                for line in f["lines"]:
                    counts[path.resolve()][line["line_number"]] += line["count"]
    return counts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--build-dir", type=Path, default=ROOT / "build", help="where the .gcda are")
    p.add_argument("--min", type=float, default=95.0, help="the total's lowest percentage")
    args = p.parse_args(argv)
    counts = gcov_counts(args.build_dir)
    if not counts:
        hint = "build with FP8JAX_COVERAGE=ON and run tests/ops/test_host_cuda.py first"
        print(f"kernel_coverage: no gcov counts under {args.build_dir} ({hint})", file=sys.stderr)
        return 1
    total_lines = total_run = 0
    print(f"{'lines':>6} {'run':>5} {'%':>6}  kernel")
    for src in sorted([*CUDA.glob("*.cu"), *CUDA.glob("*.cuh")]):
        lines = counts.get(src.resolve(), {})
        for name, first, last in kernel_bodies(src):
            body = {n: c for n, c in lines.items() if first <= n <= last}
            run = sum(c > 0 for c in body.values())
            total_lines += len(body)
            total_run += run
            missed = sorted(n for n, c in body.items() if c == 0)
            pct = 100.0 * run / len(body) if body else 0.0
            where = f"{src.relative_to(ROOT)}:{first}"
            note = f"  not run: lines {missed}" if missed else ""
            print(f"{len(body):>6} {run:>5} {pct:>6.1f}  {name} ({where}){note}")
    pct = 100.0 * total_run / total_lines if total_lines else 0.0
    print(f"kernel_coverage: {total_run} of {total_lines} kernel body lines run ({pct:.1f}%)")
    if pct < args.min:
        print(f"kernel_coverage: FAIL: under {args.min}%", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
