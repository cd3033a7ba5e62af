"""The framework-neutral math of an FP8 train step on variable trees (nested mappings, as Flax
Linen keeps them and :mod:`fp8jax.nnx` converts to): the next ``fp8_meta`` from the ``fp8_probe``
gradients, the finiteness test that skips a step, the micro-batch count and the accumulation of
gradients over micro-batches. No Flax import: :mod:`fp8jax.flax.train` (which re-exports the
public names) and :mod:`fp8jax.nnx.train` both build on it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fp8jax.recipe import Recipe, check_recipe
from fp8jax.state import Fp8Meta, backward_roles, merge_observations, update_fp8_metas

#: Collection of the delayed-scaling state (``amax_history``, ``scale``).
FP8_META = "fp8_meta"
#: Collection of the per-call probes (``call_0``, ``call_1``, ...).
FP8_PROBE = "fp8_probe"

_CALL_RE = re.compile(r"call_\d+")
Path = tuple[str, ...]


def zero_probes(fp8_probe: Any) -> Any:
    """A tree like ``fp8_probe`` of zeros (probes are always zero; only their gradient counts)."""
    return jax.tree.map(jnp.zeros_like, fp8_probe)


def _meta_nodes(tree: Any, path: Path = ()) -> list[tuple[Path, Mapping[str, Any]]]:
    """Every module node (a mapping holding ``amax_history`` and ``scale``) of an fp8_meta tree."""
    if not isinstance(tree, Mapping):
        return []
    nodes: list[tuple[Path, Mapping[str, Any]]] = []
    if "amax_history" in tree and "scale" in tree:
        nodes.append((path, tree))
    for key, sub in tree.items():
        if key not in ("amax_history", "scale"):
            nodes.extend(_meta_nodes(sub, (*path, str(key))))
    return nodes


def _subtree(tree: Any, path: Path) -> Any:
    for key in path:
        if not isinstance(tree, Mapping) or key not in tree:
            return None
        tree = tree[key]
    return tree


def _observation(path: Path, probes: Any, lead: tuple[int, ...], n_roles: int) -> jax.Array:
    """Max over a module's ``call_*`` probe gradients, extra leading dims max-reduced too."""
    where = "/".join(path) or "<root>"
    calls = (
        [v for k, v in probes.items() if _CALL_RE.fullmatch(str(k))]
        if isinstance(probes, Mapping)
        else []
    )
    if not calls:
        raise ValueError(
            f"update_fp8_variables: no probe gradients (call_0, call_1, ...) for the module at "
            f"{where!r}; pass the gradient of the loss with respect to the whole "
            f"{FP8_PROBE!r} collection"
        )
    obs = merge_observations(*[jnp.asarray(c, jnp.float32) for c in calls])
    want = (*lead, n_roles)
    extra = obs.ndim - len(want)
    if extra < 0 or obs.shape[extra:] != want:
        raise ValueError(
            f"update_fp8_variables: probe gradients of {where!r} have shape {obs.shape}; the "
            f"state wants [..., {', '.join(map(str, want))}] (stacked dims of the state last)"
        )
    return jnp.max(obs, axis=tuple(range(extra))) if extra else obs


def _rebuild(tree: Any, path: Path, new: Mapping[Path, dict[str, jax.Array]]) -> Any:
    if not isinstance(tree, Mapping):
        return tree
    out = {
        k: _rebuild(v, (*path, str(k)), new) if k not in ("amax_history", "scale") else v
        for k, v in tree.items()
    }
    if path in new:
        out.update(new[path])
    return type(tree)(out) if not isinstance(tree, dict) else out


def update_fp8_variables(fp8_meta: Any, probe_grads: Any, recipe: Recipe) -> Any:
    """The next step's ``fp8_meta`` from this step's probe gradients.

    Per module: the max over its ``call_*`` probe gradients (never the sum), extra leading
    dims (a probe scanned over a broadcast state) max-reduced; stacked states (``nn.scan`` with
    a variable axis) are flattened to rows, and all rows of the whole model are updated by one
    :func:`fp8jax.ops.update_fp8_states` launch, with the backward (grad_output) rows using the
    recipe's backward format.

    Args:
      fp8_meta: the ``"fp8_meta"`` collection (nested mappings; each module's node holds
        ``amax_history`` float32[..., R, L] and ``scale`` float32[..., R], R = 3 per GEMM).
      probe_grads: the gradient of the loss with respect to the ``"fp8_probe"`` collection, the
        same module paths, each holding ``call_i`` float32[..., R].
      recipe: the :class:`~fp8jax.recipe.DelayedScaling` the step ran under. With any other
        recipe the model has no state and an empty ``fp8_meta`` is returned unchanged.

    Returns:
      A tree like ``fp8_meta`` with the new histories and scales.
    """
    nodes = _meta_nodes(fp8_meta)
    if not nodes:
        return fp8_meta
    # fp8_meta holds delayed-scaling state, so the recipe must keep it
    check_recipe(recipe, "update_fp8_variables: recipe", keeps_state=True)
    metas, observed, flags, shapes = [], [], [], []
    for path, node in nodes:
        hist = jnp.asarray(node["amax_history"])
        scale = jnp.asarray(node["scale"])
        lead = tuple(scale.shape[:-1])
        n = scale.shape[-1] if scale.ndim else 0
        if n % 3 or not n or hist.shape != (*lead, n, hist.shape[-1]):
            raise ValueError(
                f"update_fp8_variables: the state at {'/'.join(path)!r} has amax_history "
                f"{hist.shape} and scale {scale.shape}; expected [..., R, L] and [..., R] with "
                "R a multiple of 3 (input, kernel, grad_output per GEMM)"
            )
        rows = int(np.prod(lead, dtype=np.int64)) * n
        obs = _observation(path, _subtree(probe_grads, path), lead, n)
        metas.append(Fp8Meta(hist.reshape(rows, hist.shape[-1]), scale.reshape(rows)))
        observed.append(obs.reshape(rows))
        flags.append(backward_roles(rows))
        shapes.append((hist.shape, scale.shape))
    updated = update_fp8_metas(metas, observed, recipe, flags)
    new = {
        path: {"amax_history": m.amax_history.reshape(hs), "scale": m.scale.reshape(ss)}
        for (path, _), m, (hs, ss) in zip(nodes, updated, shapes, strict=True)
    }
    return _rebuild(fp8_meta, (), new)


