"""TransformerEngine's ``transformer_engine.common.recipe``, on fp8jax's recipes.

The recipes fp8jax implements are its own classes, whose fields and defaults are already TE's
(:class:`DelayedScaling`, :class:`Float8BlockScaling`, :class:`MXFP8BlockScaling`, with
:class:`Format`, :class:`MMParams`, :class:`QParams`). :class:`Float8CurrentScaling` is
fp8jax's with TE's extra fields added (checked against what fp8jax computes). The recipes fp8jax
does not implement (:class:`NVFP4BlockScaling`, :class:`CustomRecipe`) exist with TE's fields so
that code naming them (MaxText's recipe table) imports; *using* one is a
``NotImplementedError`` (:func:`fp8jax_recipe`).

Deliberate differences from TE: fields are keyword-only and recipes are frozen (hashable, so
they can be static arguments of :func:`jax.jit`); no default is read from an ``NVTE_*``
environment variable; a bad field is a ``ValueError``/``TypeError`` naming it, not an assert.

>>> from fp8jax.te.common import recipe
>>> recipe.Float8CurrentScaling().fp8_format
Format.HYBRID
>>> fp8jax_recipe(recipe.NVFP4BlockScaling(), "fp8_recipe")  # doctest: +ELLIPSIS
Traceback (most recent call last):
...
NotImplementedError: fp8_recipe: NVFP4BlockScaling (FP4 block scaling) is not implemented ...
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from fp8jax.recipe import (
    DelayedScaling,
    Float8BlockScaling,
    Format,
    MMParams,
    MXFP8BlockScaling,
    QParams,
    Recipe,
    check_recipe,
)
from fp8jax.recipe import Float8CurrentScaling as _Fp8jaxCurrentScaling

__all__ = [
    "CustomRecipe",
    "DelayedScaling",
    "Float8BlockScaling",
    "Float8CurrentScaling",
    "Format",
    "MMParams",
    "MXFP8BlockScaling",
    "NVFP4BlockScaling",
    "QParams",
    "Recipe",
    "fp8jax_recipe",
]

_IMPLEMENTED = "DelayedScaling, Float8CurrentScaling, Float8BlockScaling or MXFP8BlockScaling"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Float8CurrentScaling(_Fp8jaxCurrentScaling):
    """TE's ``Float8CurrentScaling``: fp8jax's current scaling with TE's fields.

    The fields fp8jax's current scaling has no choice over must keep TE's defaults (which are
    what fp8jax computes): per-tensor scales ``fp8_max / amax`` with no power-of-two rounding
    and no epsilon (``use_power_2_scales=False``, the three ``fp8_quant_*``), fast accumulation
    in the forward GEMM and split accumulation in dgrad and wgrad (the three ``fp8_gemm_*``),
    and no FP8 attention (in fp8jax an attribute of the attention modules). Anything else is a
    ``ValueError`` naming the field.

    >>> Float8CurrentScaling().fp8_gemm_fprop
    MMParams(use_split_accumulator=False)
    """

    use_power_2_scales: bool = False
    fp8_quant_fwd_inp: QParams = dataclasses.field(
        default=QParams(power_2_scale=False, amax_epsilon=0.0)
    )
    fp8_quant_fwd_weight: QParams = dataclasses.field(
        default=QParams(power_2_scale=False, amax_epsilon=0.0)
    )
    fp8_quant_bwd_grad: QParams = dataclasses.field(
        default=QParams(power_2_scale=False, amax_epsilon=0.0)
    )
    fp8_gemm_fprop: MMParams = dataclasses.field(default=MMParams(use_split_accumulator=False))
    fp8_gemm_dgrad: MMParams = dataclasses.field(default=MMParams(use_split_accumulator=True))
    fp8_gemm_wgrad: MMParams = dataclasses.field(default=MMParams(use_split_accumulator=True))
    fp8_dpa: bool = False
    fp8_mha: bool = False

    def __post_init__(self) -> None:
        super().__post_init__()
        fixed = {
            f.name: f.default
            for f in dataclasses.fields(Float8CurrentScaling)
            if f.name not in {g.name for g in dataclasses.fields(_Fp8jaxCurrentScaling)}
        }
        for name, default in fixed.items():
            value = getattr(self, name)
            if value != default or type(value) is not type(default):
                raise ValueError(
                    f"Float8CurrentScaling.{name}={value!r} is not supported: fp8jax's current "
                    f"scaling computes as {name}={default!r} (TE's default)"
                )


@dataclasses.dataclass(frozen=True, kw_only=True)
class NVFP4BlockScaling:
    """TE's ``NVFP4BlockScaling`` (FP4 E2M1 codes, 1 x 16 blocks with E4M3 scales), with TE's
    fields and defaults (none read from the environment). fp8jax does not implement FP4: the
    recipe can be named and built, and any fp8jax.te function given it raises
    ``NotImplementedError`` (:func:`fp8jax_recipe`)."""

    disable_rht: bool = False
    disable_stochastic_rounding: bool = False
    disable_2d_quantization: bool = False
    row_scaled_activation: bool = False
    nvfp4_4over6: str = "none"
    nvfp4_4over6_e4m3_use_256: str = "all"
    nvfp4_4over6_err_mode: str = "MAE"
    fp4_format: str = "E2M1"
    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: str | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class CustomRecipe:
    """TE's ``CustomRecipe`` (a user's quantizer factory), which fp8jax does not implement:
    it can be named and built; using it raises ``NotImplementedError``."""

    qfactory: Callable[..., Any] | None = None
    fp8_format: Format = Format.HYBRID
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: str | None = None
    quantization_alignment: int = 128


#: TE's recipe classes that fp8jax does not implement, and what each is (for the error).
_NOT_IMPLEMENTED: dict[type, str] = {
    NVFP4BlockScaling: "FP4 block scaling",
    CustomRecipe: "a user-defined quantizer factory",
}


def fp8jax_recipe(value: Any, argname: str) -> Recipe:
    """``value`` as the fp8jax recipe that runs it.

    Every recipe this module exports that fp8jax implements *is* an fp8jax recipe, returned as
    it is; one it does not implement raises ``NotImplementedError`` naming it; anything else
    is fp8jax's ``TypeError`` naming ``argname``.
    """
    what = _NOT_IMPLEMENTED.get(type(value))
    if what is not None:
        raise NotImplementedError(
            f"{argname}: {type(value).__name__} ({what}) is not implemented by fp8jax; use "
            f"{_IMPLEMENTED}"
        )
    return check_recipe(value, argname)
