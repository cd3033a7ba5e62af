"""FP8 formats and scaling recipes.

A *recipe* says which FP8 formats a layer computes with and how the per-tensor scaling factors are
chosen. Recipes are small frozen, validated, hashable dataclasses: they can be passed as static
arguments to :func:`jax.jit` and are part of the :mod:`fp8jax.autocast` state, which is itself part
of jit's cache key.

The field names and defaults follow NVIDIA TransformerEngine, so TE code ports by changing imports.
What a recipe means to the rest of fp8jax (state or none, per-tensor, block or row scales) it says
itself (:class:`Recipe`, defined with :class:`Scaling`, :class:`QParams` and the field checks in
``fp8jax/_recipe_protocol.py``); nothing outside this module tests a recipe's type.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, ClassVar

import numpy as np

from fp8jax._formats import E4M3, E5M2, Format, fp8_max, is_fp8_dtype
from fp8jax._recipe_protocol import (
    QParams,
    Recipe,
    Scaling,
    check_bool,
    check_epsilon,
    check_format,
    check_margin,
    check_no_backward_override,
    check_no_e5m2,
    check_no_fp8_attention,
    is_int,
)

__all__ = [
    "FP8_DTYPES",
    "DelayedScaling",
    "Float8BlockScaling",
    "Float8CurrentScaling",
    "Float8RowwiseScaling",
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
        kinds = ("DelayedScaling, Float8CurrentScaling, Float8BlockScaling, MXFP8BlockScaling or "
                 "Float8RowwiseScaling")  # fmt: skip
        raise TypeError(
            f"{argname} must be {'None or ' if default is not None else ''}a "
            f"fp8jax.recipe.Recipe ({kinds}), got {value!r} of type {type(value).__name__}"
        )
    return value


_AMAX_ALGOS = ("max", "most_recent")


def _check_hashable_callable(owner: str, name: str, value: Any, allowed: str) -> None:
    if not callable(value):
        raise TypeError(f"{owner}.{name} must be {allowed}, got {value!r}")
    try:
        hash(value)
    except TypeError:
        raise TypeError(
            f"{owner}.{name} must be hashable (recipes are jit cache keys), got {value!r}"
        ) from None


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
        check_no_backward_override(owner, self.backward_override)

        set_("margin", check_margin(owner, self.margin))
        check_format(owner, self.fp8_format)

        n = self.amax_history_len
        if not is_int(n):
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

        set_("reduce_amax", check_bool(owner, "reduce_amax", self.reduce_amax))
        if not self.reduce_amax:
            raise ValueError(
                f"{owner}.reduce_amax=False is not supported: fp8jax keeps one FP8 state, "
                "replicated on every device, so every amax is reduced over the devices that "
                "share its tensor (allowed: True)"
            )
        check_no_fp8_attention(
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
        check_no_backward_override(owner, self.backward_override)
        check_format(owner, self.fp8_format)
        object.__setattr__(self, "margin", check_margin(owner, self.margin))


# --- block scaling ------------------------------------------------------------------------------


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
            check_bool("MMParams", "use_split_accumulator", self.use_split_accumulator),
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
        check_no_backward_override(owner, self.backward_override)
        set_("use_f32_scales", check_bool(owner, "use_f32_scales", self.use_f32_scales))
        check_no_e5m2(owner, self.fp8_format)
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
            if not is_int(value):
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
        check_no_fp8_attention(owner, self, f"not supported with {owner}")

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
        check_no_backward_override(owner, self.backward_override)
        object.__setattr__(self, "margin", check_margin(owner, self.margin))
        check_no_e5m2(owner, self.fp8_format)
        object.__setattr__(
            self,
            "enable_2d_quantization",
            check_bool(owner, "enable_2d_quantization", self.enable_2d_quantization),
        )
        check_no_fp8_attention(owner, self, f"not supported with {owner}")

    def block(self, role: str) -> tuple[int, int]:
        """The block shape of ``role`` (``"x"``, ``"w"`` or ``"grad"``): ``(1, 32)``, or
        ``(32, 32)`` for ``"w"`` with ``enable_2d_quantization``."""
        self._role("block", role)
        return (32, 32) if role == "w" and self.enable_2d_quantization else (1, 32)

    def qparams(self, role: str) -> QParams:
        """The :class:`QParams` of ``role``: power-of-two (E8M0) scales, no epsilon, any role."""
        self._role("qparams", role)
        return QParams(power_2_scale=True)


# --- row-wise scaling ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class Float8RowwiseScaling(Recipe):
    """Row-wise (per-channel) scaling, after torchao's ``rowwise`` and ``rowwise_with_gw_hp``
    recipes: every row of a GEMM operand, along that GEMM's contraction dim, gets its own
    scale from its own amax, computed when it is quantized (no state, no history).

    For ``out = x @ w`` (``x [T, K]``, ``w [K, N]``): ``x`` gets one scale per token (its rows
    over K), ``w`` one per output feature (its columns over K), and since the scales factor out
    of the dot, ``out = (x8 @ w8) * sx[:, None] * sw[None, :]``: the GEMM runs on the FP8 codes
    and the outer product of the two scale vectors scales its float32 result. The dgrad
    ``dx = dy @ w^T`` takes ``dy`` per token (over N) and ``w`` per input feature (its rows over
    N). The wgrad ``dw = x^T @ dy`` contracts over the tokens, so ``x^T`` is quantized again,
    from the high-precision values, per input feature over the tokens, and ``dy^T`` per output
    feature over the tokens (each tensor's second copy, as the 1-D block recipes have).

    Attributes:
      fp8_format: ``Format.E4M3`` (default, as torchao: activations, weights and gradients in
        E4M3) or ``Format.HYBRID`` (gradients in E5M2).
      power_2_scale: Round each row's scale down to a power of two (default, as torchao's
        row-wise recipes): the inverse scales are exact and the scaling of the GEMM's output
        adds no rounding.
      amax_epsilon: Non-negative float; a row amax below it is raised to it before the scale
        is computed (torchao clamps at ``1e-12``; fp8jax's default 0 gives an all-zero row
        scale 1, which quantizes it the same).
      wgrad_high_precision: Run the wgrad as a plain dot of the high-precision input and output
        gradient, in their compute dtype with float32 accumulation (torchao's
        ``rowwise_with_gw_hp``); the forward and the dgrad stay in FP8. Named after what it
        changes: TransformerEngine spelled the same choice ``override_linear_precision=(False,
        False, True)`` on its old ``DelayedScaling``, and torchao as a recipe name. (torchao's
        ``rowwise_with_gw_hp`` also scales the dgrad's weight per tensor; here it stays
        row-wise, so the flag changes the weight gradient only.) :meth:`fp8_gemm` reports it.
      fp8_dpa, fp8_mha: FP8 attention; not supported (``False``): it scales per tensor.
      backward_override: ``None`` only.

    Scale rule (per row): ``scale = fp8_max / max(amax, amax_epsilon)``, 1 for an amax of 0,
    subnormal, inf or NaN, rounded down to a power of two with ``power_2_scale`` (the rule of
    ``Float8BlockScaling``'s blocks, a row being one block; NaNs are left out of the amax, so a
    NaN stays NaN without changing its row's scale). The casts are kernels
    (:func:`fp8jax.ops.rowwise_quantize`); the GEMM is XLA's reference unless
    ``gemm_options(rowwise_cublaslt=True)`` sends it to cuBLASLt (opt-in, never run on a GPU).

    >>> Float8RowwiseScaling()  # doctest: +NORMALIZE_WHITESPACE
    Float8RowwiseScaling(fp8_format=Format.E4M3, power_2_scale=True, amax_epsilon=0.0,
        wgrad_high_precision=False)
    >>> Float8RowwiseScaling(wgrad_high_precision=True).fp8_gemm("wgrad")
    False
    """

    scaling: ClassVar[Scaling] = Scaling.ROWWISE
    fp8_format: Format = Format.E4M3
    power_2_scale: bool = True
    amax_epsilon: float = 0.0
    wgrad_high_precision: bool = False
    fp8_dpa: bool = dataclasses.field(default=False, repr=False)
    fp8_mha: bool = dataclasses.field(default=False, repr=False)
    backward_override: str | None = dataclasses.field(default=None, repr=False)

    def __post_init__(self) -> None:
        owner = type(self).__name__
        set_ = lambda name, value: object.__setattr__(self, name, value)
        check_no_backward_override(owner, self.backward_override)
        check_no_e5m2(owner, self.fp8_format)
        set_("power_2_scale", check_bool(owner, "power_2_scale", self.power_2_scale))
        set_("amax_epsilon", check_epsilon(owner, "amax_epsilon", self.amax_epsilon))
        set_(
            "wgrad_high_precision",
            check_bool(owner, "wgrad_high_precision", self.wgrad_high_precision),
        )
        check_no_fp8_attention(owner, self, f"not supported with {owner} (it scales per tensor)")

    def qparams(self, role: str) -> QParams:
        """The :class:`QParams` of ``role`` (``"x"``, ``"w"`` or ``"grad"``): the recipe's
        ``power_2_scale`` and ``amax_epsilon``, every role alike."""
        self._role("qparams", role)
        return QParams(power_2_scale=self.power_2_scale, amax_epsilon=self.amax_epsilon)

    def fp8_gemm(self, gemm: str) -> bool:
        """Whether ``gemm`` runs in FP8: all but ``"wgrad"`` with ``wgrad_high_precision``."""
        return super().fp8_gemm(gemm) and not (gemm == "wgrad" and self.wgrad_high_precision)
