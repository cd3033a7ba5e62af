"""NNX ``LayerNorm`` and ``LayerNormDenseGeneral``: native ``nnx.Module``s over the configs of
:mod:`fp8jax.layers.layernorm`, computing with the norm ops and :func:`fp8jax.layernorm_dense`
(as :mod:`fp8jax.nnx.dense` describes for ``DenseGeneral``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
from flax import nnx

from fp8jax.layers.checks import positive_int
from fp8jax.layers.layernorm import LayerNormConfig, LayerNormDenseGeneralConfig
from fp8jax.nnx._base import Fp8Module, Keys, feature_sizes, keys_for, make_config, sizes
from fp8jax.nnx._probe import check_recipe, fp8_use

__all__ = ["LayerNorm", "LayerNormDenseGeneral"]


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
        self.out_features = feature_sizes(_config.features)

    def __call__(self, inputs: jax.Array) -> tuple[jax.Array, jax.Array | None]:
        owner, cfg = "LayerNormDenseGeneral", self.config
        inputs, _ = cfg.check(inputs)
        fp8 = fp8_use(owner, self._recipe, getattr(self, "fp8_meta", None),
                      getattr(self, "fp8_probe", None))  # fmt: skip
        params = self._values(("scale", "ln_bias", "kernel", "bias"))
        return cfg.forward(inputs, params, fp8, owner)
