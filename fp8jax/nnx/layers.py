"""NNX ``DenseGeneral``, ``LayerNorm``, ``LayerNormDenseGeneral`` and ``LayerNormMLP``.

Native ``nnx.Module``s whose ``__call__`` runs fp8jax's functional layers
(:func:`fp8jax.dense`, :func:`fp8jax.layernorm_dense`, :func:`fp8jax.layernorm_mlp`, the norm
ops) on their variables; their params, init and names are those of the Linen twins of
:mod:`fp8jax.flax` (the same key gives the same params). Sizes positional, everything else
keyword-only, ``rngs=`` as in ``flax.nnx``. Constructed inside ``fp8jax.autocast(enabled=True,
recipe=DelayedScaling(...))`` a layer also holds its FP8 state (``fp8_meta``:
:class:`~fp8jax.nnx.Fp8MetaVariable`) and probe (``fp8_probe``: :class:`~fp8jax.nnx.Fp8Probe`);
called inside ``autocast`` it runs its GEMMs in FP8, outside it in high precision.

>>> import jax, jax.numpy as jnp, fp8jax
>>> from flax import nnx
>>> with fp8jax.autocast(enabled=True, recipe=fp8jax.DelayedScaling(amax_history_len=8)):
...     layer = fp8jax.nnx.DenseGeneral(3, 4, rngs=nnx.Rngs(0))
>>> jax.tree.map(jnp.shape, nnx.to_pure_dict(nnx.state(layer)))  # doctest: +NORMALIZE_WHITESPACE
{'bias': (4,), 'fp8_meta': {'amax_history': (3, 8), 'scale': (3,)},
 'fp8_probe': {'call_0': (3,)}, 'kernel': (3, 4)}
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from fp8jax import flax as fflax
from fp8jax._norm_layer import norm_layer
from fp8jax.dense import _dense
from fp8jax.flax._params import constrain, laid_out, normalize_axes
from fp8jax.layernorm_dense import _layernorm_dense
from fp8jax.layernorm_mlp import _layernorm_mlp
from fp8jax.nnx._base import Fp8Module, Given, linen_init, positive_int
from fp8jax.nnx._probe import check_recipe, fp8_use

__all__ = ["DenseGeneral", "LayerNorm", "LayerNormDenseGeneral", "LayerNormMLP"]

_KERNEL_INIT = nn.initializers.lecun_normal()  # flax's DenseGeneral defaults
_BIAS_INIT = nn.initializers.zeros_init()


def linen_config(owner: str, linen_cls: type, config: Mapping[str, Any], fixed: set[str]) -> dict:
    """``config`` checked against the fields of ``linen_cls`` (TypeError naming an unknown or
    fixed one); tuples for lists, so the config stays hashable."""
    fields = {f.name for f in dataclasses.fields(linen_cls)} - {"parent", "name"}
    for key in config:
        if key not in fields or key in fixed:
            raise TypeError(f"{owner}: unexpected keyword argument {key!r}")
    return {k: tuple(v) if isinstance(v, list) else v for k, v in config.items()}


def sizes(owner: str, name: str, value: Any) -> tuple[int, ...]:
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        return (positive_int(owner, name, value),)
    try:
        out = tuple(value)
    except TypeError:
        raise TypeError(
            f"{owner}: {name} must be an int or a tuple of ints, got {value!r}"
        ) from None
    if not out:
        raise ValueError(f"{owner}: {name} must not be empty")
    return tuple(positive_int(owner, name, v) for v in out)


def sample(dims: Sequence[int], dtype: Any) -> jax.Array:
    return jnp.zeros(tuple(dims), jnp.float32 if dtype is None else dtype)


def _dense_sample(owner: str, in_features: tuple[int, ...], axis: Any, dtype: Any) -> jax.Array:
    """A one-example input whose ``axis`` dims are ``in_features`` (in the order given)."""
    axes = (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis)
    if len(axes) != len(in_features):
        raise ValueError(
            f"{owner}: axis={axis!r} names {len(axes)} dims but in_features has {len(in_features)}"
        )
    if any(not isinstance(a, (int, np.integer)) or isinstance(a, bool) for a in axes):
        raise TypeError(f"{owner}: axis must be an int or a tuple of ints, got {axis!r}")
    rank = max([len(axes) + 1, *(a + 1 for a in axes if a >= 0), *(-a for a in axes if a < 0)])
    dims = [1] * rank
    normalized = [a % rank for a in axes]
    if len(set(normalized)) != len(normalized):
        raise ValueError(f"{owner}: axis={axis!r} names a dim twice")
    for a, n in zip(normalized, in_features, strict=True):
        dims[a] = n
    return sample(dims, dtype)


def _features(linen_features: Any) -> tuple[int, ...]:
    return (int(linen_features),) if np.ndim(linen_features) == 0 else tuple(linen_features)


class DenseGeneral(Fp8Module):
    """FP8 dense layer (:class:`fp8jax.flax.DenseGeneral` as an ``nnx.Module``).

    ``kernel`` ``(*in_features, *out_features)`` and ``bias`` ``out_features``, drawn as
    ``flax.linen.DenseGeneral`` draws them; FP8 state of 3 roles (input, kernel, output-grad).

    Args:
      in_features: size(s) of the contracted input dims (``axis``).
      out_features: int or tuple of output features.
      axis: input dims to contract (default the last).
      use_bias, dtype, param_dtype, kernel_init, bias_init: as ``flax.nnx.LinearGeneral``.
      kernel_axes, bias_axes: logical axis names of the params (``()``: none), kept as
        ``out_sharding`` metadata (``nnx.get_partition_spec`` with
        ``flax.linen.logical_axis_rules`` maps them onto a mesh).
      output_axes: logical names constraining the output (``()``: none).
      rngs: ``rngs.params()`` draws the init key.
    """

    def __init__(
        self,
        in_features: int | Sequence[int],
        out_features: int | Sequence[int],
        *,
        axis: int | Sequence[int] = -1,
        use_bias: bool = True,
        dtype: Any = None,
        param_dtype: Any = jnp.float32,
        kernel_init: Any = _KERNEL_INIT,
        bias_init: Any = _BIAS_INIT,
        kernel_axes: tuple[str | None, ...] = (),
        bias_axes: tuple[str | None, ...] = (),
        output_axes: tuple[str | None, ...] = (),
        rngs: nnx.Rngs | None = None,
        _given: Given | None = None,
    ) -> None:
        owner = "DenseGeneral"
        if _given is None:
            ins = sizes(owner, "in_features", in_features)
            outs = sizes(owner, "out_features", out_features)
            linen = fflax.DenseGeneral(
                features=outs if len(outs) > 1 else outs[0], axis=axis, use_bias=use_bias,
                dtype=dtype, param_dtype=param_dtype, kernel_init=kernel_init,
                bias_init=bias_init, kernel_axes=tuple(kernel_axes), bias_axes=tuple(bias_axes),
                output_axes=tuple(output_axes),
            )  # fmt: skip
            _given = linen_init(owner, linen, (_dense_sample(owner, ins, axis, param_dtype),), rngs)
        self._adopt(_given)
        outs = _features(_given.linen.features)
        self.out_features = outs
        self.in_features = tuple(self.kernel.get_value().shape[: -len(outs)])

    def __call__(self, inputs: jax.Array) -> jax.Array:
        """Contracts ``inputs``' ``axis`` dims with the kernel; returns the rest + features."""
        owner, cfg = "DenseGeneral", self._linen
        _, inputs = cfg.check(inputs)
        inputs = constrain(owner, "input_axes", inputs, cfg.input_axes or ())
        axes = normalize_axes(owner, "axis", cfg.axis, inputs.ndim)
        kernel, bias = self._value("kernel"), self._value("bias")
        dtype = cfg.dtype
        if dtype is None:
            dtype = jnp.result_type(*(v for v in (inputs, kernel, bias) if v is not None))
        fp8 = fp8_use(owner, self._recipe, getattr(self, "fp8_meta", None),
                      getattr(self, "fp8_probe", None))  # fmt: skip

        def dense(x: jax.Array) -> jax.Array:
            y, seen = _dense(
                x, kernel, bias, fp8.meta, fp8.recipe, probe=fp8.probe, axis=axes, dtype=dtype,
                enabled=fp8.enabled, where=owner,
            )  # fmt: skip
            if fp8.record is not None and seen is not None:
                fp8.record(seen)
            return y

        return laid_out(owner, cfg.output_axes, inputs, axes, len(self.out_features), dense)


