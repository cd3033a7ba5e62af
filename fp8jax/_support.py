"""``fp8_support()``: can this process run fp8jax's FP8 kernels, and how."""

from __future__ import annotations

import jax

from fp8jax import _ffi

__all__ = ["fp8_support"]

_MIN_CAPABILITY = (8, 9)


def capability(device: jax.Device) -> tuple[int, int] | None:
    cc = getattr(device, "compute_capability", None)
    if cc is None:
        return None
    major, _, minor = str(cc).partition(".")
    try:
        return int(major), int(minor or 0)
    except ValueError:
        return None


def fp8_support() -> tuple[bool, str]:
    """Returns ``(supported, reason)`` for the default JAX backend.

    On a CUDA GPU, FP8 needs compute capability >= 8.9 (Ada, Hopper and newer) and fp8jax's CUDA
    extension. On CPU, every op runs with identical numerics, emulated: usable, not fast.
    """
    backend = jax.default_backend()
    if backend == "cpu":
        return True, "emulated on CPU (usable, not fast)"
    if backend not in ("gpu", "cuda"):
        return False, f"fp8jax has no kernels for the {backend!r} backend"
    device = jax.devices()[0]
    cc = capability(device)
    name = getattr(device, "device_kind", str(device))
    if cc is None or cc < _MIN_CAPABILITY:
        return False, f"{name}: FP8 needs compute capability >= 8.9, this device has {cc}"
    if _ffi.cuda_extension() is None:
        return False, "fp8jax was built without its CUDA extension (rebuild with FP8JAX_CUDA=ON)"
    return True, f"{name} (sm_{cc[0]}{cc[1]}): FP8 tensor cores"
