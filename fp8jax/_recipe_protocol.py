"""What a recipe says about itself (:class:`Recipe`, :class:`Scaling`) and the field checks the
recipes share. Exported by :mod:`fp8jax.recipe`, their public home; a module of its own so that
``recipe.py`` holds the recipes (docs/design.md, "Adding a recipe")."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, ClassVar

import numpy as np

from fp8jax._formats import Format

__all__ = [
    "GEMMS",
    "ROLES",
    "QParams",
    "Recipe",
    "Scaling",
    "check_bool",
    "check_epsilon",
    "check_format",
    "check_margin",
    "check_no_backward_override",
    "check_no_e5m2",
    "check_no_fp8_attention",
    "is_int",
]


class Scaling(str, enum.Enum):
    """How a recipe chooses its scales (:attr:`Recipe.scaling`).

    - ``DELAYED``: one scale per tensor, from a history of past amaxes kept as FP8 state.
    - ``CURRENT``: one scale per tensor, from the tensor's own amax (no state).
    - ``BLOCK``: one float32 scale per block (1 x 128 or 128 x 128) from the block's amax.
    - ``MXFP8``: one E8M0 (power-of-two) scale per block of 32 (or 32 x 32).
    - ``ROWWISE``: one float32 scale per row of each GEMM operand, along that GEMM's
      contraction dim, from the row's amax (no state): per token for the activations and
      gradients, per output (forward) or input (dgrad) feature for the weights.
    """

    DELAYED = "delayed"
    CURRENT = "current"
    BLOCK = "block"
    MXFP8 = "mxfp8"
    ROWWISE = "rowwise"

    def __repr__(self) -> str:
        return f"{type(self).__name__}.{self.name}"


#: The operand roles a recipe describes: a GEMM's input, its weight (kernel), the gradient.
ROLES: tuple[str, ...] = ("x", "w", "grad")
#: A layer's three GEMMs: the forward, the input gradient, the weight gradient.
GEMMS: tuple[str, ...] = ("fprop", "dgrad", "wgrad")


class Recipe:
    """Common base class of the scaling recipes; use one of its subclasses.

    A recipe describes itself; the layers, the FP8 state, autocast, the train helpers and the ops
    ask it rather than test its type. The protocol, which a new recipe class defines (class
    attributes and fields) or inherits (properties and methods):

    - ``fp8_format: Format`` (a field): the FP8 dtypes, read through :attr:`fwd_dtype`,
      :attr:`bwd_dtype` and :meth:`fp8_max`.
    - ``scaling: ClassVar[Scaling]``: how its scales are chosen.
    - :attr:`keeps_state`: whether layers keep FP8 state (amax history, scale) under it: with
      ``Scaling.DELAYED``, which then also defines ``amax_history_len``, ``margin``,
      ``amax_compute_algo`` and ``scaling_factor_compute_algo`` (read by the state update).
    - :attr:`per_tensor`: one scale per tensor (``DELAYED``, ``CURRENT``);
      :attr:`block_scaled`: one per block (``BLOCK``, ``MXFP8``); neither: one per row
      (``ROWWISE``).
    - :meth:`block` and :meth:`qparams`: per operand role (``"x"``, ``"w"``, ``"grad"``) the
      block shape and the :class:`QParams` (``None`` for a per-tensor recipe).
    - :meth:`fp8_gemm`: whether each of a layer's GEMMs (``"fprop"``, ``"dgrad"``,
      ``"wgrad"``) runs in FP8 (all of them unless the recipe says otherwise).
    - ``margin`` (optional field): divides per-tensor scales by ``2**margin`` (default 0).

    Arguments are checked to be recipes in one place, :func:`~fp8jax.recipe.check_recipe`.
    """

    fp8_format: Format
    scaling: ClassVar[Scaling]

    def __new__(cls, *args: Any, **kwargs: Any) -> Recipe:
        if cls is Recipe:
            raise TypeError(
                "Recipe is an abstract base class; use DelayedScaling, Float8CurrentScaling, "
                "Float8BlockScaling, MXFP8BlockScaling or Float8RowwiseScaling"
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

    @property
    def keeps_state(self) -> bool:
        """Whether layers keep FP8 state (an amax history and a scale per tensor) under this
        recipe: delayed scaling."""
        return self.scaling is Scaling.DELAYED

    @property
    def per_tensor(self) -> bool:
        """Whether one scale covers a whole tensor (delayed and current scaling)."""
        return self.scaling in (Scaling.DELAYED, Scaling.CURRENT)

    @property
    def block_scaled(self) -> bool:
        """Whether each block of a tensor gets its own scale (:meth:`block`)."""
        return self.scaling in (Scaling.BLOCK, Scaling.MXFP8)

    def _role(self, method: str, role: str) -> None:
        if role not in ROLES:
            owner = f"{type(self).__name__}.{method}"
            raise ValueError(f"{owner}: role must be x, w or grad, got {role!r}")

    def block(self, role: str) -> tuple[int, int] | None:
        """The block shape of operand ``role`` (``"x"``, ``"w"`` or ``"grad"``); ``None``: one
        scale per tensor (or per row)."""
        self._role("block", role)
        return None

    def qparams(self, role: str) -> QParams | None:
        """The :class:`QParams` of operand ``role`` under block or row-wise
        scaling; ``None`` otherwise."""
        self._role("qparams", role)
        return None

    def fp8_gemm(self, gemm: str) -> bool:
        """Whether a layer's GEMM ``gemm`` (``"fprop"``, ``"dgrad"`` or ``"wgrad"``) runs in
        FP8; ``False``: in the layer's compute dtype from the high-precision operands (TE's
        ``override_linear_precision``). All three by default."""
        if gemm not in GEMMS:
            owner = f"{type(self).__name__}.fp8_gemm"
            raise ValueError(f"{owner}: gemm must be fprop, dgrad or wgrad, got {gemm!r}")
        return True


# --- field validation shared by the recipes ---------------------------------------------------


def is_int(value: Any) -> bool:
    """Whether ``value`` is an int (a numpy integer too), not a bool."""
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


def check_bool(owner: str, name: str, value: Any) -> bool:
    """``value`` as a bool, or ``TypeError`` naming ``owner.name``."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{owner}.{name} must be a bool, got {value!r}")
    return bool(value)


