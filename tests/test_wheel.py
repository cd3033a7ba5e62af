"""What makes fp8jax's wheel installable without a compiler: its CUDA extension finds libcublasLt
in the nvidia-cublas wheel beside it (its RUNPATH, read by tools/elf_dynamic.py, which needs no
readelf), the ``cuda13`` extra installs the cuBLAS CI builds against, and tools/wheel_check.py
refuses a wheel that holds a test-only extension or lacks one it must hold. tools/wheel_check.sh
builds and installs the wheel itself (CI runs it)."""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools"))

import elf_dynamic  # noqa: E402
import wheel_check  # noqa: E402

# The nvidia-cublas wheel's library directories, as the extension's RUNPATH names them: CUDA 13's
# shared nvidia/cu13, then CUDA 12's nvidia/cublas.
WHEEL_DIRS = ("$ORIGIN/../nvidia/cu13/lib", "$ORIGIN/../nvidia/cublas/lib")


def _extension(name: str) -> Path | None:
    spec = importlib.util.find_spec(f"fp8jax.{name}")
    return Path(spec.origin) if spec is not None and spec.origin else None


def _cuda_extension() -> Path:
    path = _extension("_fp8jax_cuda")
    if path is None:
        pytest.skip("no CUDA extension built (no nvcc at build time); CI's newest leg builds it")
    return path


def _readelf(path: Path) -> dict[str, list[str]]:
    """``readelf -d``'s NEEDED, SONAME, RPATH and RUNPATH entries (binutils)."""
    out = subprocess.run(
        ["readelf", "-d", str(path)], capture_output=True, text=True, check=True
    ).stdout
    entries: dict[str, list[str]] = {name: [] for name in elf_dynamic.TAGS.values()}
    for tag, value in re.findall(r"\((NEEDED|SONAME|RPATH|RUNPATH)\)\s+[^[]*\[(.*)\]", out):
        entries[tag].append(value)
    return entries


def test_the_elf_reader_reads_the_cpu_extension():
    path = _extension("_fp8jax_cpu")
    assert path is not None, "the CPU extension is always built"
    entries = elf_dynamic.dynamic_entries(path)
    assert "libc.so.6" in entries["NEEDED"], entries
    if shutil.which("readelf"):
        assert entries == _readelf(path)


def test_the_elf_reader_agrees_with_readelf_on_the_cuda_extension():
    path = _cuda_extension()
    if not shutil.which("readelf"):
        pytest.skip("no readelf (binutils) on PATH to compare with")
    assert elf_dynamic.dynamic_entries(path) == _readelf(path)


def test_the_elf_reader_refuses_what_it_cannot_read(tmp_path):
    text = tmp_path / "not_elf.so"
    text.write_bytes(b"#!/bin/sh\n")
    with pytest.raises(ValueError, match="not an ELF file"):
        elf_dynamic.dynamic_entries(text)
    elf32 = tmp_path / "elf32.so"
    elf32.write_bytes(b"\x7fELF\x01\x01" + bytes(58))
    with pytest.raises(ValueError, match="64-bit little-endian"):
        elf_dynamic.dynamic_entries(elf32)


def test_the_elf_reader_prints_each_entry(capsys):
    path = _extension("_fp8jax_cpu")
    assert elf_dynamic.main([str(path)]) == 0
    assert "  NEEDED   libc.so.6" in capsys.readouterr().out
    assert elf_dynamic.main([]) == 2


def test_the_cuda_extension_searches_the_nvidia_wheels_first():
    path = _cuda_extension()
    entries = elf_dynamic.dynamic_entries(path)
    assert any(n.startswith("libcublasLt.so.") for n in entries["NEEDED"]), entries
    assert entries["RUNPATH"] or entries["RPATH"], entries  # RUNPATH with today's linkers
    search = elf_dynamic.search_path(path)
    assert tuple(search[:2]) == WHEEL_DIRS, search
    # Anything after them is where a development build found cuBLAS (an absolute path).
    assert all(os.path.isabs(d) for d in search[2:]), search


def _cublaslt(extension: Path) -> Path | None:
    """A libcublasLt the extension can use: where its RUNPATH or the nvidia wheel has it."""
    needed = next(
        n for n in elf_dynamic.dynamic_entries(extension)["NEEDED"] if n.startswith("libcublasLt")
    )
    dirs = [d for d in elf_dynamic.search_path(extension) if os.path.isabs(d)]
    try:
        import nvidia

        dirs += [os.path.join(p, sub, "lib") for p in nvidia.__path__ for sub in ("cu13", "cublas")]
    except ImportError:
        pass
    for d in dirs:
        if os.path.isfile(os.path.join(d, needed)):
            return Path(d, needed)
    return None


