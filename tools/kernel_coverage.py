"""Line coverage of the CUDA kernel bodies, from their run on the host.

``python tools/kernel_coverage.py [--build-dir DIR] [--min PERCENT]``

After the tests ran ``fp8jax._fp8jax_host_cuda`` built with ``FP8JAX_COVERAGE=ON`` (gcov
instrumentation; cpp/testing/host_cuda.h runs cpp/cuda/'s kernels on the CPU), reads gcov's counts
and reports, for every ``__global__`` function of cpp/cuda/ and every ``__device__`` helper
there, how many of its body's executable lines ran. Exits 1 when the total is under ``--min``
(default 95) or when no counts are found.
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


def kernel_bodies(path: Path) -> list[tuple[str, int, int]]:
    """``(name, first line, last line)`` of the body of every ``__global__`` and ``__device__``
    function in ``path`` (1-based: the lines between its braces, or the one line of a body
    written on one line)."""
    text = path.read_text()
    found = []
    for m in re.finditer(r"\b__(?:global|device)__\b", text):
        brace = text.find("{", m.end())
        semi = text.find(";", m.end())
        if brace < 0 or (0 <= semi < brace):
            continue  # a declaration
        head = text[m.end() : brace]
        close = head.rfind(")")  # the parameter list is the last (...) before the body
        depth, i = 0, close
        while i >= 0:
            depth += head[i] == ")"
            depth -= head[i] == "("
            if depth == 0:
                break
            i -= 1
        name = re.search(r"(\w+)\s*$", head[:i])
        depth, j = 0, brace
        while True:
            depth += text[j] == "{"
            depth -= text[j] == "}"
            if depth == 0:
                break
            j += 1
        first = text.count("\n", 0, brace) + 2
        last = text.count("\n", 0, j)
        if last < first:  # the body on one line: that line
            first = last = first - 1
        found.append((name.group(1) if name else "?", first, last))
    return found


def gcov_counts(build_dir: Path) -> dict[Path, dict[int, int]]:
    """Executed count per line of every source gcov knows, summed over translation units."""
    counts: dict[Path, dict[int, int]] = defaultdict(lambda: defaultdict(int))
    gcdas = [p.resolve() for p in build_dir.rglob("*.gcda") if "host_cuda" in str(p)]
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
    print(f"kernel_coverage: {total_run} of {total_lines} kernel and device-function lines run "
          f"({pct:.1f}%)")  # fmt: skip
    if pct < args.min:
        print(f"kernel_coverage: FAIL: under {args.min}%", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
