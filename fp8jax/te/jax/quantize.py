"""TransformerEngine's ``transformer_engine.jax.quantize``: the quantizer set of one GEMM.

In TE a :class:`QuantizerSet` holds three quantizers (``x``, ``kernel``, ``dgrad``) that carry
their recipe's state. Here a :class:`Quantizer` holds what fp8jax's layers need for its role:
the fp8jax recipe (static) and, under delayed scaling, that role's ``scale`` ``float32[1]`` and
``amax_history`` ``float32[amax_history_len]`` (the variables
:meth:`~fp8jax.te.jax.flax.module.TransformerEngineBase.generate_quantizer_set` declares). The
TE functions (:func:`fp8jax.te.jax.dense.dense`, ...) stack a set's three roles into fp8jax's
:class:`~fp8jax.state.Fp8Meta` (rows input, kernel, grad_output) and run fp8jax's layer with it.

>>> from fp8jax.te.jax.quantize import QuantizerFactory, ScalingMode, noop_quantizer_set
>>> from fp8jax.te.common.recipe import MXFP8BlockScaling
>>> qs = QuantizerFactory.create_set(fp8_recipe=MXFP8BlockScaling())
>>> qs.x.scaling_mode, noop_quantizer_set.is_noop
(<ScalingMode.MXFP8_1D_SCALING: 'mxfp8_1d_scaling'>, True)
"""

from __future__ import annotations

import enum
from typing import Any, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp

from fp8jax.recipe import Recipe, Scaling
from fp8jax.state import Fp8Meta, state_gradient_link
from fp8jax.te.common.recipe import fp8jax_recipe

__all__ = [
    "ROLES",
    "GemmInputs",
    "Quantizer",
    "QuantizerFactory",
    "QuantizerSet",
    "ScalingMode",
    "gemm_inputs",
    "noop_quantizer_set",
    "stacked_meta",
]


#: The roles of a quantizer set, in the row order of fp8jax's state (input, kernel, grad).
ROLES: tuple[str, ...] = ("x", "kernel", "dgrad")


class ScalingMode(enum.Enum):
    """TE's scaling modes, and fp8jax's two that TE's JAX API lacks (``FLOAT8_BLOCK_SCALING``:
    1 x 128 / 128 x 128 blocks; ``FLOAT8_ROWWISE_SCALING``). The NVFP4 modes exist for names;
    fp8jax does not implement them."""

    NO_SCALING = "no_scaling"
    DELAYED_TENSOR_SCALING = "delayed_tensor_scaling"
    CURRENT_TENSOR_SCALING = "current_tensor_scaling"
    MXFP8_1D_SCALING = "mxfp8_1d_scaling"
    NVFP4_1D_SCALING = "nvfp4_1d_scaling"
    NVFP4_2D_SCALING = "nvfp4_2d_scaling"
    FLOAT8_BLOCK_SCALING = "float8_block_scaling"
    FLOAT8_ROWWISE_SCALING = "float8_rowwise_scaling"

    @property
    def is_tensor_scaling(self) -> bool:
        """Whether one scale covers the whole tensor (delayed or current scaling)."""
        return self in (ScalingMode.DELAYED_TENSOR_SCALING, ScalingMode.CURRENT_TENSOR_SCALING)


#: fp8jax's scaling kinds as TE's modes (the recipe says its kind: Recipe.scaling).
_MODES: dict[Scaling, ScalingMode] = {
    Scaling.DELAYED: ScalingMode.DELAYED_TENSOR_SCALING,
    Scaling.CURRENT: ScalingMode.CURRENT_TENSOR_SCALING,
    Scaling.MXFP8: ScalingMode.MXFP8_1D_SCALING,
    Scaling.BLOCK: ScalingMode.FLOAT8_BLOCK_SCALING,
    Scaling.ROWWISE: ScalingMode.FLOAT8_ROWWISE_SCALING,
}