class LayerNorm(Fp8Module):
    """LayerNorm or RMSNorm over the last axis (:class:`fp8jax.flax.LayerNorm`): params
    ``scale`` and (LayerNorm) ``ln_bias``; fp8jax's norm kernel inside ``autocast``.

    Args:
      num_features: size of the last axis.
      **config: the Linen twin's attributes (``epsilon``, ``layernorm_type``,
        ``zero_centered_gamma``, ``scale_init``, ``dtype``, ``param_dtype``, ...).
      rngs: ``rngs.params()`` draws the init key.
    """

    def __init__(
        self,
        num_features: int,
        *,
        rngs: nnx.Rngs | None = None,
        _given: Given | None = None,
        **config: Any,
    ) -> None:
        owner = "LayerNorm"
        if _given is None:
            num_features = positive_int(owner, "num_features", num_features)
            cfg = linen_config(owner, fflax.LayerNorm, config, set())
            x = sample((1, num_features), cfg.get("param_dtype"))
            _given = linen_init(owner, fflax.LayerNorm(**cfg), (x,), rngs)
        self._adopt(_given)
        self.num_features = int(self.scale.get_value().shape[0])

    def __call__(self, x: jax.Array) -> jax.Array:
        owner, cfg = "LayerNorm", self._linen
        x = cfg.check(x)
        check_recipe(owner, None, needs_state=False)
        gamma, beta = self._value("scale"), self._value("ln_bias")
        dtype = cfg.dtype or jnp.result_type(*(v for v in (x, gamma, beta) if v is not None))
        return norm_layer(x, gamma, beta, cfg.layernorm_type, cfg.epsilon,
                          cfg.zero_centered_gamma, dtype)  # fmt: skip


