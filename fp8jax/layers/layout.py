"""How fp8jax's layers lay out their activations on a mesh, in both Flax APIs: a sharding
constraint from logical axis names (Flax's logical axis rules,
:func:`flax.linen.logical_axis_rules`, which Linen and NNX models share), and a dense layer's
output laid out as its logical names say (made so under explicit mesh axes, where a constraint
only asserts)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import flax.linen as nn
import jax
from jax.sharding import PartitionSpec

from fp8jax.layers.checks import check_names
from fp8jax.ops.base import partition

__all__ = ["constrain", "explicit_spec", "laid_out", "reshard_batch_dims"]


def constrain(owner: str, name: str, x: jax.Array, names: Sequence[str | None]) -> jax.Array:
    """``x`` with logical axis ``names`` as a sharding constraint (nothing when empty); under
    explicit mesh axes, where a constraint only asserts, ``x`` laid out so."""
    if not names:
        return x
    names = check_names(owner, name, names, x.ndim)
    spec = explicit_spec(names)
    if spec is not None:
        return jax.sharding.reshard(x, spec)
    return nn.with_logical_constraint(x, names)


def explicit_spec(names: tuple[str | None, ...] | None) -> PartitionSpec | None:
    """The mesh ``PartitionSpec`` of logical ``names`` under the active axis rules, when the
    current mesh has explicit axes (``AxisType.Explicit``); ``None`` otherwise (no names, no
    rules, or automatic axes, where ``nn.with_logical_constraint`` does the job).

    With explicit axes a sharding constraint only asserts, so :class:`DenseGeneral` *makes* the
    output's layout instead (``jax.sharding.reshard``).
    """
    if names is None or not nn.get_logical_axis_rules() or not partition.explicit_mesh():
        return None
    return nn.logical_to_mesh_axes(names)


def reshard_batch_dims(x: jax.Array, axes: tuple[int, ...], out_spec: PartitionSpec) -> jax.Array:
    """``x`` with its batch (non-contracted) dims laid out as the output's leading dims, so the
    GEMM's rows are already where the output wants them (e.g. sequence parallelism: the
    sequence is gathered before the column-parallel GEMM, as XLA does for a constraint under
    automatic axes). Contracted dims keep their axes, less any the batch dims now use."""
    current = [
        partition.entry_axes(e) for e in (*jax.typeof(x).sharding.spec, *(None,) * x.ndim)[: x.ndim]
    ]
    batch = [d for d in range(x.ndim) if d not in axes]
    dims = list(current)
    for d, entry in zip(batch, tuple(out_spec)[: len(batch)], strict=False):
        dims[d] = partition.entry_axes(entry)
    used = {a for d in batch for a in dims[d]}
    for d in axes:
        dims[d] = tuple(a for a in dims[d] if a not in used)
    if dims == current:
        return x
    return jax.sharding.reshard(x, partition.spec(dims))


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
