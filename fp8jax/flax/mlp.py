"""Flax Linen ``LayerNormMLP``: a Transformer MLP block in FP8, with TransformerEngine's
argument names and params (``scale``, ``ln_bias``, ``wi_kernel``, ``wi_bias``, ``wo_kernel``,
``wo_bias``).

>>> import jax, jax.numpy as jnp, fp8jax
>>> from fp8jax.flax import LayerNormMLP
>>> block = LayerNormMLP(intermediate_dim=8, activations=("silu", "linear"),
...                      intermediate_dropout_rate=0.0)
>>> with fp8jax.autocast(enabled=True, recipe=fp8jax.DelayedScaling(amax_history_len=8)):
...     variables = block.init(jax.random.key(0), jnp.ones((2, 4)))
>>> jax.tree.map(jnp.shape, variables["params"])  # doctest: +NORMALIZE_WHITESPACE
{'ln_bias': (4,), 'scale': (4,), 'wi_kernel': (4, 2, 8), 'wo_kernel': (8, 4)}
>>> jax.tree.map(jnp.shape, variables["fp8_meta"])  # 6 roles: fc1 and fc2
{'amax_history': (6, 8), 'scale': (6,)}
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.typing import Initializer
from jax.ad_checkpoint import checkpoint_name

from fp8jax.flax._params import annotated, as_tuple, constrain
from fp8jax.flax._te_args import check_off
from fp8jax.flax._variables import check_float_array, fp8_call
from fp8jax.flax.layernorm import default_kernel_init, norm_params
from fp8jax.layernorm_mlp import MLP_ROLES, _layernorm_mlp, check_activations

__all__ = ["LayerNormMLP"]


def _stacked_init(init: Initializer, n: int) -> Initializer:
    """``(hidden, n, inter)`` from ``n`` independent draws of ``init`` on ``(hidden, inter)``
    (one key each), so each slice has fan-in ``hidden``, as TE initialises ``wi_kernel``."""

    def wrapped(rng: jax.Array, shape: tuple[int, ...], dtype: Any = jnp.float32) -> Any:
        keys = jax.random.split(rng, n)
        return jnp.stack([init(k, (shape[0], shape[2]), dtype) for k in keys], axis=-2)

    return wrapped


class LayerNormMLP(nn.Module):
    """``norm -> Dense (+bias) -> activation -> dropout -> Dense (+bias)``, in FP8.

    Returns ``(out, ln_output)`` like TE's module: ``out`` has the input's shape;
    ``ln_output`` is the norm's output when ``return_layernorm_output`` (the raw input when
    ``enable_layernorm=False``), else ``None``. Inside ``fp8jax.autocast(enabled=True, ...)`` it
    runs :func:`fp8jax.layernorm_mlp` (norm and activation fused with their FP8 casts, every
    GEMM FP8 both ways); outside it is the same block in high precision, equal to
    ``flax.linen.LayerNorm -> DenseGeneral -> activation -> Dense`` with the same params.

    Params: ``scale``/``ln_bias`` ``(hidden,)`` (as :class:`~fp8jax.flax.LayerNorm`; with
    ``enable_layernorm``), ``wi_kernel`` ``(hidden, len(activations), intermediate_dim)`` (each
    ``[:, i, :]`` slice drawn by ``kernel_init`` with its own key), ``wo_kernel``
    ``(intermediate_dim, hidden)``, and with ``use_bias`` ``wi_bias`` ``(len(activations),
    intermediate_dim)`` and ``wo_bias`` ``(hidden,)``. The FP8 state has the 6 roles of
    :data:`fp8jax.layernorm_mlp.MLP_ROLES`.

    Differences from TE: ``dtype``/``param_dtype`` as in Flax; logical axis names default to
    none (``()``; TE's are ``kernel_axes_1=("embed", "act", "mlp")``,
    ``kernel_axes_2=("mlp", "embed")``); activations are names only (no callables); dropout
    keeps the fused FP8 activation path only when inactive (rate 0 or ``deterministic``):
    with an active dropout the activation and its FP8 cast run as two passes;
    ``transpose_batch_sequence`` has no effect; ``ffn1_ckpt_name`` names nothing (the FC1
    output exists only inside the fused block; :data:`fp8jax.save_fp8_operands` saves its FP8
    operands); LoRA, ``activation_params``, ``dot_1_input_axes``, ``dot_2_input_axes`` and
    ``quantization_checkpoint_name`` are accepted at TE's defaults only (ValueError
    otherwise).

    Attributes:
      intermediate_dim: width of the hidden layer.
      enable_layernorm, layernorm_type, epsilon, zero_centered_gamma, scale_init, scale_axes,
        ln_bias_init, ln_bias_axes: the norm (see :class:`~fp8jax.flax.LayerNormDenseGeneral`).
      kernel_init: default TE's ``variance_scaling(1.0, "fan_in", "truncated_normal")``.
      kernel_axes_1, kernel_axes_2: logical names of ``wi_kernel`` (3) and ``wo_kernel`` (2).
      use_bias, bias_init, bias_axes_1, bias_axes_2: the two GEMMs' biases.
      return_layernorm_output: also return the norm's output.
      activations: ``("gelu",)`` (tanh approximation), ``"gelu_exact"``, ``"relu"``,
        ``"silu"``/``"swish"``, ``"linear"``, or a gated pair ``(act, "linear")``.
      intermediate_dropout_rng_name, intermediate_dropout_rate,
        intermediate_hidden_dropout_dims: dropout on the activation's output (the dims listed
        share one mask value, as ``nn.Dropout``'s ``broadcast_dims``).
      axis: must be ``-1``.
      dtype, param_dtype: computation dtype (default: promoted from input and params), params'.
      layernorm_input_axes: logical names constraining the input.
      ffn1_ckpt_name, ffn2_ckpt_name: TE's checkpoint names; the output carries
        ``ffn2_ckpt_name`` (:func:`jax.ad_checkpoint.checkpoint_name`), ``ffn1_ckpt_name`` has
        no effect (see above).
      activation_params, enable_low_rank_adaptation, low_rank_adaptation_dim,
        low_rank_adaptation_alpha, dot_1_input_axes, dot_2_input_axes,
        quantization_checkpoint_name: TE's, at its defaults only (see above).
    """

    intermediate_dim: int = 2048
    enable_layernorm: bool = True
    layernorm_type: str = "layernorm"
    epsilon: float = 1e-6
    zero_centered_gamma: bool = False
    scale_init: Initializer | None = None
    scale_axes: tuple[str | None, ...] = ()
    ln_bias_init: Initializer = nn.initializers.zeros_init()
    ln_bias_axes: tuple[str | None, ...] = ()
    kernel_init: Initializer | None = None
    kernel_axes_1: tuple[str | None, ...] = ()
    kernel_axes_2: tuple[str | None, ...] = ()
    use_bias: bool = False
    bias_init: Initializer = nn.initializers.zeros_init()
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

    @nn.compact
    def __call__(
        self, inputs: jax.Array, deterministic: bool = False
    ) -> tuple[jax.Array, jax.Array | None]:
        """The block on ``inputs`` ``[..., hidden]``; dropout is off when ``deterministic``."""
        owner = "LayerNormMLP"
        inputs, acts = self.check(inputs)
        hidden, inter, k = inputs.shape[-1], int(self.intermediate_dim), len(acts)
        x = constrain(owner, "layernorm_input_axes", inputs, self.layernorm_input_axes or ())
        gamma = beta = None
        if self.enable_layernorm:
            gamma, beta = norm_params(
                self, owner, hidden, layernorm_type=self.layernorm_type,
                zero_centered_gamma=self.zero_centered_gamma, scale_init=self.scale_init,
                scale_axes=self.scale_axes, bias_init=self.ln_bias_init,
                bias_axes=self.ln_bias_axes, param_dtype=self.param_dtype,
            )  # fmt: skip
        init = self.kernel_init or default_kernel_init
        wi_init = annotated(owner, "kernel_axes_1", _stacked_init(init, k), self.kernel_axes_1, 3)
        wi = self.param("wi_kernel", wi_init, (hidden, k, inter), self.param_dtype)
        wo_init = annotated(owner, "kernel_axes_2", init, self.kernel_axes_2, 2)
        wo = self.param("wo_kernel", wo_init, (inter, hidden), self.param_dtype)
        bi = bo = None
        if self.use_bias:
            bi_init = annotated(owner, "bias_axes_1", self.bias_init, self.bias_axes_1, 2)
            bi = self.param("wi_bias", bi_init, (k, inter), self.param_dtype)
            bo_init = annotated(owner, "bias_axes_2", self.bias_init, self.bias_axes_2, 1)
            bo = self.param("wo_bias", bo_init, (hidden,), self.param_dtype)
        dtype = self.dtype or jnp.result_type(
            *(v for v in (inputs, wi, wo, bi, bo, gamma, beta) if v is not None)
        )
        mask = self._dropout_mask(inputs.shape[:-1], inter, dtype, deterministic)
        fp8 = fp8_call(self, len(MLP_ROLES))
        y, ln, seen = _layernorm_mlp(
            x, gamma, beta, wi, wo, bi, bo, fp8.meta, fp8.recipe, probe=fp8.probe,
            layernorm_type=self.layernorm_type if self.enable_layernorm else None,
            epsilon=self.epsilon, zero_centered_gamma=self.zero_centered_gamma,
            activations=acts, dropout_mask=mask,
            return_layernorm_output=self.return_layernorm_output, dtype=dtype,
            enabled=fp8.enabled, where=fp8.where,
        )  # fmt: skip
        if fp8.record is not None and seen is not None:
            fp8.record(seen)
        return checkpoint_name(y, self.ffn2_ckpt_name), ln

    def check(self, inputs: Any) -> tuple[jax.Array, tuple[str, ...]]:
        """Every refusal of a call on ``inputs`` (ValueError/TypeError naming the argument);
        returns ``(inputs, activations)`` checked. Shared with :class:`fp8jax.nnx.LayerNormMLP`,
        which calls it with its own call's input."""
        owner = "LayerNormMLP"
        inputs = check_float_array(owner, "inputs", inputs)
        acts = check_activations(owner, self.activations)
        check_off(
            owner, self, "activation_params", "enable_low_rank_adaptation", "dot_1_input_axes",
            "dot_2_input_axes", "quantization_checkpoint_name",
        )  # fmt: skip
        for name in ("ffn1_ckpt_name", "ffn2_ckpt_name"):
            if not isinstance(getattr(self, name), str):
                raise TypeError(f"{owner}: {name} must be a str, got {getattr(self, name)!r}")
        inter = self.intermediate_dim
        if not isinstance(inter, (int, np.integer)) or isinstance(inter, bool) or inter < 1:
            raise ValueError(f"{owner}: intermediate_dim must be a positive int, got {inter!r}")
        if as_tuple(self.axis) not in ((-1,), (inputs.ndim - 1,)):
            raise ValueError(f"{owner}: axis must be -1 (the normalised axis), got {self.axis!r}")
        rate = self.intermediate_dropout_rate
        if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 <= rate < 1:
            raise ValueError(
                f"{owner}: intermediate_dropout_rate must be a float in [0, 1), got {rate!r}"
            )
        for d in self.intermediate_hidden_dropout_dims:
            if not isinstance(d, (int, np.integer)) or not -inputs.ndim <= d < inputs.ndim:
                raise ValueError(
                    f"{owner}: intermediate_hidden_dropout_dims holds {d!r}, not a dim of the "
                    f"rank-{inputs.ndim} hidden activation"
                )
        return inputs, acts

    def _dropout_mask(
        self, lead: tuple[int, ...], inter: int, dtype: Any, deterministic: bool
    ) -> jax.Array | None:
        """Dropout's keep mask divided by the keep rate, ``[..., inter]`` with the broadcast
        dims of size 1; ``None`` when dropout is inactive."""
        rate = float(self.intermediate_dropout_rate)
        if deterministic or rate == 0.0:
            return None
        shape = [*lead, inter]
        for d in self.intermediate_hidden_dropout_dims:
            shape[d] = 1
        keep = jax.random.bernoulli(
            self.make_rng(self.intermediate_dropout_rng_name), 1.0 - rate, tuple(shape)
        )
        return jnp.where(keep, jnp.asarray(1.0 / (1.0 - rate), dtype), jnp.zeros((), dtype))
