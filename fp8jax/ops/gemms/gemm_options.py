"""How fp8jax runs its FP8 GEMMs on a GPU: algorithm autotuning, the MLP's fused GELU epilogues,
the grouped GEMM's tensor cores, the row-wise GEMM on cuBLASLt, and which GEMMs are too small for
FP8 to pay.

Five choices, made in code with :func:`gemm_options` and held like
:func:`~fp8jax.ops.implementation`'s: in a :func:`jax.make_user_context` context (thread-local,
read while tracing, part of :func:`jax.jit`'s cache key, so a function traced under one choice
is traced again under another). No environment variable.

* ``autotune`` (default ``True``): the cuBLASLt GEMM (``cpp/cuda/gemm_cublaslt.cc``) times up
  to 8 of cuBLASLt's heuristic candidates the first time it meets a problem (shape, dtypes,
  scale modes, epilogue, operand alignments, device), outside any CUDA-graph capture, and keeps
  the fastest for the life of the process; ``False`` takes the heuristic's first answer, as
  fp8jax did before. It is the ``autotune`` attribute of the custom call: it changes the
  algorithm, never the definition of the result (different algorithms may sum in a different
  order, within the GEMM's stated tolerance). No effect on CPU, where the GEMM is XLA's dot.
* ``fused_epilogues`` (default ``False``: opt-in): :func:`fp8jax.layernorm_mlp` (and the
  Flax/NNX ``LayerNormMLP``) runs its first GEMM with cuBLASLt's GELU epilogue writing the FP8
  activation, its amax and the float16 GELU input, and its second GEMM's dgrad with the DGELU
  epilogue writing the FP8 activation gradient, its amax and the bias gradient
  (:mod:`fp8jax.ops.gemms.gemm_epilogue`), where that is the same computation: a ``"gelu"``
  activation, delayed scaling, bfloat16/float16 compute, no dropout, the ``"kernel"``
  implementation of the ``gemm`` family. ``False``: the separate activation kernels. Off by
  default: never run on a GPU yet, and on CPU, where its reference runs, the compiled step holds
  more temporaries than with the separate kernels (docs/performance.md, "The fused epilogues
  on CPU").
* ``grouped_tensor_cores`` (default ``False``: opt-in until a GPU run has checked its bits and
  speed): the ragged grouped GEMM of a mixture of experts (:func:`~fp8jax.ops.grouped_gemm`) runs
  on Hopper's tensor cores, CUTLASS's grouped GEMM with problem shapes and pointers written on
  the device (``cpp/sm90/grouped_gemm.cu``), where this install was built with CUTLASS, the GPU
  is an sm_90 one, the dtypes are among its instantiations and the dims are 16-aligned; anywhere
  else the CUDA-core kernel runs, as without the option. Its numerics are the tensor cores' (not
  the CUDA-core kernel's bits; docs/design.md states the tolerance).
* ``rowwise_cublaslt`` (default ``False``: opt-in until a GPU run has checked it): the row-wise
  GEMM of ``Float8RowwiseScaling`` (:func:`~fp8jax.ops.rowwise_gemm`, every GEMM of the layers
  under that recipe) runs on cuBLASLt's outer-vector scale mode (``OUTER_VEC_32F``, one float32
  scale per row of each operand) on an sm_90 GPU, with the ``"kernel"`` implementation of the
  ``gemm`` family; ``False``, or any other GPU: XLA's reference (the float32 dot of the FP8
  values scaled by the outer product of the row scales), as on CPU.
* ``min_fp8_flops`` (default ``0``: off): a layer call (``dense``, ``layernorm_dense``,
  ``layernorm_mlp`` and their modules) whose largest GEMM does fewer than this many FLOPs
  (``2 * M * N * K``) runs in its high-precision dtype, exactly as with FP8 off, because FP8
  does not pay there: on an H100 the FP8 GEMM measured 0.78x BF16 at 2048^3 (17 GFLOP) but 1.57x
  at 16384 x 4096 x 4096 (550 GFLOP) and 1.71x at 8192^3 (docs/performance.md). Off until a GPU
  run measures where the crossing lies (a layer's casts and state update move the point too).
  Its probe's gradient is zero, so its amax history records zeros (a layer always below the
  threshold keeps its initial scale).

>>> import fp8jax
>>> with fp8jax.ops.gemm_options(autotune=False, min_fp8_flops=2**36):
...     fp8jax.ops.get_gemm_options()  # doctest: +NORMALIZE_WHITESPACE
GemmOptions(autotune=False, fused_epilogues=False, min_fp8_flops=68719476736,
            grouped_tensor_cores=False, rowwise_cublaslt=False)
>>> fp8jax.ops.get_gemm_options().autotune
True
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

__all__ = ["GemmOptions", "gemm_options", "get_gemm_options"]


@dataclasses.dataclass(frozen=True)
class GemmOptions:
    """The GEMM choices of :func:`gemm_options` (hashable: part of jit's cache key)."""

    autotune: bool = True
    fused_epilogues: bool = False
    min_fp8_flops: int = 0
    grouped_tensor_cores: bool = False
    rowwise_cublaslt: bool = False


# Created once, at import (jax.make_user_context must not run concurrently with other JAX APIs).
_CONTEXT = jax.make_user_context(default_value=GemmOptions())


def _checked(changes: dict[str, Any]) -> dict[str, Any]:
    out = {}
    names = [f.name for f in dataclasses.fields(GemmOptions)]
    for name, value in changes.items():
        if name not in names:
            raise ValueError(f"gemm_options: unknown option {name!r}; the options are {names}")
        if name == "min_fp8_flops":
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 0:
                raise ValueError(
                    f"gemm_options: min_fp8_flops must be a non-negative int, got {value!r}"
                )
            value = int(value)
        elif not isinstance(value, (bool, np.bool_)):
            raise TypeError(f"gemm_options: {name} must be a bool, got {value!r}")
        out[name] = bool(value) if name != "min_fp8_flops" else value
    return out


class _Context(contextlib.ContextDecorator):
    """Enters the enclosing options with ``changes`` applied."""

    def __init__(self, changes: dict[str, Any]) -> None:
        self._changes = changes
        self._local = threading.local()  # per-thread stack of entered jax contexts

    def __enter__(self) -> None:
        stack = self._local.__dict__.setdefault("stack", [])
        ctx = _CONTEXT(dataclasses.replace(_CONTEXT.value, **self._changes))
        ctx.__enter__()
        stack.append(ctx)

    def __exit__(self, *exc_info: Any) -> None:
        self._local.stack.pop().__exit__(*exc_info)

    def __repr__(self) -> str:
        return f"gemm_options({', '.join(f'{k}={v!r}' for k, v in self._changes.items())})"


def gemm_options(**changes: Any) -> contextlib.AbstractContextManager[None]:
    """Context manager setting the GEMM options (module docstring) for the code traced inside.

    Args:
      **changes: ``autotune`` (bool), ``fused_epilogues`` (bool), ``min_fp8_flops`` (int >= 0),
        ``grouped_tensor_cores`` (bool), ``rowwise_cublaslt`` (bool);
        an option not named keeps the enclosing block's value (outside any block: the defaults
        of :class:`GemmOptions`).

    Returns:
      A context manager (also a decorator, reusable); the arguments are checked here.

    Raises:
      ValueError: an unknown option, or ``min_fp8_flops`` negative or not an int.
      TypeError: ``autotune``, ``fused_epilogues``, ``grouped_tensor_cores`` or
        ``rowwise_cublaslt`` not a bool.

    Enter it around the whole traced step (its backward pass too); blocks nest.
    """
    return _Context(_checked(changes))


def get_gemm_options() -> GemmOptions:
    """The options of the innermost :func:`gemm_options` block of this thread (the defaults
    outside any)."""
    return _CONTEXT.value


def below_fp8_flops(shapes: Sequence[tuple[int, int, int]]) -> bool:
    """Whether a layer whose GEMMs have ``(M, N, K)`` ``shapes`` runs in high precision under
    the current options: its largest GEMM does fewer than ``min_fp8_flops`` FLOPs (never when
    the option is 0, its default).

    >>> with gemm_options(min_fp8_flops=2 * 2048**3 + 1):
    ...     below_fp8_flops([(2048, 2048, 2048)]), below_fp8_flops([(4096, 2048, 2048)])
    (True, False)
    """
    limit = get_gemm_options().min_fp8_flops
    if limit <= 0:
        return False
    return max(2 * int(m) * int(n) * int(k) for m, n, k in shapes) < limit
