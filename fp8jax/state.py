"""The delayed-scaling state of a layer's FP8 tensors, and its functional per-step update.

A layer with ``n`` quantized tensor roles keeps one :class:`Fp8Meta`: an amax history and a scale
per role. Roles come in GEMM triples: every FP8 GEMM of a layer has three, its input, its kernel
and its output gradient (:data:`GEMM_ROLES`), so a dense layer has 3 roles and a layer with ``G``
GEMMs (``LayerNormMLP``: ``fc1`` and ``fc2``) has ``3 G``, named by :func:`gemm_roles`; the
output gradient of each GEMM is the backward role, which uses the recipe's backward format
(:func:`backward_roles`). A state's row count therefore says everything the update needs.

Each step the layer quantizes with ``scale`` and reports what it saw, one amax per role,
through the cotangent of a *probe*: a zero float32 vector that the layer takes as an input and
whose gradient is the observation. The backward pass is the only place the output-grad amaxes
exist, so this is how they leave; the forward amaxes ride along so that one mechanism carries
all of them.

Observations from several calls of the same layer (a layer applied twice, micro-batches of a
gradient accumulation) are merged by **max** (:func:`merge_observations`), never summed, and then
folded into the state by :func:`update_fp8_meta`, or for a whole model in one kernel launch by
:func:`update_fp8_metas`.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fp8jax.ops.casts.scaling import update_fp8_states
from fp8jax.recipe import DelayedScaling, check_recipe

__all__ = [
    "DENSE_BACKWARD",
    "DENSE_ROLES",
    "GEMM_ROLES",
    "Fp8Meta",
    "backward_roles",
    "gemm_roles",
    "init_fp8_meta",
    "merge_observations",
    "state_gradient_link",
    "update_fp8_meta",
    "update_fp8_metas",
]

#: The three tensor roles of one FP8 GEMM, in row order of its :class:`Fp8Meta` rows.
GEMM_ROLES: tuple[str, ...] = ("input", "kernel", "grad_output")
#: Tensor roles of a dense layer (one GEMM), in row order of its :class:`Fp8Meta`.
DENSE_ROLES: tuple[str, ...] = GEMM_ROLES
#: Which of those roles are backward (gradient) tensors: they use the recipe's backward format.
DENSE_BACKWARD: tuple[bool, ...] = (False, False, True)


def gemm_roles(*gemms: str) -> tuple[str, ...]:
    """The role names of a layer whose FP8 GEMMs are named ``gemms``, in row order.

    >>> from fp8jax.state import gemm_roles
    >>> gemm_roles("fc1", "fc2")[:4]
    ('fc1/input', 'fc1/kernel', 'fc1/grad_output', 'fc2/input')
    >>> gemm_roles()  # one unnamed GEMM: the dense layer
    ('input', 'kernel', 'grad_output')
    """
    if not gemms:
        return GEMM_ROLES
    if len(set(gemms)) != len(gemms) or not all(isinstance(g, str) and g for g in gemms):
        raise ValueError(f"gemm_roles: GEMM names must be distinct non-empty strings: {gemms!r}")
    return tuple(f"{g}/{r}" for g in gemms for r in GEMM_ROLES)


def backward_roles(n_roles: int) -> tuple[bool, ...]:
    """Per row of a state with ``n_roles`` rows (GEMM triples), whether it is a backward role.

    >>> from fp8jax.state import backward_roles
    >>> backward_roles(6)
    (False, False, True, False, False, True)
    """
    if not isinstance(n_roles, (int, np.integer)) or n_roles < 1 or n_roles % len(GEMM_ROLES):
        raise ValueError(
            f"backward_roles: a state's rows are GEMM triples (input, kernel, grad_output), so "
            f"n_roles must be a positive multiple of 3, got {n_roles!r}"
        )
    return DENSE_BACKWARD * (int(n_roles) // len(GEMM_ROLES))


class Fp8Meta(NamedTuple):
    """Delayed-scaling state of one layer's FP8 tensors, one row per tensor role."""

    amax_history: jax.Array  # float32[n_roles, amax_history_len], newest at column 0
    scale: jax.Array  # float32[n_roles]


def init_fp8_meta(recipe: DelayedScaling, n_roles: int = len(DENSE_ROLES)) -> Fp8Meta:
    """The initial state: an all-zero history and scale 1 for every role.

    >>> import fp8jax
    >>> m = fp8jax.init_fp8_meta(fp8jax.DelayedScaling(amax_history_len=16))
    >>> m.amax_history.shape, m.scale.tolist()
    ((3, 16), [1.0, 1.0, 1.0])
    """
    check_recipe(recipe, "init_fp8_meta: recipe", keeps_state=True)
    if not isinstance(n_roles, int) or n_roles < 1:
        raise ValueError(f"init_fp8_meta: n_roles must be a positive int, got {n_roles!r}")
    return Fp8Meta(
        amax_history=jnp.zeros((n_roles, recipe.amax_history_len), jnp.float32),
        scale=jnp.ones((n_roles,), jnp.float32),
    )


def merge_observations(*observations: Any) -> Any:
    """Merges amax observations (arrays or matching pytrees of them) by elementwise max."""
    if not observations:
        raise ValueError("merge_observations: give at least one observation")
    return jax.tree.map(lambda *xs: jnp.max(jnp.stack(xs), axis=0), *observations)


