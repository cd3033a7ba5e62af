"""TransformerEngine arguments that fp8jax's modules accept only at TE's "off" value.

TE code passes them explicitly, often at their defaults (``enable_low_rank_adaptation=False``,
``low_rank_adaptation_scope="none"``, ...), so each module with a TE twin declares the field and
checks here that it is off: an "on" value is a ValueError naming the argument and saying why,
never silently ignored. One table holds the off values and the reasons
(docs/porting-from-te.md lists them per module).
"""

from __future__ import annotations

from typing import Any

import flax.linen as nn

__all__ = ["OFF", "check_no_score_mod", "check_off"]

_LORA = "LoRA (low-rank adaptation) is not implemented"
_CP = "context parallelism is not implemented"

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
    "context_parallel_causal_load_balanced": (False, _CP),
    "context_parallel_axis": ("", _CP),
    "context_parallel_strategy": ("DEFAULT", _CP),
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


def check_off(owner: str, module: nn.Module, *names: str) -> None:
    """ValueError if any field ``names`` of ``module`` is not at its TE off value (:data:`OFF`)."""
    for name in names:
        off, why = OFF[name]
        value = getattr(module, name)
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
