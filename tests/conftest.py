"""Shared test setup: the kernel under test runs on the default backend (CPU here, CUDA on a GPU
machine); expectations come from the jnp references pinned to the CPU and from numpy oracles."""

from __future__ import annotations

import sys
from pathlib import Path

import jax
import numpy as np
import pytest

# Makes the shared helpers importable from every test directory: tests/_shared.py, _hlo.py, ...
# and tests/ops/_values.py, _samples.py, ... (the distributed conformance suite reads these).
sys.path.insert(0, str(Path(__file__).parent / "ops"))
sys.path.insert(0, str(Path(__file__).parent))

import _shared

jax.config.update("jax_enable_x64", False)


def on_cpu(fn, *args, **kwargs):
    """Runs ``fn`` with its array arguments committed to the CPU (the reference platform)."""
    cpu = jax.devices("cpu")[0]
    args = [jax.device_put(a, cpu) if isinstance(a, (jax.Array, np.ndarray)) else a for a in args]
    with jax.default_device(cpu):
        return fn(*args, **kwargs)


def load_testing_extension(cuda: bool = False):
    """The test-only extension (built with FP8JAX_TESTING=ON, as tools/test.sh builds); its
    absence is a setup error, never a skip."""
    from fp8jax import _ffi

    mod = _ffi.testing_extension(cuda=cuda)
    if mod is None:
        name = "_fp8jax_cuda_testing" if cuda else "_fp8jax_testing"
        raise ImportError(
            f"fp8jax.{name} is missing: these tests need the test-only extensions; build with "
            "FP8JAX_TESTING=ON (tools/test.sh does: `bash tools/test.sh`)"
        )
    return mod


def has_cuda() -> bool:
    try:
        return len(jax.devices("cuda")) > 0
    except RuntimeError:
        return False


requires_cuda = pytest.mark.skipif(
    not has_cuda(), reason="needs a CUDA device (JAX has no CUDA backend on this machine)"
)


def needs_devices(n: int) -> pytest.MarkDecorator:
    """Skip mark for a test that needs ``n`` devices, saying how to get them on a CPU."""
    return pytest.mark.skipif(
        jax.device_count() < n,
        reason=f"needs {n} devices, found {jax.device_count()}; run with "
        f"XLA_FLAGS=--xla_force_host_platform_device_count={n} JAX_PLATFORMS=cpu",
    )


@pytest.fixture
def gspmd():
    """The GSPMD partitioner (the default before Shardy), where JAX still has it."""
    if not hasattr(jax.config, "jax_use_shardy_partitioner"):
        pytest.skip("this JAX has no GSPMD partitioner switch")
    old = jax.config.jax_use_shardy_partitioner
    jax.config.update("jax_use_shardy_partitioner", False)
    try:
        yield
    finally:
        jax.config.update("jax_use_shardy_partitioner", old)


@pytest.fixture
def float32_matmuls():
    """Full float32 matmuls, on a GPU too (no TF32), for high-precision references; a module
    applies it to every test with ``pytestmark = pytest.mark.usefixtures("float32_matmuls")``."""
    with jax.default_matmul_precision("float32"):
        yield


@pytest.fixture
def rand():
    """:func:`_shared.rand` (``rand(shape, seed=0, scale=1.0)``); module-level code imports it."""
    return _shared.rand


def pytest_collection_modifyitems(config, items):
    """``FP8JAX_TEST_FIRST`` (space-separated test files, relative to the repo root): their tests
    run before the others, in collection order otherwise (tools/gpu_check.sh puts what no GPU
    has run yet first, so that a short device lease reaches it)."""
    import os

    first = {Path(p).resolve() for p in os.environ.get("FP8JAX_TEST_FIRST", "").split()}
    if first:
        items.sort(key=lambda item: Path(str(item.fspath)).resolve() not in first)
