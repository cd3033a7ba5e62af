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

from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
from flax import struct
from flax.training import train_state

from fp8jax._train_math import (
    accumulate_gradients,
    all_finite,
    check_train_recipe,
    update_fp8_variables,
    zero_probes,
)
from fp8jax._train_math import micro_batch_count as micro_batch_count  # (its home until now)
from fp8jax.autocast import DEFAULT_STATE, autocast, current_state
from fp8jax.flax._variables import FP8_META, FP8_PROBE
from fp8jax.recipe import Recipe

__all__ = [
    "Fp8TrainState",
    "accumulate_gradients",
    "all_finite",
    "update_fp8_variables",
    "zero_probes",
]


def _check_grads(grads: Any) -> None:
    if isinstance(grads, Mapping) and (FP8_META in grads or FP8_PROBE in grads):
        raise ValueError(
            "apply_gradients: grads must be the gradient of the params only (the FP8 "
            f"collections {FP8_META!r}/{FP8_PROBE!r} are not optimised); pass the probe "
            "gradients as probe_grads"
        )


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
        recipe = check_train_recipe("Fp8TrainState.from_variables", recipe, fp8_meta)
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
        check_train_recipe("Fp8TrainState.from_model", recipe, {})
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
        outer = current_state()
        if outer != DEFAULT_STATE and (not outer.enabled or outer.recipe != recipe):
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
