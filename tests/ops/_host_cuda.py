"""The host run of the CUDA handlers (``fp8jax._fp8jax_host_cuda``), shared by the tests that use
it: the extension, and a context in which every fp8jax op's FFI call goes to its CUDA handler
run on the host (cpp/testing/host_cuda.h)."""

from __future__ import annotations

import contextlib
import importlib
import pathlib
import shutil

import jax
import pytest

from fp8jax import _ffi

PREFIX = "fp8jax_host_cuda_"


def _extension():
    try:
        return importlib.import_module("fp8jax._fp8jax_host_cuda")
    except ImportError:
        toolkit = shutil.which("nvcc") or pathlib.Path("/usr/local/cuda/include/cuda.h").exists()
        if toolkit:
            raise ImportError(
                "fp8jax._fp8jax_host_cuda is missing although the CUDA toolkit is here: build "
                "with FP8JAX_TESTING=ON (bash tools/test.sh does)"
            ) from None
        return None


EXT = _extension()
NEEDS_EXT = pytest.mark.skipif(EXT is None, reason="no CUDA toolkit headers to build it with")
_REGISTERED: dict[str, str] = {}
CPU = jax.devices("cpu")[0]


@pytest.fixture
def on_the_cpu():
    """The host runs are CPU custom calls: on a GPU machine too (tools/gpu_check.sh)."""
    with jax.default_device(CPU):
        yield


def to_cpu(arrays):
    return tuple(jax.device_put(a, CPU) for a in arrays)


def _register() -> dict[str, str]:
    if not _REGISTERED:
        _ffi.ensure_registered()
        for name, capsule in EXT.registrations().items():
            host = PREFIX + name.removeprefix("fp8jax_")
            jax.ffi.register_ffi_target(host, capsule, platform="cpu")
            _REGISTERED[name] = host
    return _REGISTERED


@contextlib.contextmanager
def on_host_cuda(monkeypatch, *, reverse=False, sms=2, blocks_per_sm=0, device=0, banks=False):
    """Inside, every fp8jax op's FFI call goes to its CUDA handler run on the host."""
    targets = _register()
    real = jax.ffi.ffi_call

    def swapped(name, *args, **kwargs):
        return real(targets.get(name, name), *args, **kwargs)

    EXT.set_options(
        reverse=reverse, sms=sms, blocks_per_sm=blocks_per_sm, device=device, banks=banks
    )
    jax.clear_caches()  # traces made with the CPU targets
    with monkeypatch.context() as m:
        m.setattr(jax.ffi, "ffi_call", swapped)
        try:
            yield
        finally:
            jax.clear_caches()  # and none of these traces outlives the block
            EXT.set_options()