def _check_meta(op: str, meta: Any, recipe: DelayedScaling) -> Fp8Meta:
    if not isinstance(meta, Fp8Meta):
        raise TypeError(f"{op}: expected an Fp8Meta, got {type(meta).__name__}")
    if meta.amax_history.ndim != 2 or meta.amax_history.shape[1] != recipe.amax_history_len:
        raise ValueError(
            f"{op}: amax_history has shape {meta.amax_history.shape}; the recipe wants "
            f"[n_roles, {recipe.amax_history_len}]"
        )
    return meta


def update_fp8_meta(
    meta: Fp8Meta,
    observed_amax: jax.Array,
    recipe: DelayedScaling,
    backward: tuple[bool, ...] | None = None,
) -> Fp8Meta:
    """Folds one step's observed amaxes (``float32[n_roles]``) into ``meta``; returns it new.

    ``backward`` flags the gradient roles; default: :func:`backward_roles` of the row count."""
    return update_fp8_metas([meta], [observed_amax], recipe, [backward])[0]


def update_fp8_metas(
    metas: list[Fp8Meta],
    observed: list[jax.Array],
    recipe: DelayedScaling,
    backward: list[tuple[bool, ...]] | None = None,
) -> list[Fp8Meta]:
    """Updates many layers' states in one kernel launch (the model's whole bookkeeping).

    Args:
      metas: the layers' :class:`Fp8Meta` states.
      observed: per layer, ``float32[n_roles]``: this step's amax per role (already merged by
        max over the layer's calls).
      recipe: the :class:`~fp8jax.recipe.DelayedScaling` in force.
      backward: per layer, which roles are gradients (``None`` for a layer, or for all:
        :func:`backward_roles` of its row count, i.e. GEMM triples).
    """
    op = "update_fp8_metas"
    if len(metas) != len(observed):
        raise ValueError(f"{op}: {len(metas)} states but {len(observed)} observations")
    if not metas:
        return []
    if backward is None:
        backward = [None] * len(metas)
    rows, flags = [], []
    for m, obs, bw in zip(metas, observed, backward, strict=True):
        m = _check_meta(op, m, recipe)
        n = m.scale.shape[0]
        if bw is None:
            bw = backward_roles(n)
        if jnp.shape(obs) != (n,) or len(bw) != n:
            raise ValueError(
                f"{op}: a state with {n} roles needs observed amax of shape ({n},) and {n} "
                f"backward flags, got {jnp.shape(obs)} and {len(bw)}"
            )
        rows.append(n)
        flags.extend(bool(b) for b in bw)
    hist = jnp.concatenate([m.amax_history for m in metas])
    scale = jnp.concatenate([m.scale for m in metas])
    amax = jnp.concatenate([jnp.asarray(o, jnp.float32) for o in observed])
    new_hist, new_scale = update_fp8_states(hist, scale, amax, recipe, backward=flags)
    splits = np.cumsum(rows)[:-1].tolist()
    return [
        Fp8Meta(h, s)
        for h, s in zip(jnp.split(new_hist, splits), jnp.split(new_scale, splits), strict=True)
    ]


class _LinkConfig(NamedTuple):
    recipe: DelayedScaling
    refusal: str | None  # raised when the state is differentiated; None: the state may be


def state_gradient_link(
    meta: Fp8Meta, probe: jax.Array, recipe: DelayedScaling, refusal: str | None = None
) -> tuple[Fp8Meta, jax.Array]:
    """Makes the gradient of ``meta`` the next step's state (TransformerEngine's convention).

    Returns ``meta`` and ``probe`` unchanged, for the layer to use in their place. When the
    state itself is differentiated, its cotangent is not a derivative but ``update_fp8_meta(meta,
    observation, recipe)``, the observation being the probe's cotangent (what the layer saw), so
    a train step that takes the gradient of the whole variable dict as its next FP8 state, as
    TransformerEngine's examples do, gets exactly the state that
    :func:`fp8jax.flax.update_fp8_variables` would compute for a layer called once. The probe's
    own cotangent is passed through. When the state is not differentiated (fp8jax's train step,
    or inference) nothing is added to the program.

    The cotangents of several uses of one state are *summed* by autodiff, so a state used by
    more than one call (a module called twice, or broadcast over ``nn.scan``) cannot be handed
    out this way: the caller passes ``refusal``, the ValueError text raised at trace time if
    such a state is differentiated.
    """
    hist, scale, probe = _state_link(_LinkConfig(recipe, refusal), *meta, probe)
    return Fp8Meta(hist, scale), probe


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _state_link(cfg: _LinkConfig, hist, scale, probe):
    del cfg
    return hist, scale, probe


def _state_link_fwd(cfg: _LinkConfig, hist, scale, probe):
    differentiated = hist.perturbed or scale.perturbed
    if differentiated and cfg.refusal is not None:
        raise ValueError(cfg.refusal)
    # The residuals' structure says whether the state needs its next value (static).
    res = (hist.value, scale.value) if differentiated else None
    return (hist.value, scale.value, probe.value), res


def _state_link_bwd(cfg: _LinkConfig, res, cts):
    observed = cts[2]
    if isinstance(observed, jax.custom_derivatives.SymbolicZero):
        return None, None, None  # a use that does not reach the loss hands out nothing
    if res is None:
        return None, None, observed
    new = update_fp8_meta(Fp8Meta(*res), observed, cfg.recipe)
    return new.amax_history, new.scale, observed


_state_link.defvjp(_state_link_fwd, _state_link_bwd, symbolic_zeros=True)
