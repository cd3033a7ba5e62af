"""The config of ``MoEBlock`` (a mixture-of-experts MLP block): fields with TransformerEngine's
names where TE's MoE block has the concept (``num_experts``, ``num_experts_per_tok``,
``intermediate_size``, ``activation_type``, ``score_function``, ...), every refusal of a call,
the params as data, the shared experts as a child config, and the forward on given params (the
same in both Flax APIs). :class:`fp8jax.flax.MoEBlock` documents the fields."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fp8jax.functional.layernorm import norm_layer
from fp8jax.functional.moe import MOE_ACTIVATIONS, SCORE_FUNCTIONS, MoEConfig, moe, moe_roles
from fp8jax.layers.checks import check_float_array, positive_int
from fp8jax.layers.layernorm import norm_param_specs
from fp8jax.layers.layout import constrain
from fp8jax.layers.mlp import LayerNormMLPConfig
from fp8jax.layers.params import Initializer, ParamSpec, default_kernel_init, zeros
from fp8jax.ops.base import partition

__all__ = ["MoEBlockConfig", "MoEResult", "experts_init"]


def experts_init(init: Initializer, n: int) -> Initializer:
    """``(n, fan_in, fan_out)`` from ``n`` independent draws of ``init`` on ``(fan_in,
    fan_out)`` (one key each), so each expert's matrix has the fan-in of a dense layer's."""

    def wrapped(rng: jax.Array, shape: tuple[int, ...], dtype: Any = jnp.float32) -> Any:
        keys = jax.random.split(rng, n)
        return jnp.stack([init(k, shape[1:], dtype) for k in keys])

    return wrapped


class MoEResult(NamedTuple):
    """A call's output ``[..., hidden]`` and its router losses (float32 scalars, times their
    coefficients)."""

    out: jax.Array
    aux_loss: jax.Array
    z_loss: jax.Array


@dataclasses.dataclass(unsafe_hash=True)
class MoEBlockConfig:
    """The config of ``MoEBlock`` (:class:`fp8jax.flax.MoEBlock` documents the fields)."""

    num_experts: int = 8
    num_experts_per_tok: int = 2
    intermediate_size: int = 2048
    activation_type: str = "silu"
    score_function: str = "softmax"
    use_pre_softmax: bool = False
    num_groups: int | None = None
    group_topk: int | None = None
    scaling_factor: float = 1.0
    use_expert_routing_bias: bool = False
    aux_loss_coeff: float = 0.0
    z_loss_coeff: float = 0.0
    capacity_factor: float | None = None
    shared_expert_intermediate_size: int = 0
    enable_layernorm: bool = False
    layernorm_type: str = "layernorm"
    epsilon: float = 1e-6
    zero_centered_gamma: bool = False
    scale_init: Initializer | None = None
    scale_axes: tuple[str | None, ...] = ()
    ln_bias_init: Initializer = zeros
    ln_bias_axes: tuple[str | None, ...] = ()
    gate_kernel_axes: tuple[str | None, ...] = ()
    wi_kernel_axes: tuple[str | None, ...] = ()
    wo_kernel_axes: tuple[str | None, ...] = ()
    input_axes: tuple[str | None, ...] = ()
    expert_axis: str | None = None
    data_parallelism_axes: tuple[str, ...] = ()
    kernel_init: Initializer | None = None
    bias_init: Initializer = zeros
    expert_bias_init: Initializer = zeros
    use_ffn_bias: bool = False
    dtype: Any = None
    param_dtype: Any = jnp.float32

    def check(self, inputs: Any) -> jax.Array:
        """Every refusal of a call on ``inputs`` ``[..., hidden]`` (ValueError/TypeError
        naming the argument); returns ``inputs`` checked."""
        inputs = check_float_array("MoEBlock", "inputs", inputs)
        if inputs.ndim < 1:
            raise ValueError("MoEBlock: inputs must have a hidden (last) dim, got a scalar")
        self.check_config()
        return inputs

    def check_config(self) -> None:
        """The refusals of the configuration alone."""
        owner = "MoEBlock"
        e = positive_int(owner, "num_experts", self.num_experts)
        k = positive_int(owner, "num_experts_per_tok", self.num_experts_per_tok)
        positive_int(owner, "intermediate_size", self.intermediate_size)
        if k > e:
            raise ValueError(f"{owner}: num_experts_per_tok={k} must be at most num_experts={e}")
        if self.activation_type not in MOE_ACTIVATIONS:
            raise ValueError(
                f"{owner}: activation_type must be one of {sorted(MOE_ACTIVATIONS)} (the gated "
                f"experts' activation: swiglu with 'silu', geglu with 'gelu'), got "
                f"{self.activation_type!r}"
            )
        if self.score_function not in SCORE_FUNCTIONS:
            raise ValueError(
                f"{owner}: score_function must be 'softmax' or 'sigmoid', got "
                f"{self.score_function!r}"
            )
        if (self.num_groups is None) != (self.group_topk is None):
            raise ValueError(f"{owner}: set both num_groups and group_topk, or neither")
        if self.num_groups is not None:
            g = positive_int(owner, "num_groups", self.num_groups)
            gk = positive_int(owner, "group_topk", self.group_topk)
            if e % g or gk > g or k % gk:
                raise ValueError(
                    f"{owner}: group-limited routing needs num_groups={g} to divide "
                    f"num_experts={e}, group_topk={gk} <= num_groups and group_topk to divide "
                    f"num_experts_per_tok={k}"
                )
        if self.use_expert_routing_bias and self.score_function != "sigmoid":
            raise ValueError(
                f"{owner}: use_expert_routing_bias needs score_function='sigmoid' (as in "
                "TransformerEngine)"
            )
        for name in ("aux_loss_coeff", "z_loss_coeff", "scaling_factor"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
                raise ValueError(f"{owner}: {name} must be a float >= 0, got {v!r}")
        cf = self.capacity_factor
        if cf is not None and (
            isinstance(cf, bool) or not isinstance(cf, (int, float)) or not cf > 0
        ):
            raise ValueError(f"{owner}: capacity_factor must be None or a float > 0, got {cf!r}")
        s = self.shared_expert_intermediate_size
        if isinstance(s, bool) or not isinstance(s, int) or s < 0:
            raise ValueError(
                f"{owner}: shared_expert_intermediate_size must be an int >= 0, got {s!r}"
            )
        if self.expert_axis is not None and not isinstance(self.expert_axis, str):
            raise TypeError(f"{owner}: expert_axis must be a mesh axis name (str) or None")

    @property
    def n_roles(self) -> int:
        """The FP8 state rows of the routed experts (:func:`fp8jax.moe_roles`)."""
        return len(moe_roles(self.num_experts))

    def param_specs(self, hidden: int) -> dict[str, ParamSpec]:
        """The norm's ``scale``/``ln_bias`` (with ``enable_layernorm``), then TE's
        ``gate_kernel (hidden, E)``, ``wi_0``, ``wi_1`` ``(E, hidden, I)``, ``wo (E, I,
        hidden)``, with ``use_ffn_bias`` ``wi_0_bias``, ``wi_1_bias`` ``(E, I)`` and ``wo_bias
        (E, hidden)``, with ``use_expert_routing_bias`` ``expert_bias (E,)`` (float32)."""
        self.check_config()
        e, i, dt = self.num_experts, self.intermediate_size, self.param_dtype
        out: dict[str, ParamSpec] = {}
        if self.enable_layernorm:
            out.update(
                norm_param_specs(
                    hidden,
                    layernorm_type=self.layernorm_type,
                    zero_centered_gamma=self.zero_centered_gamma,
                    scale_init=self.scale_init,
                    scale_axes=self.scale_axes,
                    bias_init=self.ln_bias_init,
                    bias_axes=self.ln_bias_axes,
                    bias_axes_arg="ln_bias_axes",
                    param_dtype=dt,
                )
            )
        init = self.kernel_init or default_kernel_init
        out["gate_kernel"] = ParamSpec(
            (hidden, e), dt, init, tuple(self.gate_kernel_axes), "gate_kernel_axes"
        )
        wi_axes, wo_axes = tuple(self.wi_kernel_axes), tuple(self.wo_kernel_axes)
        for name in ("wi_0", "wi_1"):
            out[name] = ParamSpec(
                (e, hidden, i), dt, experts_init(init, e), wi_axes, "wi_kernel_axes"
            )
        out["wo"] = ParamSpec((e, i, hidden), dt, experts_init(init, e), wo_axes, "wo_kernel_axes")
        if self.use_ffn_bias:
            bi_axes = wi_axes[:1] + wi_axes[2:] if wi_axes else ()
            bo_axes = wo_axes[:1] + wo_axes[2:] if wo_axes else ()
            for name in ("wi_0_bias", "wi_1_bias"):
                out[name] = ParamSpec((e, i), dt, self.bias_init, bi_axes, "wi_kernel_axes")
            out["wo_bias"] = ParamSpec((e, hidden), dt, self.bias_init, bo_axes, "wo_kernel_axes")
        if self.use_expert_routing_bias:
            ax = wi_axes[:1] if wi_axes else ()
            out["expert_bias"] = ParamSpec(
                (e,), jnp.float32, self.expert_bias_init, ax, "wi_kernel_axes"
            )
        return out

    def submodule_configs(self) -> dict[str, Any]:
        """``shared_experts`` (a gated :class:`LayerNormMLPConfig` with no norm of its own,
        on the block's normalised input), when ``shared_expert_intermediate_size``."""
        if not self.shared_expert_intermediate_size:
            return {}
        return {
            "shared_experts": LayerNormMLPConfig(
                intermediate_dim=self.shared_expert_intermediate_size,
                enable_layernorm=False,
                activations=(self.activation_type, "linear"),
                kernel_init=self.kernel_init,
                use_bias=self.use_ffn_bias,
                bias_init=self.bias_init,
                dtype=self.dtype,
                param_dtype=self.param_dtype,
                intermediate_dropout_rate=0.0,
                kernel_axes_1=((*self.wi_kernel_axes[1:2], None, *self.wi_kernel_axes[2:3]))
                if self.wi_kernel_axes
                else (),
                kernel_axes_2=tuple(self.wo_kernel_axes[1:]),
            )
        }

    def moe_config(self) -> MoEConfig:
        """The routed experts' static settings (:func:`fp8jax.moe`)."""
        return MoEConfig(
            num_experts=self.num_experts,
            num_experts_per_tok=self.num_experts_per_tok,
            activation_type=self.activation_type,
            score_function=self.score_function,
            use_pre_softmax=self.use_pre_softmax,
            num_groups=self.num_groups,
            group_topk=self.group_topk,
            scaling_factor=float(self.scaling_factor),
            capacity_factor=None if self.capacity_factor is None else float(self.capacity_factor),
            aux_loss_coeff=float(self.aux_loss_coeff),
            z_loss_coeff=float(self.z_loss_coeff),
            expert_axis=self.expert_axis,
            data_parallelism_axes=tuple(self.data_parallelism_axes),
        )

    def forward(
        self,
        inputs: jax.Array,
        params: Mapping[str, jax.Array | None],
        fp8: Any,
        where: str,
        shared: Callable[[jax.Array], Any] | None = None,
    ) -> MoEResult:
        """The block on checked ``inputs`` with ``params`` (by name; absent ones ``None``),
        ``fp8`` (the call's FP8 switch, recipe, state, probe and calibration recorder) and the
        front-end's ``shared_experts`` child (``x -> (out, ln_out)``; ``None`` without)."""
        x = constrain("MoEBlock", "input_axes", inputs, self.input_axes or ())
        dtype = self.dtype or jnp.result_type(inputs, params["wi_0"])
        if self.enable_layernorm:
            x = norm_layer(
                x,
                params["scale"],
                params.get("ln_bias"),
                self.layernorm_type,
                self.epsilon,
                self.zero_centered_gamma,
                dtype,
            )
        hidden = x.shape[-1]
        routed = {
            n: params.get(n)
            for n in (
                "gate_kernel",
                "wi_0",
                "wi_1",
                "wo",
                "wi_0_bias",
                "wi_1_bias",
                "wo_bias",
                "expert_bias",
            )
        }
        r = moe(
            partition.reshape(x, (x.size // hidden, hidden)),
            routed,
            self.moe_config(),
            fp8_meta=fp8.meta,
            recipe=fp8.recipe,
            probe=fp8.probe,
            enabled=fp8.enabled,
            dtype=dtype,
            where=where,
        )
        if fp8.record is not None and r.observed is not None:
            fp8.record(r.observed)
        out = partition.reshape(r.out, (*inputs.shape[:-1], hidden))
        if shared is not None:
            out = out + shared(x)[0].astype(out.dtype)
        return MoEResult(out.astype(dtype), r.aux_loss, r.z_loss)
