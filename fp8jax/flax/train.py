"""The FP8 train step: params through the optimizer, FP8 state through its own functional update.

A model built from fp8jax modules has three variable collections: ``params`` (trained by the
optimizer), ``fp8_meta`` (the delayed-scaling state: never seen by the optimizer, clipping,
weight decay or EMA) and ``fp8_probe`` (zeros; one ``float32[R]`` per call of each FP8 module,
R = 3 per FP8 GEMM). The train step differentiates the loss with respect to ``params`` *and*
``fp8_probe``: the probe gradients are the amaxes each call observed (per GEMM: input, kernel,
output-grad). They are merged by
**max** per module and folded into ``fp8_meta`` with one kernel launch for the whole model
(:func:`update_fp8_variables`). Nothing is mutated and nothing syncs with the host.

The recipe is stated once, when the train state is made: the state initialises the model
under it, runs the model under it (:meth:`Fp8TrainState.apply`) and updates the FP8 state with
it (:meth:`Fp8TrainState.apply_gradients`), so the formats of the forward pass and of the scale
update cannot disagree. The full jitted train step::

    import jax, jax.numpy as jnp, optax
    import fp8jax
    from fp8jax.flax import DenseGeneral, Fp8TrainState

    recipe = fp8jax.DelayedScaling(amax_history_len=16)
    model = DenseGeneral(features=768)
    state = Fp8TrainState.from_model(model, jax.random.key(0), x, tx=optax.adam(1e-3),
                                     recipe=recipe)   # params, fp8_meta, fp8_probe

    @jax.jit
    def train_step(state, x, y):
        def loss_fn(params, fp8_probe):
            out = state.apply(state.variables(params, fp8_probe), x)   # under state.recipe
            return jnp.mean((out - y) ** 2)

        loss, (grads, probe_grads) = jax.value_and_grad(loss_fn, argnums=(0, 1))(
            state.params, state.fp8_probe)
        return state.apply_gradients(grads=grads, probe_grads=probe_grads), loss

Steps that must not count (a NaN or inf in the batch or the gradients): pass
``skip_if_nonfinite=True`` to :meth:`Fp8TrainState.apply_gradients`; a non-finite step then
leaves params, optimizer state, step and FP8 state exactly as they were, so the run goes on as
if it had never seen that batch. (Use it instead of ``optax.apply_if_finite``, which would skip
the params but not the FP8 state.)

For gradient accumulation, :func:`accumulate_gradients` runs that ``value_and_grad`` per
micro-batch, averages (or sums) the param gradients and max-merges the probe gradients.

Under ``nn.scan`` over layers, give both FP8 collections a variable axis, as ``params`` has:
``variable_axes={"params": 0, "fp8_meta": 0, "fp8_probe": 0}``; each layer then has its own
state. (A probe that is *broadcast* over the scan would be shared by every iteration, and
autodiff would sum their observations.) When the FP8 state is broadcast but the probes are
scanned (one layer applied at every step), the probe gradients carry extra leading dims, which
:func:`update_fp8_variables` max-reduces.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct
from flax.training import train_state

from fp8jax.autocast import _DEFAULT_STATE, _current_state, autocast
from fp8jax.flax._variables import FP8_META, FP8_PROBE
from fp8jax.recipe import DelayedScaling, Recipe
from fp8jax.state import Fp8Meta, backward_roles, merge_observations, update_fp8_metas

__all__ = [
    "Fp8TrainState",
    "accumulate_gradients",
    "all_finite",
    "update_fp8_variables",
    "zero_probes",
]

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
    if not isinstance(recipe, DelayedScaling):
        raise TypeError(
            "update_fp8_variables: fp8_meta holds delayed-scaling state, so recipe must be a "
            f"DelayedScaling, got {recipe!r}"
        )
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


def _check_grads(grads: Any) -> None:
    if isinstance(grads, Mapping) and (FP8_META in grads or FP8_PROBE in grads):
        raise ValueError(
            "apply_gradients: grads must be the gradient of the params only (the FP8 "
            f"collections {FP8_META!r}/{FP8_PROBE!r} are not optimised); pass the probe "
            "gradients as probe_grads"
        )


def _check_recipe(owner: str, recipe: Any, fp8_meta: Any) -> Recipe:
    if not isinstance(recipe, Recipe):
        raise TypeError(
            f"{owner}: recipe must be a fp8jax Recipe (DelayedScaling or Float8CurrentScaling), "
            f"got {recipe!r}"
        )
    nodes = _meta_nodes(fp8_meta)
    if nodes and not isinstance(recipe, DelayedScaling):
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


class Fp8TrainState(train_state.TrainState):
    """A :class:`flax.training.train_state.TrainState` that also carries the FP8 collections and
    the recipe.

    ``params`` and ``opt_state`` are exactly those of a plain ``TrainState``: the optimizer is
    initialised on, and applied to, the params only. ``fp8_meta`` (the delayed-scaling state) and
    ``fp8_probe`` (zero probes, kept for their structure) are extra pytree fields; ``recipe`` is
    static (part of jit's cache key, like ``apply_fn``).

    Attributes:
      fp8_meta: the ``"fp8_meta"`` collection (empty without DelayedScaling).
      fp8_probe: the ``"fp8_probe"`` collection (zeros).
      recipe: the recipe the model is initialised, run and updated with; stated once here.
    """

    fp8_meta: Any = struct.field(pytree_node=True, default_factory=dict)
    fp8_probe: Any = struct.field(pytree_node=True, default_factory=dict)
    recipe: Recipe | None = struct.field(pytree_node=False, default=None)

    @classmethod
    def from_variables(
        cls,
        *,
        apply_fn: Callable[..., Any],
        variables: Mapping[str, Any],
        tx: Any,
        recipe: Recipe,
        **kwargs: Any,
    ) -> Fp8TrainState:
        """Builds the state from ``init``'s variables (``params``, ``fp8_meta``, ``fp8_probe``).

        Args:
          apply_fn: the model's ``apply``.
          variables: what ``model.init`` returned under ``autocast(enabled=True, recipe=recipe)``.
          tx: the optax optimizer (sees the params only).
          recipe: the recipe of the whole run; checked against the state's history length.

        Raises:
          ValueError: if ``variables`` has no ``params``, holds other collections (keep those
            in your own subclass), or holds FP8 state made under another recipe.
        """
        if not isinstance(variables, Mapping) or "params" not in variables:
            raise ValueError("Fp8TrainState.from_variables: variables must hold 'params'")
        other = sorted(set(variables) - {"params", FP8_META, FP8_PROBE})
        if other:
            raise ValueError(
                f"Fp8TrainState.from_variables: unexpected collections {other}; only params, "
                f"{FP8_META} and {FP8_PROBE} are carried (subclass Fp8TrainState for others)"
            )
        fp8_meta = variables.get(FP8_META, {})
        recipe = _check_recipe("Fp8TrainState.from_variables", recipe, fp8_meta)
        return cls.create(
            apply_fn=apply_fn,
            params=variables["params"],
            tx=tx,
            fp8_meta=fp8_meta,
            fp8_probe=zero_probes(variables.get(FP8_PROBE, {})),
            recipe=recipe,
            **kwargs,
        )

    @classmethod
    def from_model(
        cls,
        model: Any,
        rng: jax.Array,
        *args: Any,
        tx: Any,
        recipe: Recipe,
        **init_kwargs: Any,
    ) -> Fp8TrainState:
        """Initialises ``model`` under ``recipe`` (``model.init(rng, *args, **init_kwargs)``
        inside ``fp8jax.autocast(enabled=True, recipe=recipe)``) and builds the state from it.

        >>> import jax, jax.numpy as jnp, optax, fp8jax
        >>> from fp8jax.flax import DenseGeneral, Fp8TrainState
        >>> state = Fp8TrainState.from_model(
        ...     DenseGeneral(features=4), jax.random.key(0), jnp.ones((2, 3)),
        ...     tx=optax.sgd(0.1), recipe=fp8jax.DelayedScaling(amax_history_len=8))
        >>> jax.tree.map(jnp.shape, state.fp8_meta), state.recipe.amax_history_len
        ({'amax_history': (3, 8), 'scale': (3,)}, 8)
        """
        _check_recipe("Fp8TrainState.from_model", recipe, {})
        with autocast(enabled=True, recipe=recipe):
            variables = model.init(rng, *args, **init_kwargs)
        return cls.from_variables(apply_fn=model.apply, variables=variables, tx=tx, recipe=recipe)

    def variables(self, params: Any = None, fp8_probe: Any = None) -> dict[str, Any]:
        """The variables to ``apply`` with: ``params``/``fp8_probe`` default to the state's."""
        return {
            "params": self.params if params is None else params,
            FP8_META: self.fp8_meta,
            FP8_PROBE: self.fp8_probe if fp8_probe is None else fp8_probe,
        }

    def _recipe(self, owner: str) -> Recipe:
        if self.recipe is None:
            raise ValueError(
                f"Fp8TrainState.{owner}: this state has no recipe; build it with "
                "Fp8TrainState.from_model(...) or from_variables(..., recipe=recipe)"
            )
        return self.recipe

    def autocast(self) -> Any:
        """``fp8jax.autocast(enabled=True, recipe=self.recipe)``."""
        return autocast(enabled=True, recipe=self._recipe("autocast"))

    def apply(self, variables: Mapping[str, Any], *args: Any, **kwargs: Any) -> Any:
        """``self.apply_fn(variables, *args, **kwargs)`` with FP8 on under the state's recipe.

        Raises:
          ValueError: inside an enclosing ``fp8jax.autocast`` that says something else (another
            recipe, or FP8 off): the forward pass and the state update would disagree.
        """
        recipe = self._recipe("apply")
        outer = _current_state()
        if outer != _DEFAULT_STATE and (not outer.enabled or outer.recipe != recipe):
            raise ValueError(
                f"Fp8TrainState.apply: called inside fp8jax.autocast(enabled={outer.enabled}, "
                f"recipe={outer.recipe!r}), but the state's recipe is {recipe!r}. The state runs "
                "the model under its own recipe; remove the enclosing autocast (or build the "
                "state with the recipe you want)."
            )
        with autocast(enabled=True, recipe=recipe):
            return self.apply_fn(variables, *args, **kwargs)

    def apply_gradients(  # type: ignore[override]
        self,
        *,
        grads: Any,
        probe_grads: Any,
        recipe: Recipe | None = None,
        skip_if_nonfinite: bool = False,
        **kwargs: Any,
    ) -> Fp8TrainState:
        """One optimizer step on the params and one FP8 state update.

        Args:
          grads: gradient of the loss with respect to ``params`` (same tree).
          probe_grads: gradient with respect to ``fp8_probe`` (the observed amaxes).
          recipe: optional; if given it must be the state's (a different one is a ValueError).
          skip_if_nonfinite: if ``True`` and any of ``grads``/``probe_grads`` is NaN or inf,
            return this state unchanged (params, optimizer state, step and FP8 state), so the
            run continues as if the step had not happened. Traced (no host sync).
          **kwargs: other fields to replace, as in ``TrainState.apply_gradients``.

        Returns:
          The new state: ``step + 1``, new ``params`` and ``opt_state``, new ``fp8_meta``.
        """
        _check_grads(grads)
        own = self._recipe("apply_gradients")
        if recipe is not None and recipe != own:
            raise ValueError(
                f"Fp8TrainState.apply_gradients: recipe={recipe!r} differs from the state's "
                f"{own!r}; the recipe is stated once, when the state is built (leave recipe out)"
            )
        if not isinstance(skip_if_nonfinite, bool):
            raise TypeError(
                f"Fp8TrainState.apply_gradients: skip_if_nonfinite must be a bool, got "
                f"{skip_if_nonfinite!r}"
            )
        new_meta = update_fp8_variables(self.fp8_meta, probe_grads, own)
        new = super().apply_gradients(grads=grads, fp8_meta=new_meta, **kwargs)
        if not skip_if_nonfinite:
            return new
        ok = all_finite(grads, probe_grads)
        return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, self)


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
