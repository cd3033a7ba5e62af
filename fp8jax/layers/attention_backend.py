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
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp

__all__ = ["choose_attention", "cuda_default_backend"]

_CUDNN_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def cuda_default_backend() -> bool:
    """Whether JAX's default backend is a GPU (what JAX's own cuDNN checks look at; on a ROCm
    GPU those checks fail, "cuDNN is not detected", and XLA's path is taken)."""
    try:
        return jax.default_backend() in ("gpu", "cuda")
    except RuntimeError:
        return False


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
