"""Flax Linen ``LayerNorm`` and ``LayerNormDenseGeneral`` with TransformerEngine's argument names.

``LayerNorm`` (``layernorm_type="layernorm"`` or ``"rmsnorm"``) has TE's params ``scale`` and
``ln_bias``; outside FP8 it computes exactly as ``flax.linen.LayerNorm``/``RMSNorm`` do, inside
``fp8jax.autocast(enabled=True)`` with fp8jax's norm kernels. ``LayerNormDenseGeneral`` is a
norm fused into an FP8 dense layer (:func:`fp8jax.layernorm_dense`): the normalised input goes
straight from the norm kernel to the GEMM in FP8.

>>> import jax, jax.numpy as jnp, fp8jax
>>> from fp8jax.flax import LayerNormDenseGeneral
>>> layer = LayerNormDenseGeneral(features=4)
>>> with fp8jax.autocast(enabled=True, recipe=fp8jax.DelayedScaling(amax_history_len=8)):
...     variables = layer.init(jax.random.key(0), jnp.ones((2, 3)))
>>> jax.tree.map(jnp.shape, variables["params"])
{'kernel': (3, 4), 'ln_bias': (3,), 'scale': (3,)}
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.typing import Initializer

from fp8jax._norm_layer import check_norm_args, norm_layer
from fp8jax.flax._params import annotated, as_tuple, constrain, flat_init
from fp8jax.flax._te_args import check_off
from fp8jax.flax._variables import check_float_array, fp8_call
from fp8jax.layernorm_dense import _layernorm_dense

__all__ = ["LayerNorm", "LayerNormDenseGeneral", "default_kernel_init"]

#: TransformerEngine's default kernel initializer: ``variance_scaling(1.0, "fan_in",
#: "truncated_normal")``.
default_kernel_init = nn.initializers.variance_scaling(1.0, "fan_in", "truncated_normal")


def norm_params(
    module: nn.Module,
    owner: str,
    hidden: int,
    *,
    layernorm_type: str,
    zero_centered_gamma: bool,
    scale_init: Initializer | None,
    scale_axes: Sequence[str | None],
    bias_init: Initializer,
    bias_axes: Sequence[str | None],
    param_dtype: Any,
) -> tuple[jax.Array, jax.Array | None]:
    """Creates TE's norm params in ``module``: ``scale`` (ones, or zeros with
    ``zero_centered_gamma``, unless ``scale_init``) and, for LayerNorm, ``ln_bias``."""
    if scale_init is None:
        scale_init = nn.initializers.zeros_init() if zero_centered_gamma else nn.initializers.ones
    scale_init = annotated(owner, "scale_axes", scale_init, scale_axes, 1)
    gamma = module.param("scale", scale_init, (hidden,), param_dtype)
    beta = None
    if layernorm_type == "layernorm":
        bias_init = annotated(owner, "ln_bias_axes", bias_init, bias_axes, 1)
        beta = module.param("ln_bias", bias_init, (hidden,), param_dtype)
    return gamma, beta


class LayerNorm(nn.Module):
    """LayerNorm or RMSNorm over the last axis, with TransformerEngine's argument names.

    Params: ``scale`` ``(hidden,)`` and, for ``layernorm_type="layernorm"``, ``ln_bias``
    ``(hidden,)``. Outside FP8 the output equals ``flax.linen.LayerNorm`` (or ``RMSNorm``)
    with the same params bit for bit; inside ``fp8jax.autocast(enabled=True)`` fp8jax's norm
    kernel computes it (two-pass statistics in float32; equal within float32 rounding).

    Attributes:
      epsilon: added to the variance.
      layernorm_type: ``"layernorm"`` or ``"rmsnorm"``.
      zero_centered_gamma: the scale applied is ``1 + scale`` (and ``scale`` starts at 0).
      scale_init: initializer of ``scale`` (default: ones, or zeros when zero-centred).
      scale_axes, bias_axes: logical axis names of ``scale``/``ln_bias`` (``()``: none).
      bias_init: initializer of ``ln_bias``.
      dtype: output dtype (default: promoted from the input and params, as in Flax).
      param_dtype: dtype of the params.
      transpose_batch_sequence: accepted for TE compatibility; a norm over the last axis does
        not depend on it.
    """

    epsilon: float = 1e-6
    layernorm_type: str = "layernorm"
    zero_centered_gamma: bool = False
    scale_init: Initializer | None = None
    scale_axes: tuple[str | None, ...] = ()
    bias_init: Initializer = nn.initializers.zeros_init()
    bias_axes: tuple[str | None, ...] = ()
    dtype: Any = None
    param_dtype: Any = jnp.float32
    transpose_batch_sequence: bool = False

    def check(self, x: Any) -> jax.Array:
        """Every refusal of a call on ``x`` (ValueError/TypeError naming the argument);
        returns ``x`` checked. Shared with :class:`fp8jax.nnx.LayerNorm`."""
        owner = "LayerNorm"
        check_norm_args(owner, self.layernorm_type, self.epsilon, self.zero_centered_gamma)
        return check_float_array(owner, "x", x)

    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        owner = "LayerNorm"
        x = self.check(x)
        gamma, beta = norm_params(
            self, owner, x.shape[-1], layernorm_type=self.layernorm_type,
            zero_centered_gamma=self.zero_centered_gamma, scale_init=self.scale_init,
            scale_axes=self.scale_axes, bias_init=self.bias_init, bias_axes=self.bias_axes,
            param_dtype=self.param_dtype,
        )  # fmt: skip
        dtype = self.dtype or jnp.result_type(*(v for v in (x, gamma, beta) if v is not None))
        return norm_layer(x, gamma, beta, self.layernorm_type, self.epsilon,
                          self.zero_centered_gamma, dtype)  # fmt: skip


class LayerNormDenseGeneral(nn.Module):
    """A norm fused into an FP8 dense layer, with TransformerEngine's argument names.

    Computes ``norm(inputs) @ kernel (+ bias)`` over the last axis and returns ``(out,
    ln_output)``: ``ln_output`` is the norm's output when ``return_layernorm_output`` (the raw
    input when ``enable_layernorm=False``), else ``None``. Inside
    ``fp8jax.autocast(enabled=True, ...)`` it runs :func:`fp8jax.layernorm_dense` (the norm
    kernel writes the GEMM's FP8 input directly); outside, the same computation in high
    precision, equal to ``flax.linen.LayerNorm`` followed by ``flax.linen.DenseGeneral``.

    Params: ``scale``, ``ln_bias`` (as :class:`LayerNorm`; only with ``enable_layernorm``),
    ``kernel`` ``(hidden, *features)`` (drawn with the flat ``(hidden, prod(features))`` shape,
    as Flax's ``DenseGeneral`` draws it) and ``bias`` ``features`` (with ``use_bias``).
    The FP8 state has the 3 roles of a dense layer (input = the norm's output, kernel,
    output-grad).

    Differences from TE: ``dtype`` is the computation dtype with ``param_dtype`` for params, as
    in Flax; logical axis names default to none (``()``); ``transpose_batch_sequence`` has no
    effect (the norm and the GEMM act on the last axis only); ``dot_input_axes`` constrains
    the GEMM input only without the norm; LoRA and ``quantization_checkpoint_name`` are
    accepted at TE's defaults only (ValueError otherwise).

    Attributes:
      features: int or tuple of output features.
      enable_layernorm: normalise the input first (else an FP8 dense layer).
      layernorm_type, epsilon, zero_centered_gamma, scale_init, scale_axes: as
        :class:`LayerNorm`; ln_bias_init, ln_bias_axes: its bias's.
      kernel_init: default :data:`default_kernel_init` (TE's). kernel_axes: logical names of
        the kernel's dims (``("embed", "mlp")``); ``()``: none.
      use_bias, bias_init, bias_axes: the GEMM's bias.
      return_layernorm_output: also return the norm's output (see above).
      axis: must be ``-1`` (the normalised and contracted axis).
      dtype, param_dtype: computation dtype (default: promoted from input and params), params'.
      layernorm_input_axes: logical axis names constraining the input (e.g. a sequence-split
        input for sequence parallelism); dot_input_axes: the GEMM's input, when
        ``enable_layernorm=False`` (with the norm, its output exists only inside the fused
        kernel); ``()``: none.
      depth_scaling: if set, the output is divided by it.
      enable_low_rank_adaptation, low_rank_adaptation_dim, low_rank_adaptation_alpha,
        quantization_checkpoint_name: TE's, at its defaults only (see above).
    """

    features: int | Sequence[int]
    enable_layernorm: bool = True
    layernorm_type: str = "layernorm"
    epsilon: float = 1e-6
    zero_centered_gamma: bool = False
    scale_init: Initializer | None = None
    scale_axes: tuple[str | None, ...] = ()
    ln_bias_init: Initializer = nn.initializers.zeros_init()
    ln_bias_axes: tuple[str | None, ...] = ()
    kernel_init: Initializer | None = None
    kernel_axes: tuple[str | None, ...] = ()
    use_bias: bool = False
    bias_init: Initializer = nn.initializers.zeros_init()
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

    def check(self, inputs: Any) -> tuple[jax.Array, tuple[int, ...]]:
        """Every refusal of a call on ``inputs`` but the axis names' (ValueError/TypeError
        naming the argument); returns ``(inputs, features)`` checked. Shared with
        :class:`fp8jax.nnx.LayerNormDenseGeneral`, which calls it with its own call's input."""
        owner = "LayerNormDenseGeneral"
        check_off(owner, self, "enable_low_rank_adaptation", "quantization_checkpoint_name")
        inputs = check_float_array(owner, "inputs", inputs)
        features = _features(owner, self.features)
        if as_tuple(self.axis) not in ((-1,), (inputs.ndim - 1,)):
            raise ValueError(f"{owner}: axis must be -1 (the normalised axis), got {self.axis!r}")
        if self.enable_layernorm:
            check_norm_args(owner, self.layernorm_type, self.epsilon, self.zero_centered_gamma)
        return inputs, features

    @nn.compact
    def __call__(self, inputs: jax.Array) -> tuple[jax.Array, jax.Array | None]:
        owner = "LayerNormDenseGeneral"
        inputs, features = self.check(inputs)
        hidden = inputs.shape[-1]
        x = constrain(owner, "layernorm_input_axes", inputs, self.layernorm_input_axes or ())
        gamma = beta = None
        if self.enable_layernorm:
            gamma, beta = norm_params(
                self, owner, hidden, layernorm_type=self.layernorm_type,
                zero_centered_gamma=self.zero_centered_gamma, scale_init=self.scale_init,
                scale_axes=self.scale_axes, bias_init=self.ln_bias_init,
                bias_axes=self.ln_bias_axes, param_dtype=self.param_dtype,
            )  # fmt: skip
        else:
            x = constrain(owner, "dot_input_axes", x, self.dot_input_axes or ())
        flat = (hidden, int(np.prod(features)))
        kernel_init = annotated(
            owner, "kernel_axes", flat_init(self.kernel_init or default_kernel_init, flat),
            self.kernel_axes, 1 + len(features),
        )  # fmt: skip
        kernel = self.param("kernel", kernel_init, (hidden, *features), self.param_dtype)
        bias = None
        if self.use_bias:
            bias_init = annotated(
                owner, "bias_axes", flat_init(self.bias_init, flat[1:]), self.bias_axes,
                len(features),
            )  # fmt: skip
            bias = self.param("bias", bias_init, features, self.param_dtype)
        dtype = self.dtype or jnp.result_type(
            *(v for v in (inputs, kernel, bias, gamma, beta) if v is not None)
        )
        fp8 = fp8_call(self)
        y, ln, seen = _layernorm_dense(
            x, gamma, beta, kernel, bias, fp8.meta, fp8.recipe, probe=fp8.probe,
            layernorm_type=self.layernorm_type if self.enable_layernorm else None,
            epsilon=self.epsilon, zero_centered_gamma=self.zero_centered_gamma,
            return_layernorm_output=self.return_layernorm_output, dtype=dtype,
            enabled=fp8.enabled, where=fp8.where,
        )  # fmt: skip
        if fp8.record is not None and seen is not None:
            fp8.record(seen)
        if self.depth_scaling is not None:
            y = y / jnp.asarray(self.depth_scaling, y.dtype)
        return y, ln


def _features(owner: str, features: Any) -> tuple[int, ...]:
    out = as_tuple(features)
    if not out or any(
        not isinstance(f, (int, np.integer)) or isinstance(f, bool) or f < 1 for f in out
    ):
        raise ValueError(f"{owner}: features must be positive ints, got {features!r}")
    return tuple(int(f) for f in out)
