"""TransformerEngine's ``transformer_engine.jax.layernorm_dense.layernorm_dense``, run by
:func:`fp8jax.layernorm_dense` (the norm, then one FP8 GEMM; quantizer sets as for
:func:`fp8jax.te.jax.dense.dense`).

>>> import jax.numpy as jnp
>>> from fp8jax.te.jax.layernorm_dense import layernorm_dense
>>> x = jnp.arange(8.0).reshape(2, 4)
>>> layernorm_dense(x, jnp.ones((4, 2)), jnp.ones(4), None, norm_type="rmsnorm").shape
(2, 2)
"""

from __future__ import annotations

import jax

import fp8jax
from fp8jax.te.jax.dense import constrain
from fp8jax.te.jax.quantize import QuantizerSet, gemm_inputs, noop_quantizer_set

__all__ = ["layernorm_dense"]


def layernorm_dense(
    x: jax.Array,
    kernel: jax.Array,
    gamma: jax.Array,
    beta: jax.Array | None,
    bias: jax.Array | None = None,
    norm_type: str = "layernorm",
    zero_centered_gamma: bool = False,
    epsilon: float = 1e-6,
    transpose_batch_sequence: bool = False,
    layernorm_input_axes: tuple[str, ...] | None = None,
    dot_input_axes: tuple[str, ...] | None = None,
    kernel_axes: tuple[str, ...] | None = None,
    quantizer_set: QuantizerSet = noop_quantizer_set,
) -> jax.Array:
    """TE's layernorm_dense: ``norm(x) @ kernel + bias`` over ``x``'s last dim, in ``x``'s
    dtype.

    Args:
      x: input ``[..., hidden]``; kernel: ``[hidden, *features]``; gamma, beta: the norm's
        scale and bias (``beta=None`` for ``norm_type="rmsnorm"``); bias: ``features``.
      norm_type: ``"layernorm"`` or ``"rmsnorm"``.
      zero_centered_gamma, epsilon: as TE's.
      transpose_batch_sequence: accepted; the layout does not change the computation here.
      layernorm_input_axes, kernel_axes: logical axes to constrain ``x`` and ``kernel`` to.
      dot_input_axes: TE constrains the norm's output with it; inside fp8jax's fused layer that
        tensor is not exposed, so it is accepted and not applied.
      quantizer_set: the GEMM's quantizers.
    """
    del transpose_batch_sequence, dot_input_axes
    gemm = gemm_inputs((quantizer_set,), "layernorm_dense: quantizer_set")
    x = constrain(x, layernorm_input_axes)
    kernel = constrain(kernel, kernel_axes)
    return fp8jax.layernorm_dense(
        x,
        gamma,
        beta,
        kernel,
        bias,
        gemm.meta,
        gemm.recipe,
        probe=gemm.probe,
        layernorm_type=norm_type,
        epsilon=epsilon,
        zero_centered_gamma=zero_centered_gamma,
        dtype=x.dtype,
        enabled=gemm.enabled,
    )
