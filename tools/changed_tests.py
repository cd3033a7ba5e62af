"""The GPU tests of the kernels changed since the last GPU run: ``python tools/changed_tests.py``.

``tools/gpu_run_manifest.txt`` records the kernel sources a GPU last ran (``cpp/cuda``,
``cpp/common``, ``fp8jax/ops``: one ``sha256  path`` line each, under a ``#`` line naming the run).
A file whose hash differs from it, or that is new or gone, selects the tests of its kernel family
(``FAMILIES``); a CUDA source that no family names selects the GPU-vs-host-run comparison of every
kernel. Hashes, not git: a device machine gets the working tree without ``.git``, and
``tools/gpu_check.sh``'s ``perf`` profile runs this there.

    python tools/changed_tests.py                  # the test ids, space-separated, one line
    python tools/changed_tests.py --explain        # which changed file selected which tests
    python tools/changed_tests.py --write --note "H200, 2026-11-30, tools/gpu_check.sh perf"
                                                   # record this tree as the last GPU run's
    python tools/changed_tests.py --write --commit cf4cbe6 --note "..."   # or a commit's
"""

from __future__ import annotations

import argparse
import fnmatch
import hashlib
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MANIFEST = ROOT / "tools" / "gpu_run_manifest.txt"
TRACKED = ("cpp/cuda/", "cpp/sm90/", "cpp/common/", "cpp/ops/", "fp8jax/ops/")
SUFFIXES = (".cu", ".cuh", ".cc", ".h", ".py")
# every kernel's GPU bits against its host run (tests/ops/test_host_cuda.py)
HOST_RUN = "tests/ops/test_host_cuda.py::test_gpu_kernels_equal_their_host_run"
#: family: (source patterns, the tests that run its kernels on a GPU)
FAMILIES: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "gemm": (
        ("cpp/cuda/gemm_*", "fp8jax/ops/gemms/gemm*.py",
         "fp8jax/ops/gemms/_gemm_partition.py"),
        ("tests/ops/test_gemm.py", "tests/ops/test_gemm_setup.py",
         "tests/ops/test_gemm_autotune.py", "tests/ops/test_gemm_epilogue.py",
         "tests/functional/test_mlp_fused.py"),
    ),
    "grouped_gemm": (
        ("fp8jax/ops/gemms/fixed_groups.py",),
        ("tests/functional/test_gated_pair_gemm.py",),
    ),
    "ragged_gemm": (
        ("cpp/cuda/cuda_grouped_gemm.cu", "cpp/common/grouped_gemm.h", "cpp/ops/gemms.h",
         "fp8jax/ops/gemms/grouped_gemm.py", "fp8jax/ops/block/grouped_scaling.py",
         "cpp/sm90/*", "cpp/common/grouped_tc.h", "cpp/cuda/cuda_grouped_tc_prep.*"),
        (
            "tests/ops/test_grouped_gemm.py",
            "tests/ops/test_grouped_gemm_tc.py",
            "tests/ops/test_grouped_scaling.py",
            "tests/functional/test_grouped_dense.py",
            "tests/functional/test_moe.py",
        ),
    ),
    "block": (
        ("cpp/cuda/cuda_block_scaling.cu", "cpp/common/block_*", "cpp/ops/block_casts.h",
         "fp8jax/ops/block/block_*.py", "fp8jax/ops/fused/block_*.py",
         "fp8jax/ops/gemms/blockwise.py"),
        ("tests/ops/test_block_scaling.py", "tests/ops/test_block_fused.py",
         "tests/ops/test_block_gemm.py"),
    ),
    "rowwise": (
        ("cpp/cuda/cuda_rowwise.cu", "cpp/ops/block_casts.h", "fp8jax/ops/block/rowwise.py"),
        ("tests/ops/test_rowwise.py", "tests/functional/test_rowwise_layers.py"),
    ),
    "cast": (
        ("cpp/cuda/cuda_cast_transpose.*", "cpp/cuda/cuda_ops.cu", "cpp/common/launch_plan.h",
         "cpp/common/fp8_device_convert.h", "cpp/ops/casts.h", "fp8jax/ops/casts/quantize.py",
         "fp8jax/ops/casts/cast_transpose.py"),
        ("tests/ops/test_quantize.py", "tests/ops/test_cast_transpose.py",
         "tests/ops/test_cast_transpose_dbias.py", "tests/ops/test_kernel_shapes.py"),
    ),
    "activation": (
        ("cpp/cuda/cuda_activation.cu", "cpp/common/activations.h", "cpp/ops/activations.h",
         "fp8jax/ops/fused/activation.py"),
        ("tests/ops/test_activation.py",),
    ),
    "norm": (
        ("cpp/cuda/cuda_norm*", "cpp/cuda/cuda_column_totals.cuh", "cpp/common/norm_*",
         "cpp/ops/norms.h", "fp8jax/ops/fused/norm*.py"),
        ("tests/ops/test_norm.py",),
    ),
    "scaling": (
        ("cpp/cuda/cuda_ops.cu", "cpp/ops/scaling.h", "fp8jax/ops/casts/scaling.py"),
        ("tests/ops/test_scaling.py",),
    ),
    # the handlers' plumbing (FFI checks, dispatch, op table, launch helpers): every op
    "shared": (
        ("cpp/cuda/*", "cpp/common/*", "cpp/ops/op.h", "fp8jax/ops/base/*.py",
         "fp8jax/ops/__init__.py", "fp8jax/ops/*/__init__.py"),
        ("tests/ops/test_command_buffer.py", "tests/ops/test_implementation.py"),
    ),
}  # fmt: skip


