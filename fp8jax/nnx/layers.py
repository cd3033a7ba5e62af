"""NNX ``DenseGeneral``, ``LayerNorm``, ``LayerNormDenseGeneral`` and ``LayerNormMLP``.

Each is its Linen twin of :mod:`fp8jax.flax` (same math, params, init and names) as an
``nnx.Module``: sizes positional, everything else keyword-only, ``rngs=`` as in ``flax.nnx``.
Constructed inside ``fp8jax.autocast(enabled=True, recipe=DelayedScaling(...))`` a layer also
holds its FP8 state (:class:`~fp8jax.nnx.Fp8Meta`) and probes (:class:`~fp8jax.nnx.Fp8Probe`);
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

from fp8jax import flax as fflax
from fp8jax.nnx._linen_backed import LinenBacked

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


def positive_int(owner: str, name: str, value: Any) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{owner}: {name} must be a positive int, got {value!r}")
    return int(value)


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


class DenseGeneral(LinenBacked):
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
        rngs: nnx.Rngs,
    ) -> None:
        owner = "DenseGeneral"
        ins = sizes(owner, "in_features", in_features)
        outs = sizes(owner, "out_features", out_features)
        self.in_features, self.out_features = ins, outs
        linen = fflax.DenseGeneral(
            features=outs if len(outs) > 1 else outs[0], axis=axis, use_bias=use_bias,
            dtype=dtype, param_dtype=param_dtype, kernel_init=kernel_init, bias_init=bias_init,
            kernel_axes=tuple(kernel_axes), bias_axes=tuple(bias_axes),
            output_axes=tuple(output_axes),
        )  # fmt: skip
        self._build(linen, (_dense_sample(owner, ins, axis, param_dtype),), rngs=rngs)

    def __call__(self, inputs: jax.Array) -> jax.Array:
        """Contracts ``inputs``' ``axis`` dims with the kernel; returns the rest + features."""
        return self._apply(inputs)


class LayerNorm(LinenBacked):
    """LayerNorm or RMSNorm over the last axis (:class:`fp8jax.flax.LayerNorm`): params
    ``scale`` and (LayerNorm) ``ln_bias``; fp8jax's norm kernel inside ``autocast``.

    Args:
      num_features: size of the last axis.
      **config: the Linen twin's attributes (``epsilon``, ``layernorm_type``,
        ``zero_centered_gamma``, ``scale_init``, ``dtype``, ``param_dtype``, ...).
      rngs: ``rngs.params()`` draws the init key.
    """

    _HAS_GEMM = False

    def __init__(self, num_features: int, *, rngs: nnx.Rngs, **config: Any) -> None:
        owner = "LayerNorm"
        self.num_features = positive_int(owner, "num_features", num_features)
        cfg = linen_config(owner, fflax.LayerNorm, config, set())
        x = sample((1, self.num_features), cfg.get("param_dtype"))
        self._build(fflax.LayerNorm(**cfg), (x,), rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self._apply(x)


class LayerNormDenseGeneral(LinenBacked):
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
        rngs: nnx.Rngs,
        **config: Any,
    ) -> None:
        owner = "LayerNormDenseGeneral"
        self.in_features = positive_int(owner, "in_features", in_features)
        outs = sizes(owner, "out_features", out_features)
        self.out_features = outs
        cfg = linen_config(owner, fflax.LayerNormDenseGeneral, config, {"features", "axis"})
        linen = fflax.LayerNormDenseGeneral(features=outs if len(outs) > 1 else outs[0], **cfg)
        x = sample((1, self.in_features), cfg.get("param_dtype"))
        self._build(linen, (x,), rngs=rngs)

    def __call__(self, inputs: jax.Array) -> tuple[jax.Array, jax.Array | None]:
        return self._apply(inputs)


class LayerNormMLP(LinenBacked):
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
        rngs: nnx.Rngs,
        **config: Any,
    ) -> None:
        owner = "LayerNormMLP"
        self.in_features = positive_int(owner, "in_features", in_features)
        cfg = linen_config(owner, fflax.LayerNormMLP, config, {"intermediate_dim", "axis"})
        linen = fflax.LayerNormMLP(intermediate_dim=intermediate_dim, **cfg)
        x = sample((1, self.in_features), cfg.get("param_dtype"))
        self._build(
            linen, (x,), rngs=rngs, init_kwargs={"deterministic": True},
            dropout_rng_name=linen.intermediate_dropout_rng_name, deterministic=deterministic,
        )  # fmt: skip

    def __call__(
        self,
        inputs: jax.Array,
        *,
        deterministic: bool | None = None,
        rngs: nnx.Rngs | jax.Array | None = None,
    ) -> tuple[jax.Array, jax.Array | None]:
        """The block on ``inputs`` ``[..., in_features]``; ``deterministic`` (default: the
        attribute) turns dropout off; ``rngs`` overrides the kept dropout stream."""
        return self._apply(inputs, deterministic=deterministic, rngs=rngs)
