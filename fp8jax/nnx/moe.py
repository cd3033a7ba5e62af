"""NNX ``MoEBlock``: a mixture-of-experts MLP block in FP8 (:class:`fp8jax.flax.MoEBlock` as an
``nnx.Module``: the same config, params, init and forward).

>>> import jax.numpy as jnp, fp8jax
>>> from flax import nnx
>>> with fp8jax.autocast(enabled=True, recipe=fp8jax.DelayedScaling(amax_history_len=8)):
...     block = fp8jax.nnx.MoEBlock(16, num_experts=4, intermediate_size=8, rngs=nnx.Rngs(0))
...     y, aux = block(jnp.ones((2, 3, 16)))
>>> y.shape, block.wi_0.shape, block.fp8_meta.scale.shape, aux
((2, 3, 16), (4, 16, 8), (24,), None)
"""

from __future__ import annotations

import inspect
from typing import Any

import jax
from flax import nnx

from fp8jax.layers.checks import positive_int
from fp8jax.layers.moe import MoEBlockConfig, MoEResult
from fp8jax.nnx._base import Fp8Module, Keys, keys_for, make_config
from fp8jax.nnx._probe import fp8_use
from fp8jax.nnx.mlp import LayerNormMLP

__all__ = ["MoEBlock"]

_PARAMS = (
    "scale",
    "ln_bias",
    "gate_kernel",
    "wi_0",
    "wi_1",
    "wo",
    "wi_0_bias",
    "wi_1_bias",
    "wo_bias",
    "expert_bias",
)


class MoEBlock(Fp8Module):
    """A mixture-of-experts MLP block (:class:`fp8jax.flax.MoEBlock`, whose docstring describes
    the fields); returns ``(out, aux_loss)`` and sows each router loss whose coefficient is set
    as an ``nnx.Intermediate`` (``aux_loss``, ``z_loss``): ``nnx.capture(model,
    nnx.Intermediate)`` collects them (Flax < 0.12.11: ``nnx.pop(model, nnx.Intermediate)``).

    Args:
      in_features: the model width (last axis of the input and of the output).
      **config: the twin's attributes (``num_experts``, ``num_experts_per_tok``,
        ``intermediate_size``, ``activation_type``, ``score_function``, ``capacity_factor``,
        ``shared_expert_intermediate_size``, ``expert_axis``, ...).
      rngs: ``rngs.params()`` draws the init key.

    The shared experts, when configured, are the child ``shared_experts`` (a
    :class:`~fp8jax.nnx.LayerNormMLP`).
    """

    def __init__(
        self,
        in_features: int,
        *,
        rngs: nnx.Rngs | None = None,
        _config: MoEBlockConfig | None = None,
        _keys: Keys | None = None,
        **config: Any,
    ) -> None:
        owner = "MoEBlock"
        in_features = positive_int(owner, "in_features", in_features)
        if _config is None:
            _config = make_config(owner, MoEBlockConfig, config)
        self.config = _config
        _config.check_config()
        keys = keys_for(owner, rngs, _keys)
        self._draw(owner, _config.param_specs(in_features), keys)
        self._fp8_state(_config.n_roles)
        self.in_features = in_features
        for name, child in _config.submodule_configs().items():
            setattr(
                self,
                name,
                LayerNormMLP(
                    in_features,
                    rngs=rngs,
                    deterministic=True,
                    _config=child,
                    _keys=keys.child(name),
                ),
            )

    def __call__(self, inputs: jax.Array) -> tuple[jax.Array, jax.Array | None]:
        """The block on ``inputs [..., in_features]``."""
        owner, cfg = "MoEBlock", self.config
        inputs = cfg.check(inputs)
        fp8 = fp8_use(
            owner, self._recipe, getattr(self, "fp8_meta", None), getattr(self, "fp8_probe", None)
        )
        shared = None
        if cfg.shared_expert_intermediate_size:
            shared = lambda x: self.shared_experts(x, deterministic=True)
        r = cfg.forward(inputs, self._values(_PARAMS), fp8, owner, shared)
        return r.out, self._sow_losses(r)

    def _sow_losses(self, r: MoEResult) -> jax.Array | None:
        total = None
        for name, value, coeff in (
            ("aux_loss", r.aux_loss, self.config.aux_loss_coeff),
            ("z_loss", r.z_loss, self.config.z_loss_coeff),
        ):
            if coeff:
                self.sow(nnx.Intermediate, name, value, **_SOW_KW)
                total = value if total is None else total + value
        return total


# Flax >= 0.12.11 records sown values inside ``nnx.capture`` and deprecates storing them as
# attributes outside it: there the losses are recorded only when captured; older Flax stores
# them as ``nnx.Intermediate`` attributes (``nnx.pop(model, nnx.Intermediate)``).
_SOW_KW = (
    {"capture_noop": True} if "capture_noop" in inspect.signature(nnx.Module.sow).parameters else {}
)