def sources(files: dict[str, bytes]) -> dict[str, str]:
    """``path -> sha256`` of the kernel sources among ``files``."""
    return {
        p: hashlib.sha256(data).hexdigest()
        for p, data in sorted(files.items())
        if p.startswith(TRACKED) and p.endswith(SUFFIXES)
    }


def tree_files() -> dict[str, bytes]:
    """The kernel sources of this working tree."""
    out = {}
    for top in TRACKED:
        for path in sorted((ROOT / top).rglob("*")):
            if path.is_file():
                out[path.relative_to(ROOT).as_posix()] = path.read_bytes()
    return out


def commit_files(commit: str) -> dict[str, bytes]:
    """The kernel sources of a git commit (``--write --commit``; needs git)."""

    def git(*cmd: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *cmd], capture_output=True, check=True, cwd=ROOT)

    names = git("ls-tree", "-r", "--name-only", commit, *TRACKED).stdout.decode().split()
    return {n: git("show", f"{commit}:{n}").stdout for n in names}


def read_manifest(path: Path = MANIFEST) -> tuple[str, dict[str, str]]:
    """``(the run's note, path -> sha256)`` of a manifest."""
    note, hashes = "", {}
    for line in path.read_text().splitlines():
        if line.startswith("#"):
            note = note or line.lstrip("# ").strip()
        elif line.strip():
            digest, name = line.split(maxsplit=1)
            hashes[name.strip()] = digest
    return note, hashes


def write_manifest(hashes: dict[str, str], note: str, path: Path = MANIFEST) -> None:
    lines = [f"# {note}", "# written by tools/changed_tests.py --write; sha256 and path"]
    path.write_text("\n".join(lines + [f"{h}  {p}" for p, h in hashes.items()]) + "\n")


def changed(old: dict[str, str], new: dict[str, str]) -> list[str]:
    """The paths added, removed or changed between two manifests."""
    return sorted(p for p in set(old) | set(new) if old.get(p) != new.get(p))


def select(paths: list[str]) -> dict[str, list[str]]:
    """``changed path -> the tests it selects`` (only paths that select some)."""
    out: dict[str, list[str]] = {}
    for p in paths:
        hits = [f for f, (pats, _) in FAMILIES.items() if any(fnmatch.fnmatch(p, x) for x in pats)]
        specific = [f for f in hits if f != "shared"] or hits
        tests = [t for f in specific for t in FAMILIES[f][1]]
        if p.startswith(("cpp/cuda/", "cpp/common/")):
            tests.append(HOST_RUN)  # the kernel's GPU bits against its host run
        if tests:
            out[p] = list(dict.fromkeys(tests))
    return out


def test_ids(selection: dict[str, list[str]]) -> list[str]:
    """The selected tests, each once, in ``FAMILIES`` order, the host-run comparison last,
    those whose file this tree lacks left out."""
    wanted = {t for ts in selection.values() for t in ts}
    order = [t for _, tests in FAMILIES.values() for t in tests] + [HOST_RUN]
    keep = [t for t in dict.fromkeys(order) if t in wanted]
    return [t for t in keep if (ROOT / t.split("::")[0]).is_file()]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--explain", action="store_true", help="say which file selected which tests")
    p.add_argument("--write", action="store_true", help="record the sources as the last run's")
    p.add_argument("--commit", help="with --write: the sources of this git commit")
    p.add_argument("--note", help="with --write: the run (GPU, date, command, commit)")
    p.add_argument("--manifest", type=Path, default=MANIFEST, help="default: %(default)s")
    args = p.parse_args(argv)
    if args.write:
        if not args.note:
            p.error("--write needs --note (which GPU run the manifest records)")
        files = commit_files(args.commit) if args.commit else tree_files()
        write_manifest(sources(files), args.note, args.manifest)
        print(f"wrote {args.manifest}")
        return 0
    if args.commit:
        p.error("--commit goes with --write")
    if not args.manifest.is_file():
        p.error(f"no manifest at {args.manifest}: record a GPU run with --write first")
    note, old = read_manifest(args.manifest)
    selection = select(changed(old, sources(tree_files())))
    if args.explain:
        print(f"last GPU run: {note}", file=sys.stderr)
        for path, tests in selection.items():
            print(f"  {path}: {' '.join(tests)}", file=sys.stderr)
    print(" ".join(test_ids(selection)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
