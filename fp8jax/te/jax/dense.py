"""TransformerEngine's ``transformer_engine.jax.dense.dense``, run by :func:`fp8jax.dense`.

The quantizer set says the recipe and, under delayed scaling, the state of the GEMM's three
roles (:mod:`fp8jax.te.jax.quantize`); the state's gradient is its next value (TE's
convention). With :data:`~fp8jax.te.jax.quantize.noop_quantizer_set` the GEMM is a plain
high-precision one in ``x``'s dtype.

>>> import jax.numpy as jnp
>>> from fp8jax.te.jax.dense import dense
>>> dense(jnp.ones((2, 4)), jnp.full((4, 3), 0.5)).tolist()
[[2.0, 2.0, 2.0], [2.0, 2.0, 2.0]]
"""

from __future__ import annotations

from collections.abc import Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp

import fp8jax
from fp8jax.te.jax.cpp_extensions import (
    CollectiveOpSet,
    check_no_collective,
    noop_collective_op_set,
)
from fp8jax.te.jax.quantize import QuantizerSet, gemm_inputs, noop_quantizer_set

__all__ = ["constrain", "dense"]


def constrain(x: jax.Array, axes: tuple[str, ...] | None) -> jax.Array:
    """``x`` constrained to the logical ``axes`` (Flax's logical axis rules), as TE does with
    its ``*_axes`` arguments; unchanged for ``None`` or ``()``."""
    return nn.with_logical_constraint(x, tuple(axes)) if axes else x


def _dims(dims: Sequence[int], ndim: int, what: str) -> tuple[int, ...]:
    out = []
    for d in dims:
        if not isinstance(d, int) or not -ndim <= d < ndim:
            raise ValueError(f"dense: contracting_dims: {d!r} is out of range for {what}")
        out.append(d % ndim)
    if len(set(out)) != len(out):
        raise ValueError(f"dense: contracting_dims: repeated dim for {what}: {tuple(dims)}")
    return tuple(out)


def dense(
    x: jax.Array,
    kernel: jax.Array,
    bias: jax.Array | None = None,
    contracting_dims: tuple[Sequence[int], Sequence[int]] = ((1,), (0,)),
    transpose_batch_sequence: bool = False,
    input_axes: tuple[str, ...] | None = None,
    kernel_axes: tuple[str, ...] | None = None,
    output_axes: tuple[str, ...] | None = None,
    collective_op_set: CollectiveOpSet = noop_collective_op_set,
    quantizer_set: QuantizerSet = noop_quantizer_set,
) -> jax.Array:
    """TE's dense: contracts ``x``'s ``contracting_dims[0]`` with ``kernel``'s
    ``contracting_dims[1]``; the result is ``x``'s other dims then ``kernel``'s, plus ``bias``
    (shaped as ``kernel``'s other dims), in ``x``'s dtype.

    Args:
      x, kernel, bias: as TE's.
      contracting_dims: ``(x dims, kernel dims)``, paired in order (TE's default ``((1,),
        (0,))``; negative dims count from the end).
      transpose_batch_sequence: accepted for TE compatibility; the layout does not change the
        computation here.
      input_axes, kernel_axes, output_axes: logical axes to constrain ``x``, ``kernel`` and the
        output to (Flax's logical axis rules); ``None`` for none.
      collective_op_set: :data:`~fp8jax.te.jax.cpp_extensions.noop_collective_op_set` only
        (collective GEMM is a ``NotImplementedError``).
      quantizer_set: the GEMM's quantizers (:meth:`~fp8jax.te.jax.flax.module.
        TransformerEngineBase.generate_quantizer_set`).
    """
    del transpose_batch_sequence
    check_no_collective(collective_op_set, "dense: collective_op_set")
    for name, v in (("x", x), ("kernel", kernel)):
        if not hasattr(v, "ndim") or not jnp.issubdtype(v.dtype, jnp.floating):
            raise TypeError(f"dense: {name} must be a floating-point array, got {v!r:.80}")
    if not (isinstance(contracting_dims, (tuple, list)) and len(contracting_dims) == 2):
        raise ValueError(
            f"dense: contracting_dims must be (x dims, kernel dims), got {contracting_dims!r}"
        )
    x_dims = _dims(contracting_dims[0], x.ndim, f"x of rank {x.ndim}")
    k_dims = _dims(contracting_dims[1], kernel.ndim, f"kernel of rank {kernel.ndim}")
    if len(x_dims) != len(k_dims):
        raise ValueError(
            f"dense: contracting_dims pairs {len(x_dims)} x dims with {len(k_dims)} kernel dims"
        )
    gemm = gemm_inputs((quantizer_set,), "dense: quantizer_set")
    x = constrain(x, input_axes)
    kernel = constrain(kernel, kernel_axes)
    rest = [d for d in range(kernel.ndim) if d not in k_dims]
    if list(k_dims) != list(range(len(k_dims))):  # fp8jax.dense contracts the leading dims
        kernel = jnp.transpose(kernel, (*k_dims, *rest))
    y = fp8jax.dense(
        x,
        kernel,
        bias,
        gemm.meta,
        gemm.recipe,
        probe=gemm.probe,
        axis=x_dims,
        dtype=x.dtype,
        enabled=gemm.enabled,
    )
    return constrain(y, output_axes)
