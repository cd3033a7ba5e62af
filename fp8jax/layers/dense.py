"""The config of the dense layer (``DenseGeneral``): fields with TransformerEngine's names and
Flax's defaults, every refusal of a call (``check``) and the params as data (``param_specs``).
The Linen module of :mod:`fp8jax.flax` is this config (it inherits the fields); the NNX module
of :mod:`fp8jax.nnx` holds one as ``config``. The fields are documented on those modules.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fp8jax.functional.dense import dense_observed
from fp8jax.layers.checks import as_tuple, check_float_array, check_off, normalize_axes
from fp8jax.layers.layout import constrain, laid_out
from fp8jax.layers.params import (
    Initializer,
    ParamSpec,
    flat_init,
    lecun_normal,
    zeros,
)

__all__ = ["DenseGeneralConfig", "check_features"]


def check_features(owner: str, features: Any) -> tuple[int, ...]:
    """``features`` (an int or a tuple of them) as a tuple of positive ints, or a ValueError."""
    out = as_tuple(features)
    if not out or any(
        not isinstance(f, (int, np.integer)) or isinstance(f, bool) or f < 1 for f in out
    ):
        raise ValueError(f"{owner}: features must be positive ints, got {features!r}")
    return tuple(int(f) for f in out)


@dataclasses.dataclass(unsafe_hash=True)
class DenseGeneralConfig:
    """The config of ``DenseGeneral`` (:class:`fp8jax.flax.DenseGeneral` documents the fields)."""

    features: int | Sequence[int]
    axis: int | Sequence[int] = -1
    batch_dims: Sequence[int] = ()
    use_bias: bool = True
    dtype: Any = None
    param_dtype: Any = jnp.float32
    kernel_init: Initializer = lecun_normal
    bias_init: Initializer = zeros
    precision: Any = None
    kernel_axes: tuple[str | None, ...] = ()
    bias_axes: tuple[str | None, ...] = ()
    output_axes: tuple[str | None, ...] = ()
    input_axes: tuple[str | None, ...] | None = ()
    transpose_batch_sequence: bool = False
    enable_low_rank_adaptation: bool = False
    low_rank_adaptation_dim: int = 32
    low_rank_adaptation_alpha: float | None = None
    quantization_checkpoint_name: str | None = None

    n_roles = 3  # the FP8 state's roles: input, kernel, output gradient

    def check(self, inputs: Any) -> tuple[tuple[int, ...], jax.Array]:
        """Every refusal of a call on ``inputs`` but the axis names' (ValueError/TypeError
        naming the argument); returns ``(features, inputs)`` checked."""
        inputs = check_float_array("DenseGeneral", "inputs", inputs)
        features = self.check_config()
        normalize_axes("DenseGeneral", "axis", self.axis, inputs.ndim)
        return features, inputs

    def check_config(self) -> tuple[int, ...]:
        """The refusals of the configuration alone; returns the features."""
        owner = "DenseGeneral"
        check_off(owner, self, "enable_low_rank_adaptation", "quantization_checkpoint_name")
        if as_tuple(self.batch_dims) != ():
            raise ValueError(
                f"{owner}: batch_dims must be () (FP8 GEMMs have no batch dims; fold them into "
                f"the leading dims of the input), got {self.batch_dims!r}"
            )
        if self.precision is not None:
            raise ValueError(
                f"{owner}: precision must be None (an FP8 GEMM has no precision setting), got "
                f"{self.precision!r}"
            )
        return check_features(owner, self.features)

    def param_specs(self, contract: tuple[int, ...]) -> dict[str, ParamSpec]:
        """``kernel`` (the contracted dims ``contract``, then the features; drawn flat, as Flax
        draws it) and, with ``use_bias``, ``bias``."""
        features = check_features("DenseGeneral", self.features)
        flat = (math.prod(contract), math.prod(features))
        out = {"kernel": ParamSpec(contract + features, self.param_dtype,
                                   flat_init(self.kernel_init, flat), tuple(self.kernel_axes),
                                   "kernel_axes")}  # fmt: skip
        if self.use_bias:
            out["bias"] = ParamSpec(features, self.param_dtype, flat_init(self.bias_init, flat[1:]),
                                    tuple(self.bias_axes), "bias_axes")  # fmt: skip
        return out

    def forward(
        self, inputs: jax.Array, params: Mapping[str, jax.Array | None], fp8: Any, where: str
    ) -> jax.Array:
        """The layer on checked ``inputs`` with ``params`` (``kernel``, ``bias`` or ``None``) and
        ``fp8`` (the call's FP8 switch, recipe, state, probe and calibration recorder)."""
        owner = "DenseGeneral"
        inputs = constrain(owner, "input_axes", inputs, self.input_axes or ())
        axes = normalize_axes(owner, "axis", self.axis, inputs.ndim)
        kernel, bias = params["kernel"], params.get("bias")
        dtype = self.dtype
        if dtype is None:
            dtype = jnp.result_type(*(v for v in (inputs, kernel, bias) if v is not None))

        def dense(x: jax.Array) -> jax.Array:
            result = dense_observed(
                x, kernel, bias, fp8.meta, fp8.recipe, probe=fp8.probe, axis=axes, dtype=dtype,
                enabled=fp8.enabled, where=where,
            )  # fmt: skip
            if fp8.record is not None and result.observed is not None:
                fp8.record(result.observed)
            return result.out

        n_features = len(as_tuple(self.features))
        return laid_out(owner, self.output_axes, inputs, axes, n_features, dense)
