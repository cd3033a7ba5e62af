"""The CUDA kernels' element conversions, checked on the host against the CPU numerics.

``tests/cpp/test_device_numerics.cc`` compiles the ``__host__ __device__`` helpers of
``cpp/common/fp8_device_convert.h`` (the functions the CUDA kernels call) for the host, where the
CUDA headers' host implementations of the conversion intrinsics model the hardware, and compares
them with ``cpp/common/fp8_numerics.h`` (what the CPU kernels call). No GPU is needed, only nvcc.

By default it checks every 4099th float32 input plus every input near a rounding boundary; with
``FP8JAX_FULL_SWEEP=1`` all 2^32 float32 inputs (``.ci/run`` does this when nvcc is present).
Every bf16 and f16 input and every FP8 code are always checked.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
SOURCE = ROOT / "tests" / "cpp" / "test_device_numerics.cc"
FULL = os.environ.get("FP8JAX_FULL_SWEEP") == "1"


def _nvcc() -> str | None:
    found = shutil.which("nvcc")
    if found:
        return found
    for home in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH"), "/usr/local/cuda"):
        if home and (pathlib.Path(home) / "bin" / "nvcc").is_file():
            return str(pathlib.Path(home) / "bin" / "nvcc")
    return None


NVCC = _nvcc()
pytestmark = pytest.mark.skipif(
    NVCC is None,
    reason="nvcc not found (PATH, CUDA_HOME, /usr/local/cuda): the host test of the CUDA "
    "conversion helpers needs the CUDA headers",
)


def _compile(include_dir: pathlib.Path, out: pathlib.Path) -> pathlib.Path:
    # nvcc, so that the helpers are compiled exactly as in the kernels' translation unit
    # (FP8JAX_HD = __host__ __device__ __forceinline__); their host side is what runs here.
    cmd = [NVCC, "-std=c++17", "-O2", "-x", "cu", f"-I{include_dir}", "-Xcompiler", "-pthread"]
    cmd += [str(SOURCE), "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout}\n{proc.stderr}"
    return out


def _run(binary: pathlib.Path, *args: str) -> subprocess.CompletedProcess:
    threads = str(max(1, len(os.sched_getaffinity(0))))
    return subprocess.run(
        [str(binary), "--threads", threads, *args], capture_output=True, text=True, timeout=1800
    )


@pytest.fixture(scope="module")
def binary(tmp_path_factory) -> pathlib.Path:
    return _compile(ROOT / "cpp", tmp_path_factory.mktemp("device_numerics") / "test")


def test_device_conversions_match_cpu_numerics(binary):
    proc = _run(binary, *(["--full"] if FULL else []))
    print(proc.stdout)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "OK: 0 mismatches" in proc.stdout
    assert ("all 4294967296 inputs" in proc.stdout) == FULL


# Each mutation undoes one software fix-up of the device helpers; the checker must notice.
MUTATIONS = {
    "fp8 special values": (
        "if ((FloatBits(p) & 0x7F800000u) == 0x7F800000u) code =",
        "if (false) code =",
    ),
    "f16 load NaN": ("  if ((h & 0x7FFFu) > 0x7C00u) {", "  if (false) {"),
    "f16 store NaN": ("if ((u & 0x7FFFFFFFu) > 0x7F800000u) h =", "if (false) h ="),
}


@pytest.mark.parametrize("name", list(MUTATIONS))
def test_checker_catches_hardware_special_values(name, tmp_path):
    # Without the fix-ups the helpers are the bare hardware conversions (the CUDA kernels before
    # this contract): NaN signs lost, inf saturated. The checker must report mismatches.
    old, new = MUTATIONS[name]
    (tmp_path / "common").mkdir()
    for header in (ROOT / "cpp" / "common").glob("*.h"):
        text = header.read_text()
        if header.name == "fp8_device_convert.h":
            assert text.count(old) == 1, f"mutation {name!r} no longer applies"
            text = text.replace(old, new)
        (tmp_path / "common" / header.name).write_text(text)
    proc = _run(_compile(tmp_path, tmp_path / "mutant"))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "MISMATCH" in proc.stdout