class LayerNormDenseGeneral(Fp8Module):
    """A norm fused into an FP8 dense layer (:class:`fp8jax.flax.LayerNormDenseGeneral`).

    Returns ``(out, ln_output)`` as the Linen twin.

    Args:
      in_features: size of the last (normalised, contracted) axis.
      out_features: int or tuple of output features (the twin's ``features``).
      **config: the twin's other attributes (``layernorm_type``, ``use_bias``,
        ``kernel_axes``, ``return_layernorm_output``, ...).
      rngs: ``rngs.params()`` draws the init key.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int | Sequence[int],
        *,
        rngs: nnx.Rngs | None = None,
        _given: Given | None = None,
        **config: Any,
    ) -> None:
        owner = "LayerNormDenseGeneral"
        if _given is None:
            in_features = positive_int(owner, "in_features", in_features)
            outs = sizes(owner, "out_features", out_features)
            cfg = linen_config(owner, fflax.LayerNormDenseGeneral, config, {"features", "axis"})
            linen = fflax.LayerNormDenseGeneral(features=outs if len(outs) > 1 else outs[0], **cfg)
            x = sample((1, in_features), cfg.get("param_dtype"))
            _given = linen_init(owner, linen, (x,), rngs)
        self._adopt(_given)
        self.in_features = int(self.kernel.get_value().shape[0])
        self.out_features = _features(_given.linen.features)

    def __call__(self, inputs: jax.Array) -> tuple[jax.Array, jax.Array | None]:
        owner, cfg = "LayerNormDenseGeneral", self._linen
        inputs, _ = cfg.check(inputs)
        x = constrain(owner, "layernorm_input_axes", inputs, cfg.layernorm_input_axes or ())
        if not cfg.enable_layernorm:
            x = constrain(owner, "dot_input_axes", x, cfg.dot_input_axes or ())
        gamma, beta = self._value("scale"), self._value("ln_bias")
        kernel, bias = self._value("kernel"), self._value("bias")
        dtype = cfg.dtype or jnp.result_type(
            *(v for v in (inputs, kernel, bias, gamma, beta) if v is not None)
        )
        fp8 = fp8_use(owner, self._recipe, getattr(self, "fp8_meta", None),
                      getattr(self, "fp8_probe", None))  # fmt: skip
        y, ln, seen = _layernorm_dense(
            x, gamma, beta, kernel, bias, fp8.meta, fp8.recipe, probe=fp8.probe,
            layernorm_type=cfg.layernorm_type if cfg.enable_layernorm else None,
            epsilon=cfg.epsilon, zero_centered_gamma=cfg.zero_centered_gamma,
            return_layernorm_output=cfg.return_layernorm_output, dtype=dtype,
            enabled=fp8.enabled, where=owner,
        )  # fmt: skip
        if fp8.record is not None and seen is not None:
            fp8.record(seen)
        if cfg.depth_scaling is not None:
            y = y / jnp.asarray(cfg.depth_scaling, y.dtype)
        return y, ln


class LayerNormMLP(Fp8Module):
    """An FP8 Transformer MLP block (:class:`fp8jax.flax.LayerNormMLP`): norm, FC1,
    activation, dropout, FC2; returns ``(out, ln_output)``.

    Args:
      in_features: the model width (last axis of the input and of the output).
      intermediate_dim: the hidden width.
      **config: the twin's other attributes (``activations``, ``use_bias``,
        ``intermediate_dropout_rate`` (default 0.0, as TE), ``kernel_axes_1``, ...).
      deterministic: dropout off (``model.eval()`` sets it, ``model.train()`` clears it).
      rngs: ``rngs.params()`` draws the init key; the dropout stream
        (``intermediate_dropout_rng_name``, default ``"dropout"``) is forked and kept.
    """

    def __init__(
        self,
        in_features: int,
        *,
        intermediate_dim: int = 2048,
        deterministic: bool = False,
        rngs: nnx.Rngs | None = None,
        _given: Given | None = None,
        **config: Any,
    ) -> None:
        owner = "LayerNormMLP"
        if _given is None:
            in_features = positive_int(owner, "in_features", in_features)
            cfg = linen_config(owner, fflax.LayerNormMLP, config, {"intermediate_dim", "axis"})
            linen = fflax.LayerNormMLP(intermediate_dim=intermediate_dim, **cfg)
            x = sample((1, in_features), cfg.get("param_dtype"))
            _given = linen_init(owner, linen, (x,), rngs, {"deterministic": True})
        self._adopt(_given)
        self.in_features = int(self.wi_kernel.get_value().shape[0])
        self._dropout_stream(rngs, _given.linen.intermediate_dropout_rng_name, deterministic)

    def __call__(
        self,
        inputs: jax.Array,
        *,
        deterministic: bool | None = None,
        rngs: nnx.Rngs | nnx.RngStream | jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array | None]:
        """The block on ``inputs`` ``[..., in_features]``; ``deterministic`` (default: the
        attribute) turns dropout off; ``rngs`` overrides the kept dropout stream."""
        owner, cfg = "LayerNormMLP", self._linen
        inputs, acts = cfg.check(inputs)
        deterministic = self._deterministic(deterministic)
        x = constrain(owner, "layernorm_input_axes", inputs, cfg.layernorm_input_axes or ())
        gamma, beta = self._value("scale"), self._value("ln_bias")
        wi, wo = self._value("wi_kernel"), self._value("wo_kernel")
        bi, bo = self._value("wi_bias"), self._value("wo_bias")
        dtype = cfg.dtype or jnp.result_type(
            *(v for v in (inputs, wi, wo, bi, bo, gamma, beta) if v is not None)
        )
        mask = None
        rate = float(cfg.intermediate_dropout_rate)
        if not deterministic and rate > 0.0:
            shape = [*inputs.shape[:-1], wi.shape[-1]]
            for d in cfg.intermediate_hidden_dropout_dims:
                shape[d] = 1
            keep = jax.random.bernoulli(self._dropout_key(rngs), 1.0 - rate, tuple(shape))
            mask = jnp.where(keep, jnp.asarray(1.0 / (1.0 - rate), dtype), jnp.zeros((), dtype))
        fp8 = fp8_use(owner, self._recipe, getattr(self, "fp8_meta", None),
                      getattr(self, "fp8_probe", None))  # fmt: skip
        y, ln, seen = _layernorm_mlp(
            x, gamma, beta, wi, wo, bi, bo, fp8.meta, fp8.recipe, probe=fp8.probe,
            layernorm_type=cfg.layernorm_type if cfg.enable_layernorm else None,
            epsilon=cfg.epsilon, zero_centered_gamma=cfg.zero_centered_gamma,
            activations=acts, dropout_mask=mask,
            return_layernorm_output=cfg.return_layernorm_output, dtype=dtype,
            enabled=fp8.enabled, where=owner,
        )  # fmt: skip
        if fp8.record is not None and seen is not None:
            fp8.record(seen)
        return checkpoint_name(y, cfg.ffn2_ckpt_name), ln
