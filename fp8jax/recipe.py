"""FP8 formats and scaling recipes.

A *recipe* says which FP8 formats a layer computes with and how the per-tensor scaling factors are
chosen. Recipes are small frozen, validated, hashable dataclasses: they can be passed as static
arguments to :func:`jax.jit` and are part of the :mod:`fp8jax.autocast` state, which is itself part
of jit's cache key.

The field names and defaults follow NVIDIA TransformerEngine, so TE code ports by changing imports.
What a recipe means to the rest of fp8jax (state or none, per-tensor or block scales) it says
itself (:class:`Recipe`); nothing outside this module tests a recipe's type.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np

from fp8jax._formats import E4M3, E5M2, Format, fp8_max, is_fp8_dtype

__all__ = [
    "FP8_DTYPES",
    "DelayedScaling",
    "Float8BlockScaling",
    "Float8CurrentScaling",
    "Format",
    "MMParams",
    "MXFP8BlockScaling",
    "QParams",
    "Recipe",
    "Scaling",
    "check_recipe",
    "fp8_max",
    "is_fp8_dtype",
]

#: The FP8 dtypes fp8jax computes with: ``float8_e4m3fn`` and ``float8_e5m2``.
FP8_DTYPES: tuple[np.dtype, ...] = (E4M3, E5M2)


class Scaling(str, enum.Enum):
    """How a recipe chooses its scales (:attr:`Recipe.scaling`).

    - ``DELAYED``: one scale per tensor, from a history of past amaxes kept as FP8 state.
    - ``CURRENT``: one scale per tensor, from the tensor's own amax (no state).
    - ``BLOCK``: one float32 scale per block (1 x 128 or 128 x 128) from the block's amax.
    - ``MXFP8``: one E8M0 (power-of-two) scale per block of 32 (or 32 x 32).
    """

    DELAYED = "delayed"
    CURRENT = "current"
    BLOCK = "block"
    MXFP8 = "mxfp8"

    def __repr__(self) -> str:
        return f"{type(self).__name__}.{self.name}"


_ROLES = ("x", "w", "grad")


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
    - :attr:`block_scaled`: whether its scales are per block (``Scaling.BLOCK``, ``MXFP8``).
    - :meth:`block` and :meth:`qparams`: per operand role (``"x"``, ``"w"``, ``"grad"``) the
      block shape and the :class:`QParams` (``None`` for a per-tensor recipe).
    - ``margin`` (optional field): divides per-tensor scales by ``2**margin`` (default 0).

    Arguments are checked to be recipes in one place, :func:`check_recipe`.
    """

    fp8_format: Format
    scaling: ClassVar[Scaling]

    def __new__(cls, *args: Any, **kwargs: Any) -> Recipe:
        if cls is Recipe:
            raise TypeError(
                "Recipe is an abstract base class; use DelayedScaling, Float8CurrentScaling, "
                "Float8BlockScaling or MXFP8BlockScaling"
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
    def block_scaled(self) -> bool:
        """Whether each block of a tensor gets its own scale (:meth:`block`)."""
        return self.scaling in (Scaling.BLOCK, Scaling.MXFP8)

    def _role(self, method: str, role: str) -> None:
        if role not in _ROLES:
            owner = f"{type(self).__name__}.{method}"
            raise ValueError(f"{owner}: role must be x, w or grad, got {role!r}")

    def block(self, role: str) -> tuple[int, int] | None:
        """The block shape of operand ``role`` (``"x"``, ``"w"`` or ``"grad"``); ``None``: one
        scale per tensor."""
        self._role("block", role)
        return None

    def qparams(self, role: str) -> QParams | None:
        """The :class:`QParams` of operand ``role`` under block scaling; ``None`` otherwise."""
        self._role("qparams", role)
        return None


def check_recipe(value: Any, argname: str, *, default: Recipe | None = None,
                 keeps_state: bool = False) -> Recipe:  # fmt: skip
    """``value`` if it is a :class:`Recipe`, else ``TypeError`` naming ``argname`` (e.g.
    ``"autocast: recipe"``): the one place fp8jax checks that an argument is a recipe.

    ``default``: what ``None`` stands for (``None`` is then allowed). ``keeps_state``: the
    recipe must keep FP8 state (:attr:`Recipe.keeps_state`: DelayedScaling).
    """
    if value is None and default is not None:
        return default
    is_recipe = isinstance(value, Recipe)
    if keeps_state and not (is_recipe and value.keeps_state):
        raise TypeError(
            f"{argname} must be a DelayedScaling (the recipe that keeps FP8 state: an amax "
            f"history per tensor), got {value!r} of type {type(value).__name__}"
        )
    if not is_recipe:
        raise TypeError(
            f"{argname} must be {'None or ' if default is not None else ''}a "
            "fp8jax.recipe.Recipe (DelayedScaling, Float8CurrentScaling, Float8BlockScaling or "
            f"MXFP8BlockScaling), got {value!r} of type {type(value).__name__}"
        )
    return value


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


def _check_no_fp8_attention(owner: str, recipe: Any, why: str) -> None:
    """``fp8_dpa`` and ``fp8_mha`` of ``recipe`` must be bools, and ``False`` (``why`` not)."""
    for name in ("fp8_dpa", "fp8_mha"):
        object.__setattr__(recipe, name, _check_bool(owner, name, getattr(recipe, name)))
        if getattr(recipe, name):
            raise ValueError(
                f"{owner}.{name}=True is not supported: FP8 attention is {why} (allowed: False)"
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
      fp8_dpa: FP8 dot-product attention: in fp8jax an attribute of the attention modules
        (``DotProductAttention``, ``MultiHeadAttention``, ``TransformerLayer``), so here it
        must be ``False``.
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

    scaling: ClassVar[Scaling] = Scaling.DELAYED
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

        set_("reduce_amax", _check_bool(owner, "reduce_amax", self.reduce_amax))
        if not self.reduce_amax:
            raise ValueError(
                f"{owner}.reduce_amax=False is not supported: fp8jax keeps one FP8 state, "
                "replicated on every device, so every amax is reduced over the devices that "
                "share its tensor (allowed: True)"
            )
        _check_no_fp8_attention(
            owner, self, "set on the attention modules in fp8jax, not on the recipe "
            "(fp8_dpa=True of DotProductAttention, MultiHeadAttention, TransformerLayer; "
            "fp8_mha is not implemented)",
        )  # fmt: skip


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

    scaling: ClassVar[Scaling] = Scaling.CURRENT
    fp8_format: Format = Format.HYBRID
    margin: int = 0
    backward_override: str | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self) -> None:
        owner = type(self).__name__
        _check_backward_override(owner, self.backward_override)
        _check_format(owner, self.fp8_format)
        object.__setattr__(self, "margin", _check_margin(owner, self.margin))


# --- block scaling ------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class QParams:
    """How one kind of tensor is quantized under :class:`Float8BlockScaling` (TransformerEngine's
    ``QParams``).

    Attributes:
      power_2_scale: Round each block's scale down to a power of two (exact inverse scales,
        and the same scales MXFP8 hardware would pick).
      amax_epsilon: Non-negative float; a block amax below it is raised to it before the scale
        is computed.

    TE's fields for NVFP4 (``random_hadamard_transform``, ``stochastic_rounding``,
    ``fp4_2d_quantization``) are not FP8 settings and are not accepted.
    """

    power_2_scale: bool = False
    amax_epsilon: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(
            self, "power_2_scale", _check_bool("QParams", "power_2_scale", self.power_2_scale)
        )
        eps = self.amax_epsilon
        if not isinstance(eps, (int, float, np.floating, np.integer)) or isinstance(eps, bool):
            raise TypeError(f"QParams.amax_epsilon must be a non-negative float, got {eps!r}")
        if not (np.isfinite(eps) and eps >= 0):
            raise ValueError(f"QParams.amax_epsilon must be a non-negative float, got {eps!r}")
        object.__setattr__(self, "amax_epsilon", float(eps))


@dataclasses.dataclass(frozen=True, kw_only=True)
class MMParams:
    """GEMM settings of a recipe (TransformerEngine's ``MMParams``).

    Attributes:
      use_split_accumulator: Accumulate in full float32 (cuBLASLt without ``FAST_ACCUM``).
        Block-scaled GEMMs require it (``True``).
    """

    use_split_accumulator: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(
            self,
            "use_split_accumulator",
            _check_bool("MMParams", "use_split_accumulator", self.use_split_accumulator),
        )


def _check_block_format(owner: str, value: Any) -> None:
    _check_format(owner, value)
    if value is Format.E5M2:
        raise ValueError(
            f"{owner}.fp8_format=Format.E5M2 is not supported: pure E5M2 training is not "
            "supported (allowed: Format.E4M3, Format.HYBRID)"
        )


@dataclasses.dataclass(frozen=True, kw_only=True)
class Float8BlockScaling(Recipe):
    """Block scaling as in DeepSeek-V3 (TransformerEngine's ``Float8BlockScaling``): every
    block of a tensor gets its own scale from its own amax, computed when it is quantized (no
    state, no history).

    Attributes:
      use_f32_scales: Keep each scale as computed (``fp8_max / amax`` in float32) instead of
        rounding it down to a power of two; sets the default ``power_2_scale`` of the three
        ``fp8_quant_*`` fields.
      fp8_format: ``Format.E4M3`` (default: activations, weights and gradients in E4M3) or
        ``Format.HYBRID`` (gradients in E5M2).
      fp8_quant_fwd_inp, fp8_quant_fwd_weight, fp8_quant_bwd_grad: :class:`QParams` of the
        inputs, the weights and the output gradients (default: power-of-two scales unless
        ``use_f32_scales``, no epsilon).
      x_block_scaling_dim, w_block_scaling_dim, grad_block_scaling_dim: 1 for 1 x 128 blocks
        (128 consecutive elements along the contraction dim), 2 for 128 x 128 blocks; the
        defaults are DeepSeek-V3's (1, 2, 1). No GEMM may take two 2-D operands.
      fp8_gemm_fprop, fp8_gemm_dgrad, fp8_gemm_wgrad: :class:`MMParams`; split accumulation is
        required.
      fp8_dpa, fp8_mha: FP8 attention; not supported (``False``).
      backward_override: ``None`` only.

    Scale rule (per block): ``scale = fp8_max / max(amax, amax_epsilon)``, 1 for an amax of 0,
    inf or NaN, rounded down to a power of two by default (docs/numerics.md, "Block scaling").

    >>> Float8BlockScaling()  # doctest: +NORMALIZE_WHITESPACE
    Float8BlockScaling(use_f32_scales=False, fp8_format=Format.E4M3,
        fp8_quant_fwd_inp=QParams(power_2_scale=True, amax_epsilon=0.0),
        fp8_quant_fwd_weight=QParams(power_2_scale=True, amax_epsilon=0.0),
        fp8_quant_bwd_grad=QParams(power_2_scale=True, amax_epsilon=0.0),
        x_block_scaling_dim=1, w_block_scaling_dim=2, grad_block_scaling_dim=1)
    """

    scaling: ClassVar[Scaling] = Scaling.BLOCK
    use_f32_scales: bool = False
    fp8_format: Format = Format.E4M3
    fp8_quant_fwd_inp: QParams | None = None
    fp8_quant_fwd_weight: QParams | None = None
    fp8_quant_bwd_grad: QParams | None = None
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1
    fp8_gemm_fprop: MMParams = dataclasses.field(default=MMParams(), repr=False)
    fp8_gemm_dgrad: MMParams = dataclasses.field(default=MMParams(), repr=False)
    fp8_gemm_wgrad: MMParams = dataclasses.field(default=MMParams(), repr=False)
    fp8_dpa: bool = dataclasses.field(default=False, repr=False)
    fp8_mha: bool = dataclasses.field(default=False, repr=False)
    backward_override: str | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self) -> None:
        owner = type(self).__name__
        set_ = lambda name, value: object.__setattr__(self, name, value)
        _check_backward_override(owner, self.backward_override)
        set_("use_f32_scales", _check_bool(owner, "use_f32_scales", self.use_f32_scales))
        _check_block_format(owner, self.fp8_format)
        for name in ("fp8_quant_fwd_inp", "fp8_quant_fwd_weight", "fp8_quant_bwd_grad"):
            value = getattr(self, name)
            if value is None:
                set_(name, QParams(power_2_scale=not self.use_f32_scales))
            elif not isinstance(value, QParams):
                raise TypeError(f"{owner}.{name} must be a QParams or None, got {value!r}")
        dims = {}
        for role in ("x", "w", "grad"):
            name = f"{role}_block_scaling_dim"
            value = getattr(self, name)
            if not _is_int(value):
                raise TypeError(f"{owner}.{name} must be 1 or 2, got {value!r}")
            if value not in (1, 2):
                raise ValueError(
                    f"{owner}.{name} must be 1 (1 x 128) or 2 (128 x 128), got {value!r}"
                )
            dims[role] = int(value)
            set_(name, int(value))
        for gemm, (p, q) in {
            "fprop": ("x", "w"),
            "wgrad": ("x", "grad"),
            "dgrad": ("w", "grad"),
        }.items():
            if dims[p] == 2 and dims[q] == 2:
                raise ValueError(
                    f"{owner}: {p}_block_scaling_dim=2 with {q}_block_scaling_dim=2 would make "
                    f"the {gemm} GEMM take two 128 x 128-block operands, which is not supported "
                    "(at most one 2-D operand per GEMM)"
                )
        for name in ("fp8_gemm_fprop", "fp8_gemm_dgrad", "fp8_gemm_wgrad"):
            value = getattr(self, name)
            if not isinstance(value, MMParams):
                raise TypeError(f"{owner}.{name} must be an MMParams, got {value!r}")
            if not value.use_split_accumulator:
                raise ValueError(
                    f"{owner}.{name}.use_split_accumulator=False is not supported: block-scaled "
                    "GEMMs accumulate in full float32 (allowed: True)"
                )
        _check_no_fp8_attention(owner, self, f"not supported with {owner}")

    def block(self, role: str) -> tuple[int, int]:
        """The block shape of ``role`` (``"x"``, ``"w"`` or ``"grad"``): ``(1, 128)`` or
        ``(128, 128)``."""
        self._role("block", role)
        dim = getattr(self, f"{role}_block_scaling_dim")
        return (1, 128) if dim == 1 else (128, 128)

    def qparams(self, role: str) -> QParams:
        """The :class:`QParams` of ``role``: ``fp8_quant_fwd_inp`` (``"x"``),
        ``fp8_quant_fwd_weight`` (``"w"``) or ``fp8_quant_bwd_grad`` (``"grad"``)."""
        self._role("qparams", role)
        name = {"x": "fwd_inp", "w": "fwd_weight", "grad": "bwd_grad"}[role]
        return getattr(self, f"fp8_quant_{name}")