def check_margin(owner: str, value: Any) -> int:
    """A non-negative int ``margin``."""
    if not is_int(value):
        raise TypeError(f"{owner}.margin must be a non-negative int, got {value!r}")
    if value < 0:
        raise ValueError(f"{owner}.margin must be a non-negative int, got {value!r}")
    return int(value)


def check_epsilon(owner: str, name: str, value: Any) -> float:
    """A finite non-negative float amax epsilon."""
    if not isinstance(value, (int, float, np.floating, np.integer)) or isinstance(value, bool):
        raise TypeError(f"{owner}.{name} must be a non-negative float, got {value!r}")
    if not (np.isfinite(value) and value >= 0):
        raise ValueError(f"{owner}.{name} must be a non-negative float, got {value!r}")
    return float(value)


def check_format(owner: str, value: Any) -> Format:
    """A :class:`Format` ``fp8_format``."""
    if not isinstance(value, Format):
        allowed = ", ".join(repr(f) for f in Format)
        raise TypeError(f"{owner}.fp8_format must be a Format ({allowed}), got {value!r}")
    return value


def check_no_e5m2(owner: str, value: Any) -> None:
    """A :class:`Format` other than pure E5M2 (the block and row-wise recipes)."""
    check_format(owner, value)
    if value is Format.E5M2:
        raise ValueError(
            f"{owner}.fp8_format=Format.E5M2 is not supported: pure E5M2 training is not "
            "supported (allowed: Format.E4M3, Format.HYBRID)"
        )


def check_no_backward_override(owner: str, value: Any) -> None:
    """TransformerEngine's ``backward_override``: ``None`` only."""
    if value is not None:
        raise ValueError(
            f"{owner}.backward_override={value!r} is not supported: fp8jax runs the backward "
            "GEMMs in FP8 (allowed: None, TransformerEngine's default)"
        )


def check_no_fp8_attention(owner: str, recipe: Any, why: str) -> None:
    """``fp8_dpa`` and ``fp8_mha`` of ``recipe`` must be bools, and ``False`` (``why`` not)."""
    for name in ("fp8_dpa", "fp8_mha"):
        object.__setattr__(recipe, name, check_bool(owner, name, getattr(recipe, name)))
        if getattr(recipe, name):
            raise ValueError(
                f"{owner}.{name}=True is not supported: FP8 attention is {why} (allowed: False)"
            )


@dataclasses.dataclass(frozen=True, kw_only=True)
class QParams:
    """How one kind of tensor is quantized under a block-scaled or row-wise recipe
    (TransformerEngine's ``QParams``; :meth:`Recipe.qparams`).

    Attributes:
      power_2_scale: Round each block's (row's) scale down to a power of two (exact inverse
        scales, and the same scales MXFP8 hardware would pick).
      amax_epsilon: Non-negative float; a block (row) amax below it is raised to it before the
        scale is computed.

    TE's fields for NVFP4 (``random_hadamard_transform``, ``stochastic_rounding``,
    ``fp4_2d_quantization``) are not FP8 settings and are not accepted.
    """

    power_2_scale: bool = False
    amax_epsilon: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "power_2_scale", check_bool("QParams", "power_2_scale", self.power_2_scale)
        )
        eps = check_epsilon("QParams", "amax_epsilon", self.amax_epsilon)
        object.__setattr__(self, "amax_epsilon", eps)
