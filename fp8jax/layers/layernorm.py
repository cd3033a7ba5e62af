"""The configs of the norm layers (``LayerNorm``, ``LayerNormDenseGeneral``): fields with
TransformerEngine's names and Flax's defaults, every refusal of a call (``check``) and the params
as data (``param_specs``). The Linen modules of :mod:`fp8jax.flax` are these configs (they
inherit the fields); the NNX modules of :mod:`fp8jax.nnx` hold one as ``config``. The fields are
documented on those modules.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from fp8jax.functional.layernorm import check_norm_args, layernorm_dense_observed, norm_layer
from fp8jax.layers.checks import as_tuple, check_float_array, check_off
from fp8jax.layers.dense import check_features
from fp8jax.layers.layout import constrain
from fp8jax.layers.params import Initializer, ParamSpec, default_kernel_init, flat_init, ones, zeros

__all__ = ["LayerNormConfig", "LayerNormDenseGeneralConfig", "norm_param_specs"]


def norm_param_specs(
    hidden: int,
    *,
    layernorm_type: str,
    zero_centered_gamma: bool,
    scale_init: Initializer | None,
    scale_axes: Sequence[str | None],
    bias_init: Initializer,
    bias_axes: Sequence[str | None],
    bias_axes_arg: str,
    param_dtype: Any,
) -> dict[str, ParamSpec]:
    """TE's norm params: ``scale`` (ones, or zeros with ``zero_centered_gamma``, unless
    ``scale_init``) and, for LayerNorm, ``ln_bias``."""
    if scale_init is None:
        scale_init = zeros if zero_centered_gamma else ones
    out = {"scale": ParamSpec((hidden,), param_dtype, scale_init, tuple(scale_axes), "scale_axes")}
    if layernorm_type == "layernorm":
        out["ln_bias"] = ParamSpec((hidden,), param_dtype, bias_init, tuple(bias_axes),
                                   bias_axes_arg)  # fmt: skip
    return out


@dataclasses.dataclass(unsafe_hash=True)
class LayerNormConfig:
    """The config of ``LayerNorm`` (:class:`fp8jax.flax.LayerNorm` documents the fields)."""

    epsilon: float = 1e-6
    layernorm_type: str = "layernorm"
    zero_centered_gamma: bool = False
    scale_init: Initializer | None = None
    scale_axes: tuple[str | None, ...] = ()
    bias_init: Initializer = zeros
    bias_axes: tuple[str | None, ...] = ()
    dtype: Any = None
    param_dtype: Any = jnp.float32
    transpose_batch_sequence: bool = False

    def check(self, x: Any) -> jax.Array:
        """Every refusal of a call on ``x`` (ValueError/TypeError naming the argument);
        returns ``x`` checked."""
        self.check_config()
        return check_float_array("LayerNorm", "x", x)

    def check_config(self) -> None:
        """The refusals of the configuration alone."""
        check_norm_args("LayerNorm", self.layernorm_type, self.epsilon, self.zero_centered_gamma)

    def param_specs(self, hidden: int) -> dict[str, ParamSpec]:
        """``scale`` and (LayerNorm) ``ln_bias``, ``(hidden,)``."""
        return norm_param_specs(
            hidden, layernorm_type=self.layernorm_type,
            zero_centered_gamma=self.zero_centered_gamma, scale_init=self.scale_init,
            scale_axes=self.scale_axes, bias_init=self.bias_init, bias_axes=self.bias_axes,
            bias_axes_arg="bias_axes", param_dtype=self.param_dtype,
        )  # fmt: skip

    def forward(self, x: jax.Array, params: Mapping[str, jax.Array | None]) -> jax.Array:
        """The norm of checked ``x`` with ``params`` (``scale``, ``ln_bias`` or ``None``)."""
        gamma, beta = params["scale"], params.get("ln_bias")
        dtype = self.dtype or jnp.result_type(*(v for v in (x, gamma, beta) if v is not None))
        return norm_layer(x, gamma, beta, self.layernorm_type, self.epsilon,
                          self.zero_centered_gamma, dtype)  # fmt: skip


@dataclasses.dataclass(unsafe_hash=True)
class LayerNormDenseGeneralConfig:
    """The config of ``LayerNormDenseGeneral`` (:class:`fp8jax.flax.LayerNormDenseGeneral`
    documents the fields)."""

    features: int | Sequence[int]
    enable_layernorm: bool = True
    layernorm_type: str = "layernorm"
    epsilon: float = 1e-6
    zero_centered_gamma: bool = False
    scale_init: Initializer | None = None
    scale_axes: tuple[str | None, ...] = ()
    ln_bias_init: Initializer = zeros
    ln_bias_axes: tuple[str | None, ...] = ()
    kernel_init: Initializer | None = None
    kernel_axes: tuple[str | None, ...] = ()
    use_bias: bool = False
    bias_init: Initializer = zeros
    bias_axes: tuple[str | None, ...] = ()
    return_layernorm_output: bool = False
    axis: int | Sequence[int] = -1
    dtype: Any = None
    param_dtype: Any = jnp.float32
    transpose_batch_sequence: bool = False
    layernorm_input_axes: tuple[str | None, ...] = ()
    dot_input_axes: tuple[str | None, ...] | None = ()
    depth_scaling: float | None = None
    enable_low_rank_adaptation: bool = False
    low_rank_adaptation_dim: int = 32
    low_rank_adaptation_alpha: float | None = None
    quantization_checkpoint_name: str | None = None

    n_roles = 3  # input (the norm's output), kernel, output gradient

    def check(self, inputs: Any) -> tuple[jax.Array, tuple[int, ...]]:
        """Every refusal of a call on ``inputs`` but the axis names' (ValueError/TypeError
        naming the argument); returns ``(inputs, features)`` checked."""
        owner = "LayerNormDenseGeneral"
        inputs = check_float_array(owner, "inputs", inputs)
        features = self.check_config()
        if as_tuple(self.axis) not in ((-1,), (inputs.ndim - 1,)):
            raise ValueError(f"{owner}: axis must be -1 (the normalised axis), got {self.axis!r}")
        return inputs, features

    def check_config(self) -> tuple[int, ...]:
        """The refusals of the configuration alone; returns the features."""
        owner = "LayerNormDenseGeneral"
        check_off(owner, self, "enable_low_rank_adaptation", "quantization_checkpoint_name")
        features = check_features(owner, self.features)
        if self.enable_layernorm:
            check_norm_args(owner, self.layernorm_type, self.epsilon, self.zero_centered_gamma)
        return features

    def param_specs(self, hidden: int) -> dict[str, ParamSpec]:
        """The norm's ``scale``/``ln_bias`` (with ``enable_layernorm``), ``kernel`` ``(hidden,
        *features)`` (drawn flat) and, with ``use_bias``, ``bias``."""
        features = check_features("LayerNormDenseGeneral", self.features)
        out: dict[str, ParamSpec] = {}
        if self.enable_layernorm:
            out.update(norm_param_specs(
                hidden, layernorm_type=self.layernorm_type,
                zero_centered_gamma=self.zero_centered_gamma, scale_init=self.scale_init,
                scale_axes=self.scale_axes, bias_init=self.ln_bias_init,
                bias_axes=self.ln_bias_axes, bias_axes_arg="ln_bias_axes",
                param_dtype=self.param_dtype,
            ))  # fmt: skip
        flat = (hidden, math.prod(features))
        out["kernel"] = ParamSpec((hidden, *features), self.param_dtype,
                                  flat_init(self.kernel_init or default_kernel_init, flat),
                                  tuple(self.kernel_axes), "kernel_axes")  # fmt: skip
        if self.use_bias:
            out["bias"] = ParamSpec(features, self.param_dtype, flat_init(self.bias_init, flat[1:]),
                                    tuple(self.bias_axes), "bias_axes")  # fmt: skip
        return out

    def forward(
        self, inputs: jax.Array, params: Mapping[str, jax.Array | None], fp8: Any, where: str
    ) -> tuple[jax.Array, jax.Array | None]:
        """The layer on checked ``inputs`` with ``params`` (by name; absent ones ``None``) and
        ``fp8`` (as :meth:`DenseGeneralConfig.forward`); returns ``(out, ln_output)``."""
        owner = "LayerNormDenseGeneral"
        x = constrain(owner, "layernorm_input_axes", inputs, self.layernorm_input_axes or ())
        if not self.enable_layernorm:
            x = constrain(owner, "dot_input_axes", x, self.dot_input_axes or ())
        names = ("scale", "ln_bias", "kernel", "bias")
        gamma, beta, kernel, bias = (params.get(n) for n in names)
        dtype = self.dtype or jnp.result_type(
            *(v for v in (inputs, kernel, bias, gamma, beta) if v is not None)
        )
        result = layernorm_dense_observed(
            x, gamma, beta, kernel, bias, fp8.meta, fp8.recipe, probe=fp8.probe,
            layernorm_type=self.layernorm_type if self.enable_layernorm else None,
            epsilon=self.epsilon, zero_centered_gamma=self.zero_centered_gamma,
            return_layernorm_output=self.return_layernorm_output, dtype=dtype,
            enabled=fp8.enabled, where=where,
        )  # fmt: skip
        if fp8.record is not None and result.observed is not None:
            fp8.record(result.observed)
        y = result.out
        if self.depth_scaling is not None:
            y = y / jnp.asarray(self.depth_scaling, y.dtype)
        return y, result.ln_out
