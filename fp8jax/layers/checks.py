"""The argument checks every fp8jax layer shares, in both Flax APIs: float inputs, positive
sizes, axis and logical-name arguments, and TransformerEngine arguments that fp8jax accepts only
at TE's "off" value.

TE code passes those explicitly, often at their defaults (``enable_low_rank_adaptation=False``,
``low_rank_adaptation_scope="none"``, ...), so each layer with a TE twin declares the field and
checks here that it is off: an "on" value is a ValueError naming the argument and saying why,
never silently ignored. One table holds the off values and the reasons
(docs/porting-from-te.md lists them per module).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = [
    "OFF",
    "as_tuple",
    "check_float_array",
    "check_names",
    "check_no_score_mod",
    "check_off",
    "normalize_axes",
    "positive_int",
]

_LORA = "LoRA (low-rank adaptation) is not implemented"

#: TE argument -> (its off value, why fp8jax supports nothing else).
OFF: dict[str, tuple[Any, str]] = {
    "enable_low_rank_adaptation": (False, _LORA),
    "low_rank_adaptation_scope": ("none", _LORA),
    "quantization_checkpoint_name": (
        None,
        "fp8jax names every FP8 operand itself (fp8jax.CHECKPOINT_NAMES); save them under "
        "remat with the policy fp8jax.save_fp8_operands",
    ),
    "activation_params": (None, "the clamped activations are not implemented"),
    "mlp_activation_params": (None, "the clamped activations are not implemented"),
    "softmax_type": ("vanilla", "only the vanilla softmax is implemented"),
    "score_mod": (None, "cuDNN score modifiers are not implemented"),
    "score_mod_bprop": (None, "cuDNN score modifiers are not implemented"),
    "max_segments_per_seq": (1, "packed (THD) layouts are not implemented; use segment_ids"),
    "dot_1_input_axes": (
        None,
        "the FC1 input exists only inside the fused norm+FP8 cast; constrain the module's "
        "input with layernorm_input_axes",
    ),
    "dot_2_input_axes": (
        None,
        "the FC2 input exists only inside the fused activation+FP8 cast; shard the MLP width "
        "with kernel_axes_1/kernel_axes_2",
    ),
    # MultiHeadAttention's deprecated aliases (TE v2 still accepts them with a warning).
    "num_heads": (None, "a deprecated alias in TE; use num_attention_heads"),
    "dropout_rate": (None, "a deprecated alias in TE; use attention_dropout"),
    "output_layernorm": (None, "deprecated in TE; a post-norm is TransformerLayer's option"),
    "apply_residual_connection_post_layernorm": (
        None,
        "deprecated in TE (without effect there); it is TransformerLayer's option",
    ),
    "fuse_qkv": (None, "a deprecated alias in TE; use fuse_qkv_params"),
}


def _is_off(value: Any, off: Any) -> bool:
    if off is None:
        return value is None or (isinstance(value, (tuple, list)) and not value)
    if isinstance(off, bool):
        return value is off or (isinstance(value, bool) and value == off)
    return isinstance(value, type(off)) and value == off


def check_off(owner: str, config: Any, *names: str) -> None:
    """ValueError if any field ``names`` of ``config`` (a layer's config, or the module that is
    one) is not at its TE off value (:data:`OFF`)."""
    for name in names:
        off, why = OFF[name]
        value = getattr(config, name)
        if not _is_off(value, off):
            raise ValueError(
                f"{owner}: {name}={value!r} is not supported by fp8jax ({why}); leave it at "
                f"TransformerEngine's default {off!r} (docs/porting-from-te.md)"
            )


def check_no_score_mod(owner: str, tensors: Any, bprop_tensors: Any) -> None:
    """ValueError unless TE's ``score_mod_tensors``/``score_mod_bprop_tensors`` call arguments
    are ``None`` (score modifiers are not implemented)."""
    for name, value in (("score_mod_tensors", tensors), ("score_mod_bprop_tensors", bprop_tensors)):
        if value is not None:
            raise ValueError(
                f"{owner}: {name} must be None: cuDNN score modifiers are not implemented in "
                "fp8jax (docs/porting-from-te.md)"
            )


def check_float_array(owner: str, name: str, value: Any) -> jax.Array:
    """``value`` as an array, or a TypeError naming ``name`` if it is not a float array."""
    if not hasattr(value, "dtype") or not hasattr(value, "shape"):
        raise TypeError(f"{owner}: {name} must be a floating-point array, got {type(value)}")
    if not jnp.issubdtype(value.dtype, jnp.floating):
        raise TypeError(
            f"{owner}: {name} must be a floating-point array (float32, bfloat16 or float16), "
            f"got dtype {value.dtype}"
        )
    return value


def positive_int(owner: str, name: str, value: Any) -> int:
    """``value`` as an int, or a ValueError naming ``name`` unless it is a positive int."""
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{owner}: {name} must be a positive int, got {value!r}")
    return int(value)


def as_tuple(value: int | Sequence[int]) -> tuple[int, ...]:
    if isinstance(value, (int, np.integer)):
        return (int(value),)
    return tuple(value)


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
