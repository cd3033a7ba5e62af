"""The FP8 variables of fp8jax's Flax modules: the ``fp8_meta`` state and the per-call probes.

A module that runs an FP8 GEMM with :class:`~fp8jax.recipe.DelayedScaling` owns, in its own scope:

- collection ``"fp8_meta"``: ``amax_history`` float32[R, L] (zeros) and ``scale`` float32[R]
  (ones): the delayed-scaling state (:class:`Fp8Meta`), one row per tensor role. Rows come in
  GEMM triples (input, kernel, grad_output; :func:`fp8jax.state.gemm_roles`): R = 3 for a dense
  layer, 6 for ``LayerNormMLP`` (fc1 then fc2);
- collection ``"fp8_probe"``: ``call_0``, ``call_1``, ... float32[R] zeros, one per call of the
  module in a forward pass. The gradient of the loss with respect to ``call_i`` is what call ``i``
  observed: its amax per role. Because every call has its own probe, the
  observations of a module used several times are never summed by autodiff; the train step merges
  them by max (:func:`fp8jax.flax.update_fp8_variables`).

Both are created by ``init`` inside ``fp8jax.autocast(enabled=True, recipe=DelayedScaling(...))``.
``apply`` reads ``fp8_meta`` only: with it mutable (outside ``init``) a module raises a ValueError,
since the state is updated from the probe gradients, never by the forward pass. With
``fp8_probe`` mutable (what :func:`fp8jax.flax.calibrate` does) each call writes its forward
observations into its probe. A lifted transform that does not carry either collection to the
module is detected and named (``variable_axes``).

How calls are numbered
----------------------
A call's number is the number of earlier calls of a module *at the same scope path* during the
same ``init``/``apply``. The count is kept on the module that the ``init``/``apply`` is running,
keyed by scope path. That module is found by following parents, except across a lifted transform
(whose inner modules have no module parent): there, the outermost module whose method is running,
which ``autocast`` tracks with a Flax method interceptor (:func:`flax.linen.intercept_methods`)
while its block is open (enter ``autocast`` around ``init``/``apply``, not inside a module). The
count is so it is reset by every ``init``/``apply`` (and by
every call of a bound compact model) and is shared by everything that Flax runs at one path:

- one module instance called twice, a compact parent called twice (which builds a new child
  instance at the same path each time), a ``dot_general_cls`` instance that ``nn.Dense`` builds
  anew on every call, and ``nn.remat``/``nn.vmap``/... modules called several times (each call
  runs in a fresh clone) all get distinct numbers;
- Flax's ``nn.scan`` traces its body twice per call (a partial-evaluation pass whose variables it
  discards, then the real scan), so the numbers of a scanned module start where the discarded
  pass left off: a module called once per scan step has its probe named ``call_1``. The names are
  stable between ``init`` and ``apply`` (both trace the same way); at ``apply`` the discarded
  pass reads probes that do not exist, and gets a detached zero probe.

A number is never given to two calls, so observations are never summed; a probe that no call
uses (a module skipped by control flow) gets a zero gradient, which never wins a max. Not
supported: ``nn.jit`` around a module called several times (a cached trace
replays the same probe), calling ``model.apply`` of one model inside a module of another, and
calling a bound model (``model.bind(...)``) whose method is not ``nn.compact`` more than once
with probes (use ``apply``; for inference leave ``fp8_probe`` out).
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import flax.linen as nn
import jax
import jax.numpy as jnp

from fp8jax._train_math import FP8_META, FP8_PROBE
from fp8jax.autocast import get_recipe, is_fp8_enabled, register_block_context
from fp8jax.recipe import DelayedScaling, Recipe, check_recipe
from fp8jax.state import DENSE_ROLES, Fp8Meta, backward_roles, state_gradient_link

__all__ = [
    "FP8_META",
    "FP8_PROBE",
    "Fp8Call",
    "fp8_call",
    "fp8_state_collection",
    "meta_collection",
    "next_call_index",
]

_N_ROLES = len(DENSE_ROLES)
_CALL_RE = re.compile(r"call_(\d+)")
_COUNTS_ATTR = "_fp8jax_call_counts"


class Fp8Call(NamedTuple):
    """What one call of an FP8 module computes with."""

    enabled: bool  # FP8 on for this call
    recipe: Recipe | None  # the autocast recipe (None outside autocast)
    meta: Fp8Meta | None  # DelayedScaling state; None otherwise
    probe: jax.Array | None  # float32[R] whose gradient is this call's observation, or None
    where: str = ""  # "DenseGeneral at 'Dense_0'", for error messages
    record: Any = None  # calibration: call with the forward observations to store them


def _lifted_away(module: nn.Module, collection: str) -> bool:
    """Whether ``collection`` is in the variables of the ``init``/``apply`` being run but cannot be
    seen by ``module``: a lifted transform between them (``nn.scan``, ``nn.vmap``, ...) does not
    carry it (it is not in that transform's ``variable_axes``/``variable_broadcast``)."""
    owner = _count_owner(module)
    if owner is module or module.scope is None or owner.scope is None:
        return False
    if module.scope.root is owner.scope:  # no lifted transform in between
        return False
    if module.is_initializing():
        return not module.is_mutable_collection(collection)
    try:
        outer = owner.scope.variables()
    except Exception:  # a scope that cannot list its variables: assume nothing
        return False
    return collection in outer and collection not in module.variables


def _variable_axes_hint(collection: str) -> str:
    return (
        f"the {collection!r} collection does not reach this module: a lifted transform around "
        "it (nn.scan, nn.vmap, ...) does not carry it. Give both FP8 collections a variable "
        f"axis, as params has: variable_axes={{'params': 0, '{meta_collection()}': 0, "
        f"'{FP8_PROBE}': 0}}."
    )


def _where(module: nn.Module) -> str:
    path = "/".join(module.scope.path) if module.scope is not None else ""
    return f"{type(module).__name__} at {path or '<root>'!r}"


# The collection of the delayed-scaling state in this thread (fp8_state_collection).
_state = threading.local()


def meta_collection() -> str:
    """The collection fp8jax's Linen modules keep their delayed-scaling state in: ``"fp8_meta"``
    (:data:`FP8_META`), or the one the innermost :func:`fp8_state_collection` block names."""
    return getattr(_state, "name", None) or FP8_META


@contextlib.contextmanager
def fp8_state_collection(name: str) -> Iterator[None]:
    """Keeps the delayed-scaling state of fp8jax's Linen modules (and ``Fp8DotGeneral``) in
    collection ``name`` inside the block (``init`` and ``apply`` alike); ``"fp8_meta"``
    outside any.

    For TransformerEngine-style train steps that differentiate ``params`` and one state
    collection and take that collection's gradient as its next value (MaxText's
    ``"_overwrite_with_gradient"``): the probes stay in ``"fp8_probe"``, which such a step
    passes to ``apply`` as ``init`` returned it without differentiating it. fp8jax's own train
    step (:class:`Fp8TrainState`, :func:`update_fp8_variables`, :func:`calibrate`) reads
    ``"fp8_meta"``.

    >>> import flax.linen as nn, jax, jax.numpy as jnp, fp8jax
    >>> from fp8jax.flax import DenseGeneral, fp8_state_collection
    >>> with fp8jax.autocast(recipe=fp8jax.DelayedScaling()), fp8_state_collection("fp8_state"):
    ...     v = DenseGeneral(4).init(jax.random.key(0), jnp.ones((2, 8)))
    >>> sorted(v)
    ['fp8_probe', 'fp8_state', 'params']
    """
    if not isinstance(name, str) or not name or name in ("params", FP8_PROBE):
        raise ValueError(
            f"fp8_state_collection: name must be a collection name other than 'params' and "
            f"{FP8_PROBE!r}, got {name!r}"
        )
    old = getattr(_state, "name", None)
    _state.name = name
    try:
        yield
    finally:
        _state.name = old


# This thread's running Linen methods, outermost first, while an autocast block is open.
_calls = threading.local()


def _track_call(next_fun: Callable[..., Any], args: Any, kwargs: Any, context: Any) -> Any:
    running = _calls.__dict__.setdefault("modules", [])
    running.append(context.module)
    try:
        return next_fun(*args, **kwargs)
    finally:
        running.pop()


@contextlib.contextmanager
def _tracking_calls() -> Iterator[None]:
    """Tracks the running Linen methods of this thread (entered by every ``autocast`` block;
    nested blocks share the outermost one's interceptor)."""
    if getattr(_calls, "active", False):
        yield
        return
    _calls.active = True
    try:
        with nn.intercept_methods(_track_call):
            yield
    finally:
        _calls.active = False


register_block_context(_tracking_calls)


def _count_owner(module: nn.Module) -> nn.Module:
    """The module that the running ``init``/``apply`` was called on (a fresh clone per call)."""
    running = getattr(_calls, "modules", None)
    owner = running[0] if running else module
    while isinstance(owner.parent, nn.Module):
        owner = owner.parent
    return owner


def next_call_index(module: nn.Module) -> int:
    """The number of this call of ``module`` (see the module docstring), counting it."""
    owner = _count_owner(module)
    # Keyed by the owner's scope too: a compact module gets a new scope after each call, which
    # restarts the count when one bound module (``model.bind(...)``) is called again.
    scope, counts = owner.__dict__.get(_COUNTS_ATTR, (None, None))
    if counts is None or scope is not owner.scope:
        counts = {}
        object.__setattr__(owner, _COUNTS_ATTR, (owner.scope, counts))
    key = tuple(module.scope.path)
    index = counts.get(key, 0)
    counts[key] = index + 1
    return index


def _meta(module: nn.Module, recipe: DelayedScaling, n_roles: int) -> Fp8Meta:
    length = recipe.amax_history_len
    coll = meta_collection()
    if module.is_mutable_collection(coll) and not module.is_initializing():
        raise ValueError(
            f"{_where(module)}: apply was called with the {coll!r} collection mutable, but "
            f"nothing in the forward pass updates it: the output-gradient amax exists only in "
            f"the backward pass. The state is updated from the gradients of the "
            f"{FP8_PROBE!r} collection: use fp8jax.flax.Fp8TrainState (apply_gradients) or "
            f"fp8jax.flax.update_fp8_variables. Pass {coll!r} read-only (leave it out of "
            f"mutable; with mutable=True, list the collections you mean instead)."
        )
    present = module.has_variable(coll, "amax_history") and module.has_variable(coll, "scale")
    if not present and _lifted_away(module, coll):
        raise ValueError(f"{_where(module)}: {_variable_axes_hint(coll)}")
    if not present and not module.is_mutable_collection(coll):
        raise ValueError(
            f"{_where(module)}: FP8 is enabled with DelayedScaling but the {coll!r} variables "
            f"(amax_history, scale) are missing. Initialise the model inside "
            f"fp8jax.autocast(enabled=True, recipe=DelayedScaling(...)) (init creates them) "
            f"and pass the {coll!r} collection to apply."
        )
    hist = module.variable(coll, "amax_history", jnp.zeros, (n_roles, length), jnp.float32).value
    scale = module.variable(coll, "scale", jnp.ones, (n_roles,), jnp.float32).value
    if jnp.shape(hist) != (n_roles, length) or jnp.shape(scale) != (n_roles,):
        raise ValueError(
            f"{_where(module)}: {coll!r} has amax_history {jnp.shape(hist)} and scale "
            f"{jnp.shape(scale)}; the recipe (amax_history_len={length}) wants "
            f"({n_roles}, {length}) and ({n_roles},). Was the model initialised under another "
            "recipe? (Under nn.scan, give fp8_meta a variable axis.)"
        )
    return Fp8Meta(amax_history=hist, scale=scale)


def _probe_numbers(module: nn.Module) -> list[int]:
    """The call numbers of the probes this module was given (``call_0`` -> 0, ...)."""
    return [
        int(m.group(1))
        for k in module.variables.get(FP8_PROBE, {})
        if (m := _CALL_RE.fullmatch(str(k)))
    ]


def _probe(module: nn.Module, n_roles: int) -> tuple[jax.Array | None, Any, int]:
    """This call's probe (or None: no probes given), the calibration recorder (or None), and
    the call's number."""
    index = next_call_index(module)
    name = f"call_{index}"
    if _lifted_away(module, FP8_PROBE):
        raise ValueError(f"{_where(module)}: {_variable_axes_hint(FP8_PROBE)}")
    if module.has_variable(FP8_PROBE, name) or module.is_mutable_collection(FP8_PROBE):
        var = module.variable(FP8_PROBE, name, jnp.zeros, (n_roles,), jnp.float32)
        probe = var.value
        if jnp.shape(probe) != (n_roles,):
            raise ValueError(
                f"{_where(module)}: probe {FP8_PROBE}/{name} must be float32[{n_roles}], got "
                f"shape {jnp.shape(probe)} (under nn.scan, give fp8_probe a variable axis)"
            )
        record = None
        if module.is_mutable_collection(FP8_PROBE) and not module.is_initializing():
            # Calibration (fp8jax.flax.calibrate): apply with fp8_probe mutable stores each
            # call's forward observations in its probe, shaped like a probe gradient.
            def record(seen: jax.Array) -> None:
                var.value = jnp.asarray(seen, jnp.float32).reshape(n_roles)

        return probe, record, index
    existing = _probe_numbers(module)
    if not existing or index < max(existing):
        # No probes passed at all (inference), or a number that init's trace discarded (nn.scan).
        return None, None, index
    if _outer_ndim(module, FP8_PROBE, f"call_{max(existing)}") == 1:
        # Under a lifted transform the probe has no stacked dim: it is broadcast (nn.scan's
        # init pass made it, the real pass counts one more call).
        raise ValueError(
            f"{_where(module)}: {FP8_PROBE!r} is broadcast over a lifted transform (nn.scan's "
            f"variable_broadcast, nn.vmap's None axis), so every iteration would share one probe "
            f"and autodiff would add up their observations. Give {FP8_PROBE!r} a variable axis: "
            f"variable_axes={{'{FP8_PROBE}': 0, ...}}, and {meta_collection()!r} the axis "
            "params have "
            f"(0 for stacked layers; broadcast, with params, for one layer applied at every "
            "step: the probe gradients then have a leading axis that the update max-reduces)."
        )
    raise ValueError(
        f"{_where(module)}: this is call number {index} of the module in this apply, but "
        f"{FP8_PROBE!r} only has probes {sorted(f'call_{i}' for i in existing)} from init. "
        "Initialise with the same number of calls per forward pass as apply makes (same "
        "control flow), so that every call has its own probe. (A model bound with "
        "model.bind(...) whose method is not nn.compact counts across its calls: use "
        "model.apply per forward pass. For inference, leave fp8_probe out of the variables.)"
    )


def _state_gradient_refusal(module: nn.Module, index: int, has_probe: bool) -> str | None:
    """Why the gradient of this call's ``fp8_meta`` cannot be the next state, or None if it can.

    TransformerEngine's train step takes the gradient of every non-``params`` collection as the
    next FP8 state; fp8jax hands that out (:func:`fp8jax.state.state_gradient_link`) where it is
    exact: one call per state. Otherwise taking that gradient is this error at trace time."""
    head = (
        f"{_where(module)}: the gradient of the {meta_collection()!r} collection was taken (as "
        "TransformerEngine's train step does, to use it as the next FP8 state), but "
    )
    tail = (
        " Use fp8jax's train step: differentiate params and the fp8_probe collection only, and "
        "fold the probe gradients into fp8_meta with fp8jax.flax.Fp8TrainState.apply_gradients "
        "or fp8jax.flax.update_fp8_variables, which merge a module's calls by max "
        "(docs/porting-from-te.md)."
    )
    numbers = _probe_numbers(module)
    if not has_probe and numbers:
        # A number without a probe while others have one: the pass of nn.scan whose results
        # Flax discards. Nothing of it reaches the loss, so its cotangents are symbolic zeros.
        return None
    if not has_probe:
        return head + (
            f"this call has no {FP8_PROBE!r} variable, so what it observes cannot reach the "
            "state. Pass apply every collection init returned (params, fp8_meta, fp8_probe)." + tail
        )
    if index != min(numbers):
        return head + (
            f"this module is called {len(numbers)} times per forward pass (this is call "
            f"{index}), and autodiff would add up the calls' next states; only a module called "
            "once per forward pass can hand out its next state as a gradient." + tail
        )
    if _state_broadcast(module, f"call_{index}"):
        return head + (
            f"{meta_collection()!r} is broadcast over a lifted transform (nn.scan, nn.vmap, "
            f"...) in which {FP8_PROBE!r} has an axis, so every iteration uses the same state "
            f"and autodiff would add up their next states. Give {meta_collection()!r} the "
            "variable axis "
            f"{FP8_PROBE!r} has." + tail
        )
    return None


def _outer_ndim(module: nn.Module, collection: str, name: str) -> int | None:
    """The rank, as the ``init``/``apply`` was given it, of ``module``'s variable ``name`` in
    ``collection`` when a lifted transform lies in between (its stacked dims included); None
    without a lifted transform or when it cannot be found."""
    owner = _count_owner(module)
    if module.scope is None or owner.scope is None or module.scope.root is owner.scope:
        return None
    try:
        tree = owner.scope.variables().get(collection)
    except Exception:  # a scope that cannot list its variables: assume nothing
        return None
    for key in (*module.scope.path, name):
        tree = tree.get(key) if hasattr(tree, "get") else None
    return None if tree is None else jnp.ndim(tree)


def _state_broadcast(module: nn.Module, probe_name: str) -> bool:
    """Whether a lifted transform between the apply and ``module`` gives the probe more stacked
    dims than the state (the state is broadcast over iterations that each have a probe)."""
    probe = _outer_ndim(module, FP8_PROBE, probe_name)
    scale = _outer_ndim(module, meta_collection(), "scale")
    return probe is not None and scale is not None and probe > scale


def fp8_call(module: nn.Module, n_roles: int = _N_ROLES) -> Fp8Call:
    """Reads the autocast state and, for DelayedScaling, this call's state and probe.

    ``n_roles``: the module's tensor roles, 3 per FP8 GEMM (:func:`fp8jax.state.gemm_roles`).

    Must be called from inside a bound module's method (``nn.compact`` or ``setup``-style).
    Outside autocast or with FP8 disabled no variable is read or created; with
    :class:`~fp8jax.recipe.Float8CurrentScaling` or a block-scaled recipe neither is needed.
    """
    recipe = get_recipe()
    if not is_fp8_enabled():
        return Fp8Call(enabled=False, recipe=recipe, meta=None, probe=None, where=_where(module))
    recipe = check_recipe(recipe, f"{_where(module)}: the autocast recipe")
    if not recipe.keeps_state:  # no FP8 variables, no probe
        return Fp8Call(enabled=True, recipe=recipe, meta=None, probe=None, where=_where(module))
    backward_roles(n_roles)  # validates: GEMM triples
    meta = _meta(module, recipe, n_roles)
    probe, record, index = _probe(module, n_roles)
    if not module.is_initializing():
        refusal = _state_gradient_refusal(module, index, probe is not None)
        linked, linked_probe = state_gradient_link(
            meta, jnp.zeros((n_roles,), jnp.float32) if probe is None else probe, recipe, refusal
        )
        meta, probe = linked, (None if probe is None else linked_probe)
    return Fp8Call(
        enabled=True, recipe=recipe, meta=meta, probe=probe, where=_where(module), record=record
    )