def check_train_recipe(owner: str, recipe: Any, fp8_meta: Any) -> Recipe:
    recipe = check_recipe(recipe, f"{owner}: recipe")
    nodes = _meta_nodes(fp8_meta)
    if nodes and not recipe.keeps_state:
        raise ValueError(
            f"{owner}: the variables hold delayed-scaling state ({FP8_META!r}) but the recipe is "
            f"{type(recipe).__name__}; initialise the model under the recipe you train with"
        )
    for path, node in nodes:
        length = jnp.shape(node["amax_history"])[-1]
        if length != recipe.amax_history_len:
            raise ValueError(
                f"{owner}: the {FP8_META!r} state at {'/'.join(path) or '<root>'!r} has an amax "
                f"history of length {length}, but the recipe has amax_history_len="
                f"{recipe.amax_history_len}; initialise the model under the recipe you train with"
            )
    return recipe


def all_finite(*trees: Any) -> jax.Array:
    """``True`` (a bool scalar array) when every float leaf of ``trees`` is finite."""
    leaves = [
        jnp.all(jnp.isfinite(x))
        for t in trees
        for x in jax.tree.leaves(t)
        if jnp.issubdtype(jnp.result_type(x), jnp.inexact)
    ]
    return jnp.all(jnp.stack(leaves)) if leaves else jnp.bool_(True)


def micro_batch_count(micro_batches: Any, reduce: str) -> int:
    """The number of micro-batches (the leading axis every leaf shares), after checking it and
    ``reduce`` (ValueErrors naming :func:`accumulate_gradients`'s arguments)."""
    if reduce not in ("mean", "sum"):
        raise ValueError(f"accumulate_gradients: reduce must be 'mean' or 'sum', got {reduce!r}")
    leaves = jax.tree.leaves(micro_batches)
    if not leaves:
        raise ValueError("accumulate_gradients: micro_batches has no arrays")
    sizes = {jnp.shape(x)[0] if jnp.ndim(x) else None for x in leaves}
    if len(sizes) != 1 or None in sizes or 0 in sizes:
        raise ValueError(
            "accumulate_gradients: every leaf of micro_batches needs the same leading "
            f"(micro-batch) axis of size >= 1, got sizes {sorted(map(str, sizes))}"
        )
    (n,) = sizes
    return n


def accumulate_gradients(
    grad_fn: Callable[[Any, Any, Any], tuple[jax.Array, tuple[Any, Any]]],
    params: Any,
    fp8_probe: Any,
    micro_batches: Any,
    *,
    reduce: str = "mean",
) -> tuple[jax.Array, tuple[Any, Any]]:
    """Gradient accumulation over micro-batches that merges FP8 observations by max.

    Runs ``grad_fn(params, fp8_probe, micro_batch)`` for each micro-batch (a ``lax.scan`` over
    the leading axis of ``micro_batches``); ``grad_fn`` returns ``(loss, (grads, probe_grads))``,
    as ``jax.value_and_grad(loss_fn, argnums=(0, 1))`` does for ``loss_fn(params, fp8_probe,
    batch)``. The losses and param gradients are averaged (``reduce="mean"``, for a loss that is a
    mean over examples) or summed (``"sum"``); the probe gradients are merged by **max**: each
    micro-batch reuses the same probes, and differentiating the sum of the losses would add the
    amaxes instead.

    Args:
      grad_fn: ``(params, fp8_probe, micro_batch) -> (loss, (grads, probe_grads))``.
      params: the params.
      fp8_probe: the zero probes.
      micro_batches: pytree whose leaves have a leading micro-batch axis (of equal size >= 1).
      reduce: ``"mean"`` or ``"sum"`` for losses and param gradients.

    Returns:
      ``(loss, (grads, probe_grads))`` like ``grad_fn``'s, for the whole batch.
    """
    n = micro_batch_count(micro_batches, reduce)
    first = jax.tree.map(lambda x: x[0], micro_batches)
    loss_t, (grads_t, probes_t) = jax.eval_shape(grad_fn, params, fp8_probe, first)
    zeros = lambda t: jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), t)

    def body(carry, batch):
        loss_acc, grads_acc, probes_acc = carry
        loss, (grads, probes) = grad_fn(params, fp8_probe, batch)
        return (
            loss_acc + loss,
            jax.tree.map(jnp.add, grads_acc, grads),
            jax.tree.map(jnp.maximum, probes_acc, probes),  # amaxes are >= 0: 0 is neutral
        ), None

    init = (zeros(loss_t), zeros(grads_t), zeros(probes_t))
    (loss, grads, probes), _ = jax.lax.scan(body, init, micro_batches)
    if reduce == "mean":
        loss = loss / n
        grads = jax.tree.map(lambda g: g / n, grads)
    return loss, (grads, probes)