@flax.struct.dataclass
class Quantizer:
    """One tensor role's quantizer: its recipe (``None``: no quantization), TE's
    ``scaling_mode`` and ``q_dtype``, and under delayed scaling its state (``scale``
    ``float32[1]``, ``amax_history`` ``float32[L]``; ``None`` for a stateless recipe)."""

    scale: jax.Array | None = None
    amax_history: jax.Array | None = None
    recipe: Recipe | None = flax.struct.field(pytree_node=False, default=None)
    scaling_mode: ScalingMode = flax.struct.field(pytree_node=False, default=ScalingMode.NO_SCALING)
    q_dtype: Any = flax.struct.field(pytree_node=False, default=None)
    checkpoint_name: str | None = flax.struct.field(pytree_node=False, default=None)


@flax.struct.dataclass
class QuantizerSet:
    """TE's quantizer set of one GEMM: ``x`` (input), ``kernel`` and ``dgrad`` (output
    gradient), each a :class:`Quantizer`."""

    x: Quantizer
    kernel: Quantizer
    dgrad: Quantizer

    @property
    def recipe(self) -> Recipe | None:
        """The fp8jax recipe of the set (``None`` for :data:`noop_quantizer_set`)."""
        return self.x.recipe

    @property
    def is_noop(self) -> bool:
        """Whether the set quantizes nothing (TE's ``noop_quantizer_set``)."""
        return self.x.recipe is None


def _quantizer(recipe: Recipe | None, role: str, meta: Any, checkpoint_name: str | None):
    if recipe is None:
        return Quantizer()
    scale, history = (None, None) if meta is None else meta
    return Quantizer(
        scale=scale,
        amax_history=history,
        recipe=recipe,
        scaling_mode=_MODES[recipe.scaling],
        q_dtype=recipe.bwd_dtype if role == "dgrad" else recipe.fwd_dtype,
        checkpoint_name=checkpoint_name,
    )


class QuantizerFactory:
    """TE's ``QuantizerFactory``: builds quantizer sets from a recipe."""

    @staticmethod
    def create_set(
        n_quantizer_sets: int = 1,
        scaling_mode: ScalingMode | None = None,
        fwd_dtype: Any = None,
        bwd_dtype: Any = None,
        is_2x2x: bool | None = None,
        n_groups: int | None = None,
        checkpoint_name: str | None = None,
        fp8_recipe: Any = None,
        quantize_meta_set: Any = None,
    ) -> QuantizerSet | tuple[QuantizerSet, ...]:
        """One quantizer set (or a tuple of ``n_quantizer_sets``) for ``fp8_recipe``.

        ``quantize_meta_set``: under delayed scaling, the state of the three roles as
        ``{"x": (scale, amax_history), "kernel": ..., "dgrad": ...}``. ``scaling_mode`` may
        only be ``NO_SCALING`` (the no-op set) or left out: fp8jax builds quantizers from
        recipes. ``fwd_dtype``, ``bwd_dtype`` and ``is_2x2x`` are the recipe's in fp8jax and
        are ignored; ``n_groups`` (grouped GEMMs) is not implemented here.
        """
        del fwd_dtype, bwd_dtype, is_2x2x
        if n_groups is not None:
            raise NotImplementedError(
                "QuantizerFactory.create_set: n_groups (grouped GEMM quantizers) is not "
                "implemented by fp8jax.te; use fp8jax.grouped_dense"
            )
        if scaling_mode is not None and scaling_mode is not ScalingMode.NO_SCALING:
            raise NotImplementedError(
                f"QuantizerFactory.create_set: scaling_mode={scaling_mode!r}: fp8jax builds "
                "quantizers from a recipe; pass fp8_recipe instead"
            )
        if not isinstance(n_quantizer_sets, int) or n_quantizer_sets < 1:
            raise ValueError(
                f"QuantizerFactory.create_set: n_quantizer_sets must be a positive int, got "
                f"{n_quantizer_sets!r}"
            )
        recipe = None
        if fp8_recipe is not None and scaling_mode is None:
            recipe = fp8jax_recipe(fp8_recipe, "QuantizerFactory.create_set: fp8_recipe")
        metas = dict(quantize_meta_set or {})
        if recipe is not None and recipe.keeps_state and set(metas) != {"x", "kernel", "dgrad"}:
            raise ValueError(
                "QuantizerFactory.create_set: delayed scaling needs quantize_meta_set with the "
                "state (scale, amax_history) of 'x', 'kernel' and 'dgrad'"
            )
        sets = tuple(
            QuantizerSet(*(_quantizer(recipe, r, metas.get(r), checkpoint_name) for r in ROLES))
            for _ in range(n_quantizer_sets)
        )
        return sets[0] if n_quantizer_sets == 1 else sets


