"""Flax Linen ``MoEBlock``: a mixture-of-experts MLP block in FP8, with TransformerEngine's MoE
argument and param names (``gate_kernel``, ``wi_0``, ``wi_1``, ``wo``, ...).

>>> import jax, jax.numpy as jnp, fp8jax
>>> from fp8jax.flax import MoEBlock
>>> block = MoEBlock(num_experts=4, num_experts_per_tok=2, intermediate_size=8)
>>> with fp8jax.autocast(enabled=True, recipe=fp8jax.DelayedScaling(amax_history_len=8)):
...     variables = block.init(jax.random.key(0), jnp.ones((2, 3, 16)))
>>> jax.tree.map(jnp.shape, variables["params"])  # doctest: +NORMALIZE_WHITESPACE
{'gate_kernel': (16, 4), 'wi_0': (4, 16, 8), 'wi_1': (4, 16, 8), 'wo': (4, 8, 16)}
>>> jax.tree.map(jnp.shape, variables["fp8_meta"])  # one GEMM triple per expert and GEMM
{'amax_history': (24, 8), 'scale': (24,)}
"""

from __future__ import annotations

import flax.linen as nn
import jax

from fp8jax.flax._params import declare
from fp8jax.flax._variables import fp8_call
from fp8jax.flax.mlp import LayerNormMLP
from fp8jax.layers.moe import MoEBlockConfig

__all__ = ["MoEBlock"]


class MoEBlock(MoEBlockConfig, nn.Module):
    """A mixture-of-experts MLP block: router, sort-based dispatch, gated experts on the ragged
    grouped FP8 GEMM, weighted combine (:func:`fp8jax.moe` describes each step).

    Returns ``(out, aux_loss)`` as TransformerEngine's MoE block does: ``out`` has the input's
    shape; ``aux_loss`` is the router's load-balancing loss plus its z-loss (float32, each times
    its coefficient), ``None`` when both coefficients are 0. Each loss is also sown (when
    its coefficient is not 0) into the ``"intermediates"`` collection as ``aux_loss`` and
    ``z_loss`` (``apply(..., mutable=["intermediates"])``), which is how a
    :class:`~fp8jax.flax.TransformerLayer` with ``mlp="moe"`` hands them on.

    Inside ``fp8jax.autocast(enabled=True, ...)`` every expert GEMM runs in FP8 with a scale
    per expert (DelayedScaling: one state row per expert and tensor, ``6 * num_experts`` rows
    in ``fp8_meta``; block scaling: each expert's own 128 x 128 blocks); the router always runs in
    float32. Outside it is the same block in high precision, equal to the plain JAX block
    (``jax.lax.ragged_dot``) with the same params.

    Params (TE's names and shapes): ``gate_kernel (hidden, num_experts)``, ``wi_0``, ``wi_1``
    ``(num_experts, hidden, intermediate_size)``, ``wo (num_experts, intermediate_size,
    hidden)``; ``use_ffn_bias``: ``wi_0_bias``, ``wi_1_bias`` ``(num_experts,
    intermediate_size)``, ``wo_bias (num_experts, hidden)``; ``use_expert_routing_bias``:
    ``expert_bias (num_experts,)`` (float32); ``enable_layernorm``: ``scale``/``ln_bias``; and
    the child ``shared_experts`` (a :class:`LayerNormMLP`) with
    ``shared_expert_intermediate_size``.

    Attributes:
      num_experts, num_experts_per_tok, intermediate_size: experts, top-k, expert width.
      activation_type: the gated activation: ``"silu"`` (SwiGLU, default), ``"gelu"`` (GeGLU,
        tanh approximation), ``"gelu_exact"``, ``"relu"``.
      score_function, use_pre_softmax, num_groups, group_topk, scaling_factor,
        use_expert_routing_bias: the router, as TE's ``fused_topk_with_score_function``
        (``num_groups``/``group_topk``: DeepSeek-V3's group-limited routing; the bias only
        chooses, with ``"sigmoid"``).
      aux_loss_coeff: TE's load-balancing loss coefficient. z_loss_coeff: the router z-loss's.
      capacity_factor: ``None`` (default): dropless; else each expert takes at most
        ``ceil(tokens * k / num_experts * capacity_factor)`` assignments, the rest are dropped
        (their tokens keep only the residual and the shared experts).
      shared_expert_intermediate_size: width of the shared experts' gated MLP (0: none).
      enable_layernorm, layernorm_type, epsilon, zero_centered_gamma, scale_init, scale_axes,
        ln_bias_init, ln_bias_axes: an optional pre-norm (as :class:`LayerNormMLP`'s), whose
        output feeds the router, the experts and the shared experts.
      gate_kernel_axes, wi_kernel_axes, wo_kernel_axes, input_axes: logical axis names (TE's
        fields; default none, where TE's default ``("exp", "embed", "mlp")``).
      expert_axis, data_parallelism_axes: expert parallelism over the mesh set by
        ``jax.set_mesh``: experts split over ``expert_axis`` (TE's ``ep_resource``), tokens
        over ``data_parallelism_axes + (expert_axis,)``; FP8 codes cross the all-to-all.
      kernel_init, bias_init, expert_bias_init, use_ffn_bias: TE's (each expert's matrix is its
        own draw of ``kernel_init``, so its fan-in is ``hidden``, not ``num_experts *
        hidden``).
      dtype, param_dtype: computation dtype (default: promoted), params' dtype.
    """

    @nn.compact
    def __call__(self, inputs: jax.Array) -> tuple[jax.Array, jax.Array | None]:
        """The block on ``inputs [..., hidden]``."""
        inputs = self.check(inputs)
        params = declare(self, "MoEBlock", self.param_specs(inputs.shape[-1]))
        fp8 = fp8_call(self, self.n_roles)
        children = self.submodule_configs()
        shared = None
        if children:
            config = children["shared_experts"]
            fields = {f: getattr(config, f) for f in config.__dataclass_fields__}
            module = LayerNormMLP(**fields, name="shared_experts")
            shared = lambda x: module(x, deterministic=True)
        r = self.forward(inputs, params, fp8, fp8.where, shared)
        return r.out, _sow_losses(self, r)


def _sow_losses(module: nn.Module, r) -> jax.Array | None:
    """Sows each router loss whose coefficient is set; returns their sum (``None``: none)."""
    total = None
    for name, value, coeff in (
        ("aux_loss", r.aux_loss, module.aux_loss_coeff),
        ("z_loss", r.z_loss, module.z_loss_coeff),
    ):
        if coeff:
            module.sow("intermediates", name, value)
            total = value if total is None else total + value
    return total
