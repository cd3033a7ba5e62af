"""NNX ``DenseGeneral``: a native ``nnx.Module`` over the layer spec of :mod:`fp8jax.layers`
(:class:`~fp8jax.layers.DenseGeneralConfig`), computing with :func:`fp8jax.dense`.

It holds its config as ``config`` (the fields of its Linen twin :class:`fp8jax.flax.DenseGeneral`,
checked by the same ``check``) and draws its params from the config's list (the same key gives
the same params as the twin). Sizes positional, everything else keyword-only, ``rngs=`` as in
``flax.nnx``. Constructed inside ``fp8jax.autocast(enabled=True, recipe=DelayedScaling(...))``
it also holds its FP8 state (``fp8_meta``: :class:`~fp8jax.nnx.Fp8MetaVariable`) and probe
(``fp8_probe``: :class:`~fp8jax.nnx.Fp8Probe`); called inside ``autocast`` it runs its GEMM in
FP8, outside it in high precision.

>>> import jax, jax.numpy as jnp, fp8jax
>>> from flax import nnx
>>> with fp8jax.autocast(enabled=True, recipe=fp8jax.DelayedScaling(amax_history_len=8)):
...     layer = fp8jax.nnx.DenseGeneral(3, 4, rngs=nnx.Rngs(0))
>>> jax.tree.map(jnp.shape, nnx.to_pure_dict(nnx.state(layer)))  # doctest: +NORMALIZE_WHITESPACE
{'bias': (4,), 'fp8_meta': {'amax_history': (3, 8), 'scale': (3,)},
 'fp8_probe': {'call_0': (3,)}, 'kernel': (3, 4)}
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from fp8jax.layers.dense import DenseGeneralConfig
from fp8jax.layers.params import Initializer, lecun_normal, zeros
from fp8jax.nnx._base import Fp8Module, Keys, feature_sizes, keys_for, sizes
from fp8jax.nnx._probe import fp8_use

__all__ = ["DenseGeneral"]


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
        self.out_features = feature_sizes(_config.features)
        self.in_features = contract

    def __call__(self, inputs: jax.Array) -> jax.Array:
        """Contracts ``inputs``' ``axis`` dims with the kernel; returns the rest + features."""
        owner, cfg = "DenseGeneral", self.config
        _, inputs = cfg.check(inputs)
        fp8 = fp8_use(owner, self._recipe, getattr(self, "fp8_meta", None),
                      getattr(self, "fp8_probe", None))  # fmt: skip
        return cfg.forward(inputs, self._values(("kernel", "bias")), fp8, owner)