@dataclasses.dataclass(frozen=True, kw_only=True)
class MXFP8BlockScaling(Recipe):
    """MXFP8 (TransformerEngine's ``MXFP8BlockScaling``): every 32 consecutive elements along
    the contraction dim share one power-of-two scale stored as E8M0, computed when the tensor
    is quantized (no state). The row-wise and the transposed copy of a tensor are both
    quantized from its high-precision values.

    Attributes:
      margin: Accepted for TransformerEngine compatibility and unused (as in TE): the E8M0 rule
        below leaves no margin to choose.
      fp8_format: ``Format.E4M3`` (default) or ``Format.HYBRID`` (gradients in E5M2).
      enable_2d_quantization: 32 x 32 blocks for the weights.
      fp8_dpa, fp8_mha: FP8 attention; not supported (``False``).
      backward_override: ``None`` only.

    Scale rule (per block): ``2**ceil(log2(amax / fp8_max))`` (the E8M0 exponent of
    ``amax * (1 / fp8_max)`` rounded up), so ``|x / scale| <= fp8_max``.

    >>> MXFP8BlockScaling()
    MXFP8BlockScaling(margin=0, fp8_format=Format.E4M3, enable_2d_quantization=False)
    """

    scaling: ClassVar[Scaling] = Scaling.MXFP8
    margin: int = 0
    fp8_format: Format = Format.E4M3
    enable_2d_quantization: bool = False
    fp8_dpa: bool = dataclasses.field(default=False, repr=False)
    fp8_mha: bool = dataclasses.field(default=False, repr=False)
    backward_override: str | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self) -> None:
        owner = type(self).__name__
        _check_backward_override(owner, self.backward_override)
        object.__setattr__(self, "margin", _check_margin(owner, self.margin))
        _check_block_format(owner, self.fp8_format)
        object.__setattr__(
            self,
            "enable_2d_quantization",
            _check_bool(owner, "enable_2d_quantization", self.enable_2d_quantization),
        )
        _check_no_fp8_attention(owner, self, f"not supported with {owner}")

    def block(self, role: str) -> tuple[int, int]:
        """The block shape of ``role`` (``"x"``, ``"w"`` or ``"grad"``): ``(1, 32)``, or
        ``(32, 32)`` for ``"w"`` with ``enable_2d_quantization``."""
        self._role("block", role)
        return (32, 32) if role == "w" and self.enable_2d_quantization else (1, 32)

    def qparams(self, role: str) -> QParams:
        """The :class:`QParams` of ``role``: power-of-two (E8M0) scales, no epsilon, any role."""
        self._role("qparams", role)
        return QParams(power_2_scale=True)
