"""NNX ``DenseGeneral``, ``LayerNorm``, ``LayerNormDenseGeneral`` and ``LayerNormMLP``.

Native ``nnx.Module``s over the layer spec of :mod:`fp8jax.layers`: each holds its config as
``config`` (the fields of its Linen twin in :mod:`fp8jax.flax`, checked by the same ``check``),
draws its params from the config's list (the same key gives the same params as the twin), and
runs the config's forward, fp8jax's functional layers (:func:`fp8jax.dense`,
:func:`fp8jax.layernorm_dense`, :func:`fp8jax.layernorm_mlp`, the norm ops). Sizes positional,
everything else keyword-only, ``rngs=`` as in ``flax.nnx``. Constructed inside
``fp8jax.autocast(enabled=True, recipe=DelayedScaling(...))`` a layer also holds its FP8 state
(``fp8_meta``: :class:`~fp8jax.nnx.Fp8MetaVariable`) and probe (``fp8_probe``:
:class:`~fp8jax.nnx.Fp8Probe`); called inside ``autocast`` it runs its GEMMs in FP8, outside it
in high precision.

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

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from fp8jax.layers.checks import positive_int
from fp8jax.layers.dense import DenseGeneralConfig, LayerNormConfig, LayerNormDenseGeneralConfig
from fp8jax.layers.mlp import LayerNormMLPConfig
from fp8jax.layers.params import Initializer, lecun_normal, zeros
from fp8jax.nnx._base import Fp8Module, Keys, keys_for
from fp8jax.nnx._probe import check_recipe, fp8_use

__all__ = ["DenseGeneral", "LayerNorm", "LayerNormDenseGeneral", "LayerNormMLP", "make_config"]


def make_config(owner: str, cls: type, config: Mapping[str, Any], **fixed: Any) -> Any:
    """A ``cls`` config from a constructor's keyword arguments ``config`` and its ``fixed``
    ones (the sizes it takes positionally); a TypeError names an unknown or fixed keyword.
    Lists become tuples, so the config stays hashable."""
    fields = {f.name for f in dataclasses.fields(cls)}
    for key in config:
        if key not in fields or key in fixed:
            raise TypeError(f"{owner}: unexpected keyword argument {key!r}")
    kw = {k: tuple(v) if isinstance(v, list) else v for k, v in config.items()}
    return cls(**fixed, **kw)


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


def _contracted(owner: str, in_features: tuple[int, ...], axis: Any) -> tuple[int, ...]:
    """The kernel's contracted dims: ``in_features`` (one per entry of ``axis``, in the order
    given) in the order of the input's dims, as the Linen twin's kernel has them."""
    axes = (axis,) if isinstance(axis, (int, np.integer)) else tuple(axis)
    if len(axes) != len(in_features):
        raise ValueError(
            f"{owner}: axis={axis!r} names {len(axes)} dims but in_features has {len(in_features)}"
        )
    if any(not isinstance(a, (int, np.integer)) or isinstance(a, bool) for a in axes):
        raise TypeError(f"{owner}: axis must be an int or a tuple of ints, got {axis!r}")
    rank = max([len(axes) + 1, *(a + 1 for a in axes if a >= 0), *(-a for a in axes if a < 0)])
    normalized = [a % rank for a in axes]
    if len(set(normalized)) != len(normalized):
        raise ValueError(f"{owner}: axis={axis!r} names a dim twice")
    by_dim = dict(zip(normalized, in_features, strict=True))
    return tuple(by_dim[a] for a in sorted(by_dim))


def _features(features: Any) -> tuple[int, ...]:
    return (int(features),) if np.ndim(features) == 0 else tuple(int(f) for f in features)


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
        kernel_init: Initializer = lecun_normal,
        bias_init: Initializer = zeros,
        kernel_axes: tuple[str | None, ...] = (),
        bias_axes: tuple[str | None, ...] = (),
        output_axes: tuple[str | None, ...] = (),
        rngs: nnx.Rngs | None = None,
        _config: DenseGeneralConfig | None = None,
        _keys: Keys | None = None,
    ) -> None:
        owner = "DenseGeneral"
        ins = sizes(owner, "in_features", in_features)
        if _config is None:
            outs = sizes(owner, "out_features", out_features)
            _config = DenseGeneralConfig(
                features=outs if len(outs) > 1 else outs[0], axis=axis, use_bias=use_bias,
                dtype=dtype, param_dtype=param_dtype, kernel_init=kernel_init,
                bias_init=bias_init, kernel_axes=tuple(kernel_axes), bias_axes=tuple(bias_axes),
                output_axes=tuple(output_axes),
            )  # fmt: skip
        self.config = _config
        _config.check_config()
        contract = _contracted(owner, ins, _config.axis)
        self._draw(owner, _config.param_specs(contract), keys_for(owner, rngs, _keys))
        self._fp8_state(_config.n_roles)
        self.out_features = _features(_config.features)
        self.in_features = contract

    def __call__(self, inputs: jax.Array) -> jax.Array:
        """Contracts ``inputs``' ``axis`` dims with the kernel; returns the rest + features."""
        owner, cfg = "DenseGeneral", self.config
        _, inputs = cfg.check(inputs)
        fp8 = fp8_use(owner, self._recipe, getattr(self, "fp8_meta", None),
                      getattr(self, "fp8_probe", None))  # fmt: skip
        return cfg.forward(inputs, self._values(("kernel", "bias")), fp8, owner)


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
        _config: LayerNormConfig | None = None,
        _keys: Keys | None = None,
        **config: Any,
    ) -> None:
        owner = "LayerNorm"
        num_features = positive_int(owner, "num_features", num_features)
        if _config is None:
            _config = make_config(owner, LayerNormConfig, config)
        self.config = _config
        _config.check_config()
        self._draw(owner, _config.param_specs(num_features), keys_for(owner, rngs, _keys))
        self._recipe = None
        self.num_features = num_features

    def __call__(self, x: jax.Array) -> jax.Array:
        x = self.config.check(x)
        check_recipe("LayerNorm", None, needs_state=False)
        return self.config.forward(x, self._values(("scale", "ln_bias")))


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
        _config: LayerNormDenseGeneralConfig | None = None,
        _keys: Keys | None = None,
        **config: Any,
    ) -> None:
        owner = "LayerNormDenseGeneral"
        in_features = positive_int(owner, "in_features", in_features)
        if _config is None:
            outs = sizes(owner, "out_features", out_features)
            features = outs if len(outs) > 1 else outs[0]
            if "axis" in config:
                raise TypeError(f"{owner}: unexpected keyword argument 'axis'")
            _config = make_config(owner, LayerNormDenseGeneralConfig, config, features=features)
        self.config = _config
        _config.check_config()
        self._draw(owner, _config.param_specs(in_features), keys_for(owner, rngs, _keys))
        self._fp8_state(_config.n_roles)
        self.in_features = in_features
        self.out_features = _features(_config.features)

    def __call__(self, inputs: jax.Array) -> tuple[jax.Array, jax.Array | None]:
        owner, cfg = "LayerNormDenseGeneral", self.config
        inputs, _ = cfg.check(inputs)
        fp8 = fp8_use(owner, self._recipe, getattr(self, "fp8_meta", None),
                      getattr(self, "fp8_probe", None))  # fmt: skip
        params = self._values(("scale", "ln_bias", "kernel", "bias"))
        return cfg.forward(inputs, params, fp8, owner)


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
        _config: LayerNormMLPConfig | None = None,
        _keys: Keys | None = None,
        **config: Any,
    ) -> None:
        owner = "LayerNormMLP"
        in_features = positive_int(owner, "in_features", in_features)
        if _config is None:
            if "axis" in config:
                raise TypeError(f"{owner}: unexpected keyword argument 'axis'")
            _config = make_config(owner, LayerNormMLPConfig, config,
                                  intermediate_dim=intermediate_dim)  # fmt: skip
        self.config = _config
        _config.check_config()
        self._draw(owner, _config.param_specs(in_features), keys_for(owner, rngs, _keys))
        self._fp8_state(_config.n_roles)
        self.in_features = in_features
        self._dropout_stream(rngs, _config.intermediate_dropout_rng_name, deterministic)

    def __call__(
        self,
        inputs: jax.Array,
        *,
        deterministic: bool | None = None,
        rngs: nnx.Rngs | nnx.RngStream | jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array | None]:
        """The block on ``inputs`` ``[..., in_features]``; ``deterministic`` (default: the
        attribute) turns dropout off; ``rngs`` overrides the kept dropout stream."""
        owner, cfg = "LayerNormMLP", self.config
        inputs, acts = cfg.check(inputs)
        deterministic = self._deterministic(deterministic)
        key = self._dropout_key(rngs) if cfg.dropout_on(deterministic) else None
        fp8 = fp8_use(owner, self._recipe, getattr(self, "fp8_meta", None),
                      getattr(self, "fp8_probe", None))  # fmt: skip
        names = ("scale", "ln_bias", "wi_kernel", "wo_kernel", "wi_bias", "wo_bias")
        return cfg.forward(inputs, self._values(names), acts, fp8, owner, key)
