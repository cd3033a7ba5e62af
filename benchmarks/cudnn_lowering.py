"""Lowering cuDNN's attention for CUDA on a machine without a GPU (the cost model, CI).

While tracing, JAX's cuDNN attention asks the machine for cuDNN's version
(``check_cudnn_version``: a CPU-only jaxlib has no cuDNN) and the GPU's compute capability
(``check_compute_capability``, ``is_cuda_compute_capability_equal``: the default backend's
devices), and fp8jax asks whether the default backend is a GPU
(``fp8jax.ops.attention.fp8_attention.gpu_backend``, which ``fp8jax.layers.attention_backend``
reads too). :func:`cudnn_without_gpu` substitutes an H100's answers for all four (cuDNN 9.8.0,
compute capability 9.0, a GPU backend), so that ``jax.jit(...).trace(...).lower(
lowering_platforms=("cuda",))`` writes cuDNN's custom calls as a GPU would. The substitution is
a guess of the device, not a check of it: what is traced inside may only be lowered, never run.

    with cudnn_without_gpu():
        hlo = cost_model.lowered_hlo(step, state, batch)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import jax

from fp8jax.ops.attention import fp8_attention

#: The device :func:`cudnn_without_gpu` claims: cuDNN 9.8.0 (as ``cudnn_get_version`` spells it)
#: on compute capability 9.0 (an H100).
CUDNN_VERSION = 90800
CAPABILITY = (9, 0)

# Part of jax.jit's cache key (made at import, as fp8jax's own contexts): a function traced with
# the substitution is traced again without it, and the other way round.
_SUBSTITUTED = jax.make_user_context(default_value=False)


def _capability(c: str) -> tuple[int, ...]:
    return tuple(int(x) for x in c.split("."))


@contextlib.contextmanager
def cudnn_without_gpu() -> Iterator[None]:
    """Within: JAX's and fp8jax's device checks answer as an H100 would (module docstring)."""
    from jax._src.cudnn import fused_attention_stablehlo as fa  # the checks JAX reads

    patches = [
        (fa, "check_cudnn_version", lambda: CUDNN_VERSION),
        (fa, "check_compute_capability", lambda c: CAPABILITY >= _capability(c)),
        (fa, "is_cuda_compute_capability_equal", lambda c: CAPABILITY == _capability(c)),
        (fp8_attention, "gpu_backend", lambda: True),
    ]
    saved = [(obj, name, getattr(obj, name)) for obj, name, _ in patches]
    for obj, name, value in patches:
        setattr(obj, name, value)
    try:
        with _SUBSTITUTED(True):
            yield
    finally:
        for obj, name, value in saved:
            setattr(obj, name, value)
