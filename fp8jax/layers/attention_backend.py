"""Which implementation of :func:`jax.nn.dot_product_attention` the attention core runs.

``implementation=None`` (the default of :class:`~fp8jax.flax.DotProductAttention`,
:class:`~fp8jax.flax.MultiHeadAttention`'s ``attention_implementation`` and the NNX modules)
means **cuDNN's fused flash attention where JAX can lower it, else XLA's path**, decided while
tracing by :func:`choose_attention`:

1. JAX's default backend is a GPU (on CPU, and any other platform, XLA's path);
2. the inputs are bfloat16 or float16 (cuDNN's flash attention takes no float32);
3. JAX's own cuDNN checks accept the configuration: the call, and its gradient's forward rule
   (the training checks: head dim, sequence lengths with a bias, the sliding window, the cuDNN
   version and compute capability), are traced with ``implementation="cudnn"`` on abstract
   values (:func:`jax.eval_shape`); any error there means XLA's path.

XLA's path keeps the ``S x S`` probabilities in memory; cuDNN's does not (TransformerEngine uses
cuDNN's fused attention too). The two agree to the inputs' precision, not bit for bit. A
configuration that cuDNN rejects only when compiling (e.g. inputs split along the sequence or
head dim over a mesh) needs ``implementation="xla"`` given explicitly; ``"cudnn"`` given
explicitly raises where cuDNN cannot run, as :func:`jax.nn.dot_product_attention` does.

With ``fp8_dpa`` (FP8 on), :func:`fp8_dpa_refusal` says why the FP8 attention
(:func:`fp8jax.dot_product_attention`) cannot run a call; the core then runs the attention above
in the input dtype with one :class:`Fp8AttentionFallback` warning naming the reason, or raises
it as a ValueError inside :func:`strict_fp8_attention`.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import jax
import jax.numpy as jnp

from fp8jax.ops.attention import fp8_attention as fp8_attention_op

__all__ = [
    "Fp8AttentionFallback",
    "choose_attention",
    "cuda_default_backend",
    "fp8_dpa_refusal",
    "refuse_or_warn",
    "strict_fp8_attention",
]

_CUDNN_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def cuda_default_backend() -> bool:
    """Whether JAX's default backend is a GPU (what JAX's own cuDNN checks look at; on a ROCm
    GPU those checks fail, "cuDNN is not detected", and XLA's path is taken)."""
    return fp8_attention_op.gpu_backend()


def _abstract(x: Any) -> Any:
    return None if x is None else jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x))


def _cudnn_traces(q, k, v, bias, mask, kwargs: dict[str, Any]) -> bool:
    """Whether JAX traces the cuDNN attention, and its gradient's forward rule, for these
    abstract inputs without an error."""

    def forward_and_vjp(q, k, v, bias, mask):
        def f(q, k, v):
            return jax.nn.dot_product_attention(q, k, v, bias, mask, implementation="cudnn",
                                                **kwargs)  # fmt: skip

        return jax.vjp(f, q, k, v)[0]

    try:
        jax.eval_shape(forward_and_vjp, *(_abstract(t) for t in (q, k, v, bias, mask)))
    except (NotImplementedError, ValueError, RuntimeError, TypeError):
        return False
    return True


def choose_attention(
    implementation: str | None,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    bias: jax.Array | None,
    mask: jax.Array | None,
    **kwargs: Any,
) -> str:
    """The ``implementation`` to pass to :func:`jax.nn.dot_product_attention` for these inputs:
    the given one, or with ``None`` ``"cudnn"`` where JAX can lower it and ``"xla"`` elsewhere
    (module docstring). ``kwargs``: the call's other arguments (``scale``, ``is_causal``,
    ``local_window_size``)."""
    if implementation is not None:
        return implementation
    if not cuda_default_backend():
        return "xla"
    if any(jnp.result_type(t) not in _CUDNN_DTYPES for t in (q, k, v)):
        return "xla"
    return "cudnn" if _cudnn_traces(q, k, v, bias, mask, kwargs) else "xla"


# ----------------------------------------------------------------------------------- fp8_dpa


class Fp8AttentionFallback(UserWarning):
    """``fp8_dpa`` asked for FP8 attention where it cannot run; the attention ran in the input
    dtype instead (the message names the reason)."""


# Created once, at import; part of jax.jit's cache key, thread-local (as fp8jax.ops.implementation).
_STRICT = jax.make_user_context(default_value=False)


@contextlib.contextmanager
def strict_fp8_attention(strict: bool = True) -> Iterator[None]:
    """Within (for the code traced inside): an ``fp8_dpa`` attention that cannot run in FP8 is
    a ValueError naming the reason instead of a :class:`Fp8AttentionFallback` warning."""
    if not isinstance(strict, bool):
        raise TypeError(f"strict_fp8_attention: strict must be a bool, got {strict!r}")
    with _STRICT(strict):
        yield


def fp8_dpa_refusal(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    *,
    recipe: Any,
    stateless: bool,
    scale: float,
    is_causal: bool,
    padded: bool,
    bias: Any,
    window: Any,
    dropout: bool,
    implementation: str = "xla",
) -> str | None:
    """Why the FP8 attention cannot run this call, or ``None``: it has no bias, padding or
    segment mask, sliding window or active dropout (its reference and cuDNN's take none), a
    per-tensor recipe, and on a GPU the attention family's ``implementation`` is ``"kernel"``
    (cuDNN's FP8 attention, opted into: its backward is not the reference's, and the reference
    would keep ``[B, H, S, S]``), cuDNN must take the call
    (:func:`~fp8jax.ops.cudnn_fp8_attention_refusal`) and the scaling is delayed
    (``stateless``: current scaling, whose scales of the tensors cuDNN makes exist only after it
    runs). On any other backend the reference runs, any shape."""
    if not recipe.per_tensor:
        how = "block-scaled" if recipe.block_scaled else f"{recipe.scaling.value}-scaled"
        return f"{type(recipe).__name__} is {how}; FP8 attention scales per tensor"
    for what, present in (("bias", bias is not None), ("padding or segment mask", padded),
                          ("sliding window", window is not None),
                          ("active attention dropout", dropout)):  # fmt: skip
        if present:
            return f"the FP8 attention takes no {what}"
    if not cuda_default_backend():
        return None
    if implementation != "kernel":
        return ("on a GPU the FP8 attention is cuDNN's, whose backward takes the softmax "
                "gradient's row sums from its FP8 output, not the reference's (emulated on CPU "
                "it trained the GPT demo 22-31% worse than BF16); opt in with "
                "fp8jax.ops.implementation(attention='kernel')")  # fmt: skip
    if stateless:
        return ("cuDNN's FP8 attention needs the scales of the tensors it makes (P, O, dS, dQ, "
                "dK, dV) before it runs, which current scaling has only after; use "
                "DelayedScaling")  # fmt: skip
    return fp8_attention_op.cudnn_fp8_attention_refusal(q, k, v, scale=scale, causal=is_causal)


def refuse_or_warn(where: str, reason: str) -> None:
    """A refused ``fp8_dpa``: a ValueError inside :func:`strict_fp8_attention`, else one
    :class:`Fp8AttentionFallback` warning."""
    message = (f"{where}: fp8_dpa=True, but the FP8 attention cannot run this call: "
               f"{reason.rstrip('.')}. "
               "It runs in the input dtype instead.")  # fmt: skip
    if _STRICT.value:
        raise ValueError(message.replace("It runs in the input dtype instead.",
                                         "(strict_fp8_attention)"))  # fmt: skip
    warnings.warn(message, Fp8AttentionFallback, stacklevel=3)
