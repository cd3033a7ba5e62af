"""FP8 formats and scaling recipes.

A *recipe* says which FP8 formats a layer computes with and how the per-tensor scaling factors are
chosen. Recipes are small frozen, validated, hashable dataclasses: they can be passed as static
arguments to :func:`jax.jit` and are part of the :mod:`fp8jax.autocast` state, which is itself part
of jit's cache key.

The field names and defaults follow NVIDIA TransformerEngine, so TE code ports by changing imports.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np

__all__ = [
    "FP8_DTYPES",
    "DelayedScaling",
    "Float8CurrentScaling",
    "Format",
    "Recipe",
    "fp8_max",
    "is_fp8_dtype",
]

_E4M3 = jnp.dtype(jnp.float8_e4m3fn)
_E5M2 = jnp.dtype(jnp.float8_e5m2)

#: The FP8 dtypes fp8jax computes with: ``float8_e4m3fn`` and ``float8_e5m2``.
FP8_DTYPES: tuple[np.dtype, ...] = (_E4M3, _E5M2)

# Largest finite value of each FP8 dtype.
_FP8_MAX: dict[np.dtype, float] = {_E4M3: 448.0, _E5M2: 57344.0}


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
        return _E5M2 if self is Format.E5M2 else _E4M3

    @property
    def bwd_dtype(self) -> np.dtype:
        """The FP8 dtype of the backward pass (gradients)."""
        return _E4M3 if self is Format.E4M3 else _E5M2

    @property
    def fwd_max(self) -> float:
        """The largest finite value of :attr:`fwd_dtype`."""
        return _FP8_MAX[self.fwd_dtype]

    @property
    def bwd_max(self) -> float:
        """The largest finite value of :attr:`bwd_dtype`."""
        return _FP8_MAX[self.bwd_dtype]


class Recipe:
    """Common base class of the scaling recipes; use one of its subclasses.

    Every subclass has a ``fp8_format: Format`` field.
    """

    fp8_format: Format

    def __new__(cls, *args: Any, **kwargs: Any) -> Recipe:
        if cls is Recipe:
            raise TypeError(
                "Recipe is an abstract base class; use DelayedScaling or Float8CurrentScaling"
            )
        return super().__new__(cls)

    @property
    def fwd_dtype(self) -> np.dtype:
        """The FP8 dtype of the forward pass."""
        return self.fp8_format.fwd_dtype

    @property
    def bwd_dtype(self) -> np.dtype:
        """The FP8 dtype of the backward pass (gradients)."""
        return self.fp8_format.bwd_dtype

    def fp8_max(self, backward: bool = False) -> float:
        """The largest finite value of the backward (``backward=True``) or forward FP8 dtype."""
        return self.fp8_format.bwd_max if backward else self.fp8_format.fwd_max


# --- field validation shared by the recipes ---------------------------------------------------


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def _check_bool(owner: str, name: str, value: Any) -> bool:
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{owner}.{name} must be a bool, got {value!r}")
    return bool(value)


def _check_margin(owner: str, value: Any) -> int:
    if not _is_int(value):
        raise TypeError(f"{owner}.margin must be a non-negative int, got {value!r}")
    if value < 0:
        raise ValueError(f"{owner}.margin must be a non-negative int, got {value!r}")
    return int(value)


def _check_format(owner: str, value: Any) -> Format:
    if not isinstance(value, Format):
        allowed = ", ".join(repr(f) for f in Format)
        raise TypeError(f"{owner}.fp8_format must be a Format ({allowed}), got {value!r}")
    return value


def _check_hashable_callable(owner: str, name: str, value: Any, allowed: str) -> None:
    if not callable(value):
        raise TypeError(f"{owner}.{name} must be {allowed}, got {value!r}")
    try:
        hash(value)
    except TypeError:
        raise TypeError(
            f"{owner}.{name} must be hashable (recipes are jit cache keys), got {value!r}"
        ) from None


_AMAX_ALGOS = ("max", "most_recent")


def _check_backward_override(owner: str, value: Any) -> None:
    if value is not None:
        raise ValueError(
            f"{owner}.backward_override={value!r} is not supported: fp8jax runs the backward "
            "GEMMs in FP8 (allowed: None, TransformerEngine's default)"
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class DelayedScaling(Recipe):
    """Delayed scaling: each tensor's scale comes from a rolling history of past amaxes.

    The field names and defaults are TransformerEngine's. All fields are keyword-only, validated on
    construction (``TypeError`` for a wrong type, ``ValueError`` for a wrong value), and the recipe
    is frozen and hashable, so it can be a static argument of :func:`jax.jit`.

    Attributes:
      margin: Non-negative int. The scale is divided by ``2**margin``, leaving that many binary
        orders of magnitude of headroom above the reduced amax.
      fp8_format: The :class:`Format` of the forward and backward passes (default
        ``Format.HYBRID``: E4M3 forward, E5M2 backward).
      amax_history_len: Length (>= 1) of the rolling amax history kept per quantized tensor.
      amax_compute_algo: How the history is reduced to one amax: ``"max"`` (maximum over the whole
        history), ``"most_recent"`` (the newest entry, index 0), or a callable taking the
        ``float32[amax_history_len]`` history (newest at index 0) and returning a scalar amax.
      scaling_factor_compute_algo: ``None`` for the standard rule below, or a callable
        ``(amax, old_scale, fp8_max, recipe) -> new_scale`` that replaces it.
      reduce_amax: Whether the amax is reduced (max) over the devices that share a tensor
        before it enters the history, so that all of them compute the same scale. Must be
        ``True``: fp8jax keeps one FP8 state, replicated on every device, which per-device
        amaxes would break. (Each step's reductions are merged into one all-reduce.)
      fp8_dpa: FP8 dot-product attention. Not implemented yet: must be ``False``.
      fp8_mha: FP8 multi-head attention (projections kept in FP8). Not implemented yet: must be
        ``False``.
      backward_override: TransformerEngine's backward precision mode; ``None`` only (as TE
        requires for delayed scaling).

    The update, per quantized tensor (input, kernel, output gradient of each GEMM), each step:

    0. the tensor is quantized with the *current* scale, i.e. the one computed from the history
       *before* this step's amax;
    1. this step's amax is written into the newest slot (index 0) of the history; every older
       value moves one slot back and the oldest falls off the end;
    2. the history is reduced with ``amax_compute_algo``;
    3. ``scale = fp8_max / (amax_reduced * 2**margin)``, computed in float32 as
       ``(fp8_max / amax_reduced) * 2**-margin``, where ``fp8_max`` is that of the pass's dtype
       (448 for E4M3, 57344 for E5M2). If ``amax_reduced`` is 0, inf or NaN the old scale is
       kept; if the new scale overflows to inf it is clamped to the float32 maximum (as TE does).
       ``scaling_factor_compute_algo``, when given, replaces this step.

    Worked example, forward E4M3 tensor (``fp8_max = 448``), ``amax_history_len=2``,
    ``margin=0``, starting from a zero history and scale 1:

    ====  =========  ================  ============  ==========  =================
    step  quantized  amax observed     history       "max"       "most_recent"
          with                         after step    new scale   new scale
    ====  =========  ================  ============  ==========  =================
    1     1.0        2.0               [2, 0]        224         224
    2     224        4.0               [4, 2]        112         112
    3     112        1.0               [1, 4]        112         448
    ====  =========  ================  ============  ==========  =================

    (with ``"max"`` the scale used by step 4 is still 112; with ``margin=1`` every new scale
    is halved.)

    Example:

    >>> from fp8jax.recipe import DelayedScaling, Format
    >>> DelayedScaling(amax_history_len=16)  # doctest: +NORMALIZE_WHITESPACE
    DelayedScaling(margin=0, fp8_format=Format.HYBRID, amax_history_len=16,
        amax_compute_algo='max', scaling_factor_compute_algo=None, reduce_amax=True,
        fp8_dpa=False, fp8_mha=False)
    >>> DelayedScaling().fp8_max(backward=True)
    57344.0
    """

    margin: int = 0
    fp8_format: Format = Format.HYBRID
    amax_history_len: int = 1024
    amax_compute_algo: str | Callable[..., Any] = "max"
    scaling_factor_compute_algo: Callable[..., Any] | None = None
    reduce_amax: bool = True
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: str | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self) -> None:
        owner = type(self).__name__
        set_ = lambda name, value: object.__setattr__(self, name, value)
        _check_backward_override(owner, self.backward_override)

        set_("margin", _check_margin(owner, self.margin))
        _check_format(owner, self.fp8_format)

        n = self.amax_history_len
        if not _is_int(n):
            raise TypeError(f"{owner}.amax_history_len must be an int >= 1, got {n!r}")
        if n < 1:
            raise ValueError(f"{owner}.amax_history_len must be an int >= 1, got {n!r}")
        set_("amax_history_len", int(n))

        algo = self.amax_compute_algo
        allowed_algos = " or ".join(repr(a) for a in _AMAX_ALGOS)
        if isinstance(algo, str):
            if algo not in _AMAX_ALGOS:
                raise ValueError(
                    f"{owner}.amax_compute_algo must be {allowed_algos} or a callable, got {algo!r}"
                )
        else:
            _check_hashable_callable(
                owner, "amax_compute_algo", algo, f"{allowed_algos} or a callable"
            )

        if self.scaling_factor_compute_algo is not None:
            _check_hashable_callable(
                owner,
                "scaling_factor_compute_algo",
                self.scaling_factor_compute_algo,
                "None or a callable (amax, old_scale, fp8_max, recipe) -> new_scale",
            )

        for name in ("reduce_amax", "fp8_dpa", "fp8_mha"):
            set_(name, _check_bool(owner, name, getattr(self, name)))
        if not self.reduce_amax:
            raise ValueError(
                f"{owner}.reduce_amax=False is not supported: fp8jax keeps one FP8 state, "
                "replicated on every device, so every amax is reduced over the devices that "
                "share its tensor (allowed: True)"
            )
        for name in ("fp8_dpa", "fp8_mha"):
            if getattr(self, name):
                raise ValueError(
                    f"{owner}.{name}=True is not supported: FP8 attention is not implemented yet "
                    f"in this version of fp8jax (allowed: False)"
                )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Float8CurrentScaling(Recipe):
    """Current (just-in-time) scaling: each tensor's scale comes from its own amax, no history.

    For every quantization the amax of the tensor being quantized is computed first and
    ``scale = fp8_max / (amax * 2**margin)`` is used right away; there is no state carried
    between steps.

    Attributes:
      fp8_format: The :class:`Format` of the forward and backward passes (default
        ``Format.HYBRID``: E4M3 forward, E5M2 backward).
      margin: Non-negative int; the scale is divided by ``2**margin``.
      backward_override: TransformerEngine's backward precision mode (``"high_precision"``,
        ``"dequantized"``); not implemented: ``None`` only.

    >>> Float8CurrentScaling()
    Float8CurrentScaling(fp8_format=Format.HYBRID, margin=0)
    """

    fp8_format: Format = Format.HYBRID
    margin: int = 0
    backward_override: str | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self) -> None:
        owner = type(self).__name__
        _check_backward_override(owner, self.backward_override)
        _check_format(owner, self.fp8_format)
        object.__setattr__(self, "margin", _check_margin(owner, self.margin))