@pytest.mark.parametrize("layout", ["cu13", "cublas"])
def test_the_cuda_extension_loads_cublaslt_from_the_wheel_beside_it(tmp_path, layout):
    """The extension as a wheel installs it, in site-packages/fp8jax/, with nvidia-cublas's
    library in site-packages/nvidia/<layout>/lib (cu13: CUDA 13's wheels, cublas: CUDA 12's):
    the loader takes libcublasLt from there (glibc's LD_DEBUG says which file it ran)."""
    extension = _cuda_extension()
    lib = _cublaslt(extension)
    if lib is None:
        pytest.skip("no libcublasLt found (RUNPATH or nvidia-cublas wheel) to lay out")
    site = tmp_path / "site-packages"
    (site / "fp8jax").mkdir(parents=True)
    shutil.copy2(extension, site / "fp8jax" / extension.name)
    (site / "nvidia" / layout / "lib").mkdir(parents=True)
    (site / "nvidia" / layout / "lib" / lib.name).symlink_to(lib)
    env = {k: v for k, v in os.environ.items() if k != "LD_LIBRARY_PATH"}
    env["LD_DEBUG"] = "libs"
    target = site / "fp8jax" / extension.name
    run = subprocess.run(
        [sys.executable, "-c", f"import ctypes; ctypes.CDLL({str(target)!r})"],
        env=env, capture_output=True, text=True,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    expected = f"{site}/fp8jax/../nvidia/{layout}/lib/{lib.name}"
    inits = re.findall(r"calling init: (\S*libcublasLt\S*)", run.stderr)
    assert inits == [expected], (inits, run.stderr[-3000:])


def test_the_cuda13_extra_is_the_cublas_ci_builds_against():
    tomllib = pytest.importorskip("tomllib")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = extras["optional-dependencies"]
    pinned = re.search(r'^CUBLAS_WHEEL="nvidia-cublas==([0-9.]+)"$',
                       (ROOT / ".ci" / "run").read_text(), re.M)  # fmt: skip
    assert pinned, "CUBLAS_WHEEL not found in .ci/run"
    version = pinned.group(1)
    major = int(version.split(".")[0])
    assert extras["cuda13"] == [f"nvidia-cublas>={version},<{major + 1}"]


def _wheel(tmp_path: Path, names: list[str]) -> Path:
    path = tmp_path / "fp8jax-0.1.0-cp312-cp312-linux_x86_64.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("fp8jax/__init__.py", "")
        for name in names:
            z.writestr(f"fp8jax/{name}.cpython-312-x86_64-linux-gnu.so", b"")
    return path


def test_wheel_check_names_the_extensions(tmp_path):
    wheel = _wheel(tmp_path, ["_fp8jax_cpu", "_fp8jax_cuda"])
    assert wheel_check.extensions(wheel) == ["_fp8jax_cpu", "_fp8jax_cuda"]


@pytest.mark.parametrize(
    ("names", "cuda", "problem"),
    [
        (["_fp8jax_cpu"], False, None),
        (["_fp8jax_cpu", "_fp8jax_cuda"], True, None),
        (["_fp8jax_cpu", "_fp8jax_cuda"], None, None),
        (["_fp8jax_cpu"], None, None),
        ([], False, "no CPU extension"),
        (["_fp8jax_cpu"], True, "no CUDA extension"),
        (["_fp8jax_cpu", "_fp8jax_cuda"], False, "a CUDA extension"),
        (["_fp8jax_cpu", "_fp8jax_testing"], False, "test-only extension"),
        (["_fp8jax_cpu", "_fp8jax_host_cuda"], None, "test-only extension"),
        (["_fp8jax_cpu", "_fp8jax_cuda", "_fp8jax_cuda_testing"], True, "test-only extension"),
    ],
)
def test_wheel_check_refuses_what_a_user_wheel_must_not_hold(tmp_path, names, cuda, problem):
    problems = wheel_check.problems(_wheel(tmp_path, names), cuda=cuda)
    if problem is None:
        assert problems == []
    else:
        assert len(problems) == 1 and problem in problems[0], problems


def test_wheel_check_exits_nonzero_naming_the_problem(tmp_path, capsys):
    wheel = _wheel(tmp_path, ["_fp8jax_cpu", "_fp8jax_testing"])
    assert wheel_check.main([str(wheel), "--no-cuda"]) == 1
    out = capsys.readouterr()
    assert "_fp8jax_cpu, _fp8jax_testing" in out.out
    assert "FAIL: test-only extension" in out.err
    assert wheel_check.main([str(_wheel(tmp_path, ["_fp8jax_cpu"])), "--no-cuda"]) == 0