#: TE's set that quantizes nothing: the TE functions run in high precision with it.
noop_quantizer_set: QuantizerSet = QuantizerSet(Quantizer(), Quantizer(), Quantizer())


def stacked_meta(sets: tuple[QuantizerSet, ...]) -> Fp8Meta | None:
    """The fp8jax state of ``sets`` (one per GEMM, in the layer's GEMM order): their roles'
    ``amax_history`` and ``scale`` stacked into rows (x, kernel, dgrad of each GEMM); ``None``
    when the recipe keeps no state."""
    quantizers = [getattr(s, r) for s in sets for r in ROLES]
    if any(q.scale is None or q.amax_history is None for q in quantizers):
        return None
    hist = jnp.stack([jnp.asarray(q.amax_history, jnp.float32) for q in quantizers])
    scale = jnp.concatenate([jnp.reshape(q.scale, (1,)).astype(jnp.float32) for q in quantizers])
    return Fp8Meta(amax_history=hist, scale=scale)


class GemmInputs(NamedTuple):
    """What fp8jax's layer takes from the quantizer sets of its GEMMs."""

    enabled: bool  # False: every set is the no-op set (high precision)
    recipe: Recipe | None
    meta: Fp8Meta | None  # delayed scaling: the state, linked (see gemm_inputs)
    probe: jax.Array | None  # delayed scaling: the probe the state's next value comes from


def gemm_inputs(sets: tuple[QuantizerSet, ...], where: str) -> GemmInputs:
    """The recipe, state and probe of a layer whose GEMMs have quantizer sets ``sets``.

    All sets must be no-op (FP8 off) or share one recipe. Under delayed scaling the stacked
    state is linked (:func:`fp8jax.state.state_gradient_link`) so that its gradient is the
    next state (TE's convention, no probe variable needed): differentiate the loss with respect
    to the collection holding it and use the gradient as the new state.
    """
    for i, s in enumerate(sets):
        if not isinstance(s, QuantizerSet):
            raise TypeError(
                f"{where}: quantizer set {i} must be a QuantizerSet (from generate_quantizer_set "
                f"or QuantizerFactory.create_set), got {type(s).__name__}"
            )
    recipes = {s.recipe for s in sets}
    if recipes == {None}:
        return GemmInputs(False, None, None, None)
    if len(recipes) != 1:
        raise ValueError(
            f"{where}: the quantizer sets must all use one recipe (or all be "
            f"noop_quantizer_set), got {[s.recipe for s in sets]}"
        )
    (recipe,) = recipes
    if not recipe.keeps_state:
        return GemmInputs(True, recipe, None, None)
    meta = stacked_meta(sets)
    if meta is None:
        raise ValueError(
            f"{where}: the quantizer sets have no delayed-scaling state (scale, amax_history); "
            "make them with generate_quantizer_set or QuantizerFactory.create_set(..., "
            "quantize_meta_set=...)"
        )
    length = recipe.amax_history_len
    if meta.amax_history.shape[1] != length:
        raise ValueError(
            f"{where}: the amax_history has length {meta.amax_history.shape[1]}, the recipe "
            f"wants amax_history_len={length}; was the state initialised under another recipe?"
        )
    zero = jnp.zeros(meta.scale.shape, jnp.float32)
    linked, probe = state_gradient_link(meta, zero, recipe)
    return GemmInputs(True, recipe, linked, probe)
