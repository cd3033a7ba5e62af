"""The FP8 formats and dtypes of :mod:`fp8jax.recipe`, which exports them (their public home):
:class:`Format`, :func:`fp8_max`, :func:`is_fp8_dtype`. A module of their own so that
``recipe.py`` holds the recipes."""

from __future__ import annotations

import enum
from typing import Any

import jax.numpy as jnp
import numpy as np

__all__ = ["E4M3", "E5M2", "Format", "fp8_max", "is_fp8_dtype"]

#: ``float8_e4m3fn`` and ``float8_e5m2`` as numpy dtypes.
E4M3 = jnp.dtype(jnp.float8_e4m3fn)
E5M2 = jnp.dtype(jnp.float8_e5m2)

# Largest finite value of each FP8 dtype.
_FP8_MAX: dict[np.dtype, float] = {E4M3: 448.0, E5M2: 57344.0}


def _as_dtype(dtype: Any) -> np.dtype | None:
    """Converts ``dtype`` to a numpy dtype, or returns ``None`` if it is not a dtype spelling."""
    if dtype is None or isinstance(dtype, bool):
        return None
    try:
        return jnp.dtype(dtype)
    except (TypeError, ValueError):
        return None


def is_fp8_dtype(dtype: Any) -> bool:
    """Returns whether ``dtype`` is one of :data:`FP8_DTYPES`.

    Accepts a numpy dtype, the scalar type (``jnp.float8_e4m3fn``) or its name. Other float8
    variants (``float8_e4m3fnuz``, ``float8_e4m3b11fnuz``, ...) are not FP8 dtypes of fp8jax and
    give ``False``, as does anything that is not a dtype at all.
    """
    return _as_dtype(dtype) in _FP8_MAX


def fp8_max(dtype: Any) -> float:
    """Returns the largest finite value of an FP8 dtype: 448.0 (E4M3) or 57344.0 (E5M2).

    Args:
      dtype: ``float8_e4m3fn`` or ``float8_e5m2``, as a numpy dtype, the scalar type
        (``jnp.float8_e4m3fn``) or its name.

    Raises:
      TypeError: if ``dtype`` is not one of :data:`FP8_DTYPES`.
    """
    dt = _as_dtype(dtype)
    if dt not in _FP8_MAX:
        raise TypeError(
            f"fp8_max: dtype must be float8_e4m3fn or float8_e5m2, got {dtype!r}"
            + (f" (dtype {dt})" if dt is not None and str(dt) != str(dtype) else "")
        )
    return _FP8_MAX[dt]


class Format(enum.Enum):
    """The FP8 formats of the forward and backward passes (as in TransformerEngine).

    - ``E4M3``: ``float8_e4m3fn`` in both passes.
    - ``E5M2``: ``float8_e5m2`` in both passes.
    - ``HYBRID``: ``float8_e4m3fn`` for the forward pass (activations, weights) and
      ``float8_e5m2`` for the backward pass (gradients), which need more range than precision.
    """

    E4M3 = "E4M3"
    E5M2 = "E5M2"
    HYBRID = "HYBRID"

    def __repr__(self) -> str:
        return f"{type(self).__name__}.{self.name}"

    @property
    def fwd_dtype(self) -> np.dtype:
        """The FP8 dtype of the forward pass."""
        return E5M2 if self is Format.E5M2 else E4M3

    @property
    def bwd_dtype(self) -> np.dtype:
        """The FP8 dtype of the backward pass (gradients)."""
        return E4M3 if self is Format.E4M3 else E5M2

    @property
    def fwd_max(self) -> float:
        """The largest finite value of :attr:`fwd_dtype`."""
        return _FP8_MAX[self.fwd_dtype]

    @property
    def bwd_max(self) -> float:
        """The largest finite value of :attr:`bwd_dtype`."""
        return _FP8_MAX[self.bwd_dtype]
