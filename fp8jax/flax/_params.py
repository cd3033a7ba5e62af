"""How fp8jax's Flax modules (Linen and NNX) declare their params and lay out their activations,
shared by all of them: an initializer drawn in a flat (2-D) shape and reshaped, as Flax's
``DenseGeneral`` draws its kernel; logical axis names (the boxing of an initializer, the sharding
constraint of an activation); a dense layer's contracted axes and its output's layout."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.core import meta
from flax.typing import Initializer
from jax.sharding import PartitionSpec

from fp8jax.ops import _partition

__all__ = [
    "annotated",
    "as_tuple",
    "check_names",
    "constrain",
    "explicit_spec",
    "flat_init",
    "laid_out",
    "normalize_axes",
    "reshard_batch_dims",
]


def as_tuple(value: int | Sequence[int]) -> tuple[int, ...]:
    if isinstance(value, (int, np.integer)):
        return (int(value),)
    return tuple(value)


def flat_init(init: Initializer, flat_shape: tuple[int, ...]) -> Any:
    """Wraps ``init`` to draw a ``flat_shape`` tensor and reshape it (as Flax's DenseGeneral)."""

    def wrapped(rng: jax.Array, shape: tuple[int, ...], dtype: Any = jnp.float32) -> Any:
        value = init(rng, flat_shape, dtype)
        if isinstance(value, meta.AxisMetadata):
            return meta.replace_boxed(value, jnp.reshape(value.unbox(), shape))
        return jnp.reshape(value, shape)

    return wrapped


def check_names(owner: str, name: str, names: Any, ndim: int) -> tuple[str | None, ...]:
    """``names`` as a tuple of ``ndim`` logical axis names (str or None); ValueError otherwise."""
    if isinstance(names, str):
        names = (names,)
    try:
        out = tuple(names)
    except TypeError:
        raise TypeError(
            f"{owner}: {name} must be a tuple of axis names (str or None), got {names!r}"
        ) from None
    if any(n is not None and not isinstance(n, str) for n in out):
        raise TypeError(f"{owner}: {name} must hold str or None, got {names!r}")
    if len(out) != ndim:
        raise ValueError(f"{owner}: {name}={names!r} must name {ndim} dims, got {len(out)}")
    return out


def constrain(owner: str, name: str, x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """``x`` with logical axis ``names`` as a sharding constraint (nothing when empty)."""
    if not names:
        return x
    return nn.with_logical_constraint(x, check_names(owner, name, names, x.ndim))


def annotated(owner: str, name: str, init: Any, names: Any, ndim: int) -> Any:
    """``init`` boxed with logical axis ``names``; ``init`` itself when ``names`` is empty."""
    if not names:
        return init
    return nn.with_logical_partitioning(init, check_names(owner, name, names, ndim))


def normalize_axes(owner: str, name: str, axes: Any, ndim: int) -> tuple[int, ...]:
    """Non-negative, sorted (as Flax sorts them), distinct axes; ValueError naming ``name``."""
    try:
        raw = as_tuple(axes)
    except TypeError:
        raise TypeError(
            f"{owner}: {name} must be an int or a sequence of ints, got {axes!r}"
        ) from None
    out = []
    for a in raw:
        if not isinstance(a, (int, np.integer)) or isinstance(a, bool):
            raise TypeError(f"{owner}: {name} must hold ints, got {axes!r}")
        if not -ndim <= a < ndim:
            raise ValueError(
                f"{owner}: {name}={axes!r} names axis {a}, out of range for an input of rank {ndim}"
            )
        out.append(int(a) % ndim)
    if not out or len(set(out)) != len(out):
        raise ValueError(f"{owner}: {name} must name at least one axis, each once; got {axes!r}")
    return tuple(sorted(out))


def explicit_spec(names: tuple[str | None, ...] | None) -> PartitionSpec | None:
    """The mesh ``PartitionSpec`` of logical ``names`` under the active axis rules, when the
    current mesh has explicit axes (``AxisType.Explicit``); ``None`` otherwise (no names, no
    rules, or automatic axes, where ``nn.with_logical_constraint`` does the job).

    With explicit axes a sharding constraint only asserts, so :class:`DenseGeneral` *makes* the
    output's layout instead (``jax.sharding.reshard``).
    """
    if names is None or not nn.get_logical_axis_rules() or not _partition.explicit_mesh():
        return None
    return nn.logical_to_mesh_axes(names)


def reshard_batch_dims(x: jax.Array, axes: tuple[int, ...], out_spec: PartitionSpec) -> jax.Array:
    """``x`` with its batch (non-contracted) dims laid out as the output's leading dims, so the
    GEMM's rows are already where the output wants them (e.g. sequence parallelism: the
    sequence is gathered before the column-parallel GEMM, as XLA does for a constraint under
    automatic axes). Contracted dims keep their axes, less any the batch dims now use."""
    current = [
        _partition.entry_axes(e)
        for e in (*jax.typeof(x).sharding.spec, *(None,) * x.ndim)[: x.ndim]
    ]
    batch = [d for d in range(x.ndim) if d not in axes]
    dims = list(current)
    for d, entry in zip(batch, tuple(out_spec)[: len(batch)], strict=False):
        dims[d] = _partition.entry_axes(entry)
    used = {a for d in batch for a in dims[d]}
    for d in axes:
        dims[d] = tuple(a for a in dims[d] if a not in used)
    if dims == current:
        return x
    return jax.sharding.reshard(x, _partition.spec(dims))


def laid_out(
    owner: str,
    output_axes: Any,
    inputs: jax.Array,
    axes: tuple[int, ...],
    n_features: int,
    dense: Callable[[jax.Array], jax.Array],
) -> jax.Array:
    """``dense(inputs)`` with the output laid out as logical ``output_axes`` name it: made so
    under explicit mesh axes (the GEMM's rows placed first, :func:`reshard_batch_dims`), a
    sharding constraint otherwise; ``dense`` itself without names."""
    out_names = None
    if output_axes:
        out_ndim = inputs.ndim - len(axes) + n_features
        out_names = check_names(owner, "output_axes", output_axes, out_ndim)
    out_spec = explicit_spec(out_names)
    if out_spec is not None:
        return jax.sharding.reshard(dense(reshard_batch_dims(inputs, axes, out_spec)), out_spec)
    y = dense(inputs)
    return y if out_names is None else nn.with_logical_constraint(y, out_names)
