"""Loads the compiled extensions and registers their XLA FFI targets.

Every kernel is registered under one target name for ``cpu`` and, when the CUDA extension is built
and JAX has a CUDA backend, for ``CUDA`` too, so one :func:`jax.ffi.ffi_call` runs on either
platform. Registration is lazy (first op call) and idempotent: ``import fp8jax`` never touches a
GPU, a driver or cuBLAS.
"""

from __future__ import annotations

import ctypes
import functools
import glob
import importlib
import importlib.util
import os
import warnings
from types import ModuleType

import jax

__all__ = ["cuda_extension", "ensure_registered", "jax_has_cuda", "testing_extension"]


def _load(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(f"fp8jax.{name}")
    except ImportError:
        return None


@functools.cache
def cpu_extension() -> ModuleType:
    """The CPU extension module; it is always built, so its absence is an install error."""
    mod = _load("_fp8jax_cpu")
    if mod is None:
        raise ImportError(
            "fp8jax: the compiled extension fp8jax._fp8jax_cpu is missing; reinstall fp8jax with "
            "`pip install .` (it needs a C++20 compiler and CMake)"
        )
    return mod


def _preload_cublaslt() -> None:
    """Loads libcublasLt from the nvidia-cublas wheel (the one JAX's CUDA plugin installs).

    The CUDA extension links libcublasLt and finds it through its RPATH when the wheel sits beside
    fp8jax in site-packages; loading it here, globally, also covers a wheel elsewhere on
    ``sys.path`` (e.g. fp8jax installed in another environment than JAX). Failure is ignored: the
    import of the extension then reports what is missing.
    """
    try:
        import nvidia  # namespace package of NVIDIA's CUDA wheels
    except ImportError:
        return
    for base in list(getattr(nvidia, "__path__", [])):
        for sub in ("cu13", "cublas"):  # CUDA 13 wheels share nvidia/cu13; CUDA 12 has its own dir
            for path in sorted(glob.glob(os.path.join(base, sub, "lib", "libcublasLt.so.*"))):
                try:
                    ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)
                except OSError:
                    continue
                return


@functools.cache
def cuda_extension() -> ModuleType | None:
    """The CUDA extension module, or ``None`` when it was not built (or cannot be loaded)."""
    if importlib.util.find_spec("fp8jax._fp8jax_cuda") is None:
        return None
    _preload_cublaslt()
    try:
        return importlib.import_module("fp8jax._fp8jax_cuda")
    except ImportError as e:
        warnings.warn(
            f"fp8jax: the CUDA extension is built but cannot be loaded ({e}); fp8jax ops cannot "
            "run on the GPU. It needs libcublasLt from the nvidia-cublas wheel that JAX's CUDA "
            "plugin installs (pip install 'jax[cuda13]')",
            RuntimeWarning,
            stacklevel=3,
        )
        return None


def testing_extension(cuda: bool = False) -> ModuleType | None:
    """The test-only extension (``_fp8jax_testing``, or ``_fp8jax_cuda_testing`` when ``cuda``).

    Built only with ``FP8JAX_TESTING=ON`` (``tools/test.sh`` sets it): the CUDA kernels' launch
    planning and the cuBLASLt setup, on the host. ``None`` when this install has no such module
    (the CUDA one also needs the CUDA extension).
    """
    if not cuda:
        return _load("_fp8jax_testing")
    if cuda_extension() is None:  # loads libcublasLt the same way first
        return None
    return _load("_fp8jax_cuda_testing")


@functools.cache
def jax_has_cuda() -> bool:
    """Whether JAX has a CUDA backend with at least one device."""
    try:
        return len(jax.devices("cuda")) > 0
    except RuntimeError:
        return False


@functools.cache
def ensure_registered() -> None:
    """Registers every fp8jax FFI target (once per process)."""
    for name, capsule in cpu_extension().registrations().items():
        jax.ffi.register_ffi_target(name, capsule, platform="cpu")
    if not jax_has_cuda():
        return
    cuda = cuda_extension()
    if cuda is None:
        warnings.warn(
            "fp8jax: JAX has a CUDA backend but fp8jax was built without its CUDA extension, so "
            "fp8jax ops cannot run on the GPU; rebuild with FP8JAX_CUDA=ON and nvcc on PATH",
            RuntimeWarning,
            stacklevel=3,
        )
        return
    traits = cuda.traits()
    for name, handler in cuda.registrations().items():
        jax.ffi.register_ffi_target(name, handler, platform="CUDA", **_traits_kwargs(traits, name))


def _traits_kwargs(traits: dict[str, int], name: str) -> dict:
    """``traits=`` for :func:`jax.ffi.register_ffi_target`: XLA learns that a handler may be
    captured into a CUDA graph (command buffer) from its registration, not from the handler."""
    value = traits.get(name, 0)
    try:
        from jaxlib.xla_client import CustomCallTargetTraits
    except ImportError:  # a jaxlib without traits: register plainly
        return {}
    return {"traits": CustomCallTargetTraits(value)} if value else {}
