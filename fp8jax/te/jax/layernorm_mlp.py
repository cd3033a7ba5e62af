"""TransformerEngine's ``transformer_engine.jax.layernorm_mlp.layernorm_mlp``, run by
:func:`fp8jax.layernorm_mlp` (norm, GEMM 1, activation, GEMM 2; one quantizer set per GEMM,
both of one recipe; the state rows are fc1's then fc2's).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax

import fp8jax
from fp8jax.te.jax.cpp_extensions import (
    CollectiveOpSet,
    check_no_collective,
    noop_collective_op_set,
)
from fp8jax.te.jax.dense import constrain
from fp8jax.te.jax.quantize import QuantizerSet, gemm_inputs, noop_quantizer_set

__all__ = ["layernorm_mlp"]


def _pair(value: Any, name: str) -> tuple[Any, Any]:
    if not isinstance(value, (tuple, list)) or len(value) != 2:
        raise ValueError(f"layernorm_mlp: {name} must be a pair (one per GEMM), got {value!r}")
    return tuple(value)


def layernorm_mlp(
    x: jax.Array,
    gamma: jax.Array,
    beta: jax.Array | None,
    kernels: Sequence[jax.Array],
    biases: Sequence[jax.Array | None],
    norm_type: str,
    zero_centered_gamma: bool = False,
    epsilon: float = 1e-6,
    transpose_batch_sequence: bool = False,
    norm_input_axes: tuple[str, ...] | None = None,
    dot_1_input_axes: tuple[str, ...] | None = None,
    dot_2_input_axes: tuple[str, ...] | None = None,
    kernel_1_axes: tuple[str, ...] | None = None,
    kernel_2_axes: tuple[str, ...] | None = None,
    ffn1_ckpt_name: str = "ffn1",
    ffn2_ckpt_name: str = "ffn2",
    activation_type: Sequence[str | Callable[..., Any]] = ("gelu",),
    activation_params: dict[str, Any] | None = None,
    collective_op_sets: tuple[CollectiveOpSet, CollectiveOpSet] = (
        noop_collective_op_set,
        noop_collective_op_set,
    ),
    quantizer_sets: tuple[QuantizerSet, QuantizerSet] = (noop_quantizer_set, noop_quantizer_set),
) -> jax.Array:
    """TE's layernorm_mlp: ``act(norm(x) @ kernels[0] + biases[0]) @ kernels[1] + biases[1]``
    in ``x``'s dtype.

    Args:
      x: ``[..., hidden]``; gamma, beta: the norm's (``beta=None`` for rmsnorm).
      kernels: ``(kernel_1 [hidden, len(activation_type), intermediate], kernel_2
        [intermediate, hidden])``; biases: their biases (entries may be ``None``).
      norm_type, zero_centered_gamma, epsilon: the norm, as TE's.
      transpose_batch_sequence, ffn1_ckpt_name, ffn2_ckpt_name: accepted; fp8jax names its
        checkpointed operands itself (``fp8jax.CHECKPOINT_NAMES``).
      norm_input_axes, kernel_1_axes, kernel_2_axes: logical axes to constrain ``x`` and the
        kernels to; dot_1_input_axes, dot_2_input_axes: tensors inside fp8jax's fused layer,
        accepted and not applied.
      activation_type: activation names fp8jax's ``layernorm_mlp`` knows (strings; a gated
        pair such as ``("silu", "linear")``).
      activation_params: TE's parameterised activations; only ``None``.
      collective_op_sets: no-op sets only.
      quantizer_sets: one per GEMM (fc1, fc2), one recipe.
    """
    del transpose_batch_sequence, dot_1_input_axes, dot_2_input_axes
    del ffn1_ckpt_name, ffn2_ckpt_name
    for i, ops in enumerate(_pair(collective_op_sets, "collective_op_sets")):
        check_no_collective(ops, f"layernorm_mlp: collective_op_sets[{i}]")
    if activation_params:
        raise NotImplementedError(
            f"layernorm_mlp: activation_params={activation_params!r}: parameterised "
            "activations are not implemented by fp8jax"
        )
    acts = tuple(activation_type)
    if not all(isinstance(a, str) for a in acts):
        raise TypeError(f"layernorm_mlp: activation_type must name activations (str), got {acts!r}")
    kernel_1, kernel_2 = _pair(kernels, "kernels")
    bias_1, bias_2 = _pair(biases, "biases")
    gemm = gemm_inputs(_pair(quantizer_sets, "quantizer_sets"), "layernorm_mlp: quantizer_sets")
    x = constrain(x, norm_input_axes)
    kernel_1 = constrain(kernel_1, kernel_1_axes)
    kernel_2 = constrain(kernel_2, kernel_2_axes)
    return fp8jax.layernorm_mlp(
        x,
        gamma,
        beta,
        kernel_1,
        kernel_2,
        bias_1,
        bias_2,
        gemm.meta,
        gemm.recipe,
        probe=gemm.probe,
        layernorm_type=norm_type,
        epsilon=epsilon,
        zero_centered_gamma=zero_centered_gamma,
        activations=acts,
        dtype=x.dtype,
        enabled=gemm.enabled,
    )
