"""The config of ``LayerNormMLP`` (norm, FC1, activation, dropout, FC2): fields with
TransformerEngine's names and defaults, every refusal of a call, the params as data, and the
forward on given params (the same in both Flax APIs). :class:`fp8jax.flax.LayerNormMLP`
documents the fields."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from fp8jax.functional.mlp import MLP_ROLES, check_activations, layernorm_mlp_observed
from fp8jax.layers.checks import as_tuple, check_float_array, check_off, positive_int
from fp8jax.layers.layernorm import norm_param_specs
from fp8jax.layers.layout import constrain
from fp8jax.layers.params import Initializer, ParamSpec, default_kernel_init, stacked_init, zeros

__all__ = ["LayerNormMLPConfig"]


@dataclasses.dataclass(unsafe_hash=True)
class LayerNormMLPConfig:
    """The config of ``LayerNormMLP`` (:class:`fp8jax.flax.LayerNormMLP` documents the
    fields)."""

    intermediate_dim: int = 2048
    enable_layernorm: bool = True
    layernorm_type: str = "layernorm"
    epsilon: float = 1e-6
    zero_centered_gamma: bool = False
    scale_init: Initializer | None = None
    scale_axes: tuple[str | None, ...] = ()
    ln_bias_init: Initializer = zeros
    ln_bias_axes: tuple[str | None, ...] = ()
    kernel_init: Initializer | None = None
    kernel_axes_1: tuple[str | None, ...] = ()
    kernel_axes_2: tuple[str | None, ...] = ()
    use_bias: bool = False
    bias_init: Initializer = zeros
    bias_axes_1: tuple[str | None, ...] = ()
    bias_axes_2: tuple[str | None, ...] = ()
    return_layernorm_output: bool = False
    activations: Sequence[str] = ("gelu",)
    activation_params: Any = None
    intermediate_dropout_rng_name: str = "dropout"
    intermediate_dropout_rate: float = 0.0
    intermediate_hidden_dropout_dims: Sequence[int] = ()
    axis: int | Sequence[int] = -1
    dtype: Any = None
    param_dtype: Any = jnp.float32
    transpose_batch_sequence: bool = False
    layernorm_input_axes: tuple[str | None, ...] | None = ()
    dot_1_input_axes: tuple[str | None, ...] | None = None
    dot_2_input_axes: tuple[str | None, ...] | None = None
    ffn1_ckpt_name: str = "ffn1"
    ffn2_ckpt_name: str = "ffn2"
    enable_low_rank_adaptation: bool = False
    low_rank_adaptation_dim: int = 32
    low_rank_adaptation_alpha: float | None = None
    quantization_checkpoint_name: str | None = None

    n_roles = len(MLP_ROLES)  # fc1's input, kernel, output gradient, then fc2's

    def check(self, inputs: Any) -> tuple[jax.Array, tuple[str, ...]]:
        """Every refusal of a call on ``inputs`` (ValueError/TypeError naming the argument);
        returns ``(inputs, activations)`` checked."""
        owner = "LayerNormMLP"
        inputs = check_float_array(owner, "inputs", inputs)
        acts = self.check_config()
        if as_tuple(self.axis) not in ((-1,), (inputs.ndim - 1,)):
            raise ValueError(f"{owner}: axis must be -1 (the normalised axis), got {self.axis!r}")
        for d in self.intermediate_hidden_dropout_dims:
            if not isinstance(d, (int, np.integer)) or not -inputs.ndim <= d < inputs.ndim:
                raise ValueError(
                    f"{owner}: intermediate_hidden_dropout_dims holds {d!r}, not a dim of the "
                    f"rank-{inputs.ndim} hidden activation"
                )
        return inputs, acts

    def check_config(self) -> tuple[str, ...]:
        """The refusals of the configuration alone; returns the activations."""
        owner = "LayerNormMLP"
        acts = check_activations(owner, self.activations)
        check_off(
            owner, self, "activation_params", "enable_low_rank_adaptation", "dot_1_input_axes",
            "dot_2_input_axes", "quantization_checkpoint_name",
        )  # fmt: skip
        for name in ("ffn1_ckpt_name", "ffn2_ckpt_name"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"{owner}: {name} must be a str, got {getattr(self, name)!r}")
        positive_int(owner, "intermediate_dim", self.intermediate_dim)
        rate = self.intermediate_dropout_rate
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate < 1:
            raise ValueError(
                f"{owner}: intermediate_dropout_rate must be a float in [0, 1), got {rate!r}"
            )
        return acts

    def param_specs(self, hidden: int) -> dict[str, ParamSpec]:
        """The norm's ``scale``/``ln_bias`` (with ``enable_layernorm``), ``wi_kernel`` ``(hidden,
        len(activations), intermediate_dim)`` (each slice its own draw), ``wo_kernel``
        ``(intermediate_dim, hidden)`` and, with ``use_bias``, ``wi_bias`` and ``wo_bias``."""
        k, inter = len(self.check_config()), self.intermediate_dim
        out: dict[str, ParamSpec] = {}
        if self.enable_layernorm:
            out.update(norm_param_specs(
                hidden, layernorm_type=self.layernorm_type,
                zero_centered_gamma=self.zero_centered_gamma, scale_init=self.scale_init,
                scale_axes=self.scale_axes, bias_init=self.ln_bias_init,
                bias_axes=self.ln_bias_axes, bias_axes_arg="ln_bias_axes",
                param_dtype=self.param_dtype,
            ))  # fmt: skip
        init = self.kernel_init or default_kernel_init
        dt = self.param_dtype
        out["wi_kernel"] = ParamSpec((hidden, k, inter), dt, stacked_init(init, k),
                                     tuple(self.kernel_axes_1), "kernel_axes_1")  # fmt: skip
        out["wo_kernel"] = ParamSpec((inter, hidden), dt, init, tuple(self.kernel_axes_2),
                                     "kernel_axes_2")  # fmt: skip
        if self.use_bias:
            out["wi_bias"] = ParamSpec((k, inter), dt, self.bias_init, tuple(self.bias_axes_1),
                                       "bias_axes_1")  # fmt: skip
            out["wo_bias"] = ParamSpec((hidden,), dt, self.bias_init, tuple(self.bias_axes_2),
                                       "bias_axes_2")  # fmt: skip
        return out

    def dropout_on(self, deterministic: bool) -> bool:
        """Whether a call with ``deterministic`` draws a dropout mask (and so a key)."""
        return not deterministic and float(self.intermediate_dropout_rate) > 0.0

    def dropout_mask(
        self, lead: tuple[int, ...], dtype: Any, key: jax.Array | None
    ) -> jax.Array | None:
        """Dropout's keep mask divided by the keep rate, ``[*lead, intermediate_dim]`` with the
        broadcast dims of size 1 (as ``flax.linen.Dropout`` draws it from ``key``); ``None``
        when dropout is inactive (no key, or rate 0)."""
        rate = float(self.intermediate_dropout_rate)
        if key is None or rate == 0.0:
            return None
        shape = [*lead, int(self.intermediate_dim)]
        for d in self.intermediate_hidden_dropout_dims:
            shape[d] = 1
        keep = jax.random.bernoulli(key, 1.0 - rate, tuple(shape))
        return jnp.where(keep, jnp.asarray(1.0 / (1.0 - rate), dtype), jnp.zeros((), dtype))

    def forward(
        self,
        inputs: jax.Array,
        params: Mapping[str, jax.Array | None],
        acts: tuple[str, ...],
        fp8: Any,
        where: str,
        dropout_key: jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array | None]:
        """The block on checked ``inputs`` with ``params`` (by name; absent ones ``None``) and
        ``fp8`` (the call's FP8 switch, recipe, state, probe and calibration recorder), dropout
        drawn from ``dropout_key`` (``None``: off); returns ``(out, ln_output)``."""
        x = constrain("LayerNormMLP", "layernorm_input_axes", inputs,
                      self.layernorm_input_axes or ())  # fmt: skip
        names = ("scale", "ln_bias", "wi_kernel", "wo_kernel", "wi_bias", "wo_bias")
        gamma, beta, wi, wo, bi, bo = (params.get(n) for n in names)
        dtype = self.dtype or jnp.result_type(
            *(v for v in (inputs, wi, wo, bi, bo, gamma, beta) if v is not None)
        )
        mask = self.dropout_mask(inputs.shape[:-1], dtype, dropout_key)
        result = layernorm_mlp_observed(
            x, gamma, beta, wi, wo, bi, bo, fp8.meta, fp8.recipe, probe=fp8.probe,
            layernorm_type=self.layernorm_type if self.enable_layernorm else None,
            epsilon=self.epsilon, zero_centered_gamma=self.zero_centered_gamma,
            activations=acts, dropout_mask=mask,
            return_layernorm_output=self.return_layernorm_output, dtype=dtype,
            enabled=fp8.enabled, where=where,
        )  # fmt: skip
        if fp8.record is not None and result.observed is not None:
            fp8.record(result.observed)
        return checkpoint_name(result.out, self.ffn2_ckpt_name), result.ln_out
