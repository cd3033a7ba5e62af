"""Rotary position embeddings (RoPE) with TransformerEngine's two ways of pairing coordinates.

For a vector ``x`` of even width ``d`` at sequence position ``p``, coordinate pair ``i``
(``0 <= i < d/2``) is rotated by the angle

.. math::

    \\theta_{p,i} = p / \\tau_i, \\qquad \\tau_i = w_{min} \\, (w_{max} / w_{min})^{2i/d}

where ``(w_min, w_max)`` are the ``windows`` (TE's default ``(1, 10000)`` gives the usual
``10000^{2i/d}``). A pair ``(a, b)`` becomes ``(a cos θ - b sin θ, b cos θ + a sin θ)``.
``group_method`` chooses the pairs:

- ``"consecutive"``: ``(x[2i], x[2i+1])`` (the RoFormer/GPT-J layout);
- ``"alternate"``: ``(x[i], x[i + d/2])`` (the GPT-NeoX/LLaMA "rotate half" layout).

The angles are computed in float32 and the result is cast back to ``x``'s dtype. Positions are
``0 .. seq-1`` along the sequence axis, or an explicit ``positions`` array (e.g. the step of an
autoregressive decode, or positions within packed sequences).

>>> import jax.numpy as jnp
>>> from fp8jax.rotary import rotary_pos_emb
>>> x = jnp.ones((1, 3, 2, 4))  # (batch, seq, heads, head_dim)
>>> rotary_pos_emb(x, (1, 10000), transpose_batch_sequence=False).shape
(1, 3, 2, 4)
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

__all__ = ["GROUP_METHODS", "canonical_group_method", "rotary_angles", "rotary_pos_emb"]

#: The accepted ``group_method`` values.
GROUP_METHODS = ("consecutive", "alternate")


def canonical_group_method(group_method: Any, name: str = "group_method") -> str:
    """``group_method`` lower-cased without ``-``/``_``/spaces; ValueError naming ``name``."""
    if not isinstance(group_method, str):
        raise TypeError(f"{name} must be a str in {GROUP_METHODS}, got {group_method!r}")
    out = group_method.lower().strip().replace("-", "").replace("_", "")
    if out not in GROUP_METHODS:
        raise ValueError(f"{name} must be one of {GROUP_METHODS}, got {group_method!r}")
    return out


def _check_windows(windows: Any) -> tuple[float, float]:
    try:
        lo, hi = (float(w) for w in windows)
    except (TypeError, ValueError):
        raise TypeError(
            f"rotary_pos_emb_windows must be a pair (min, max) of numbers, got {windows!r}"
        ) from None
    if not 0 < lo <= hi:
        raise ValueError(f"rotary_pos_emb_windows must satisfy 0 < min <= max, got {windows!r}")
    return lo, hi


def rotary_angles(positions: jax.Array, width: int, windows: Sequence[float]) -> jax.Array:
    """The float32 angles ``positions[..., None] / tau`` of shape ``(*positions.shape,
    width // 2)`` (see the module docstring for ``tau``)."""
    lo, hi = _check_windows(windows)
    half = width // 2
    fraction = 2.0 * np.arange(half, dtype=np.float64) / width
    timescale = jnp.asarray(lo * (hi / lo) ** fraction, jnp.float32)
    return jnp.asarray(positions, jnp.float32)[..., None] / timescale


def rotary_pos_emb(
    x: jax.Array,
    windows: Sequence[float],
    transpose_batch_sequence: bool,
    group_method: str = "consecutive",
    *,
    positions: jax.Array | None = None,
) -> jax.Array:
    """Rotates ``x`` (``[batch, seq, ..., width]``, or ``[seq, batch, ..., width]`` with
    ``transpose_batch_sequence``) by its positions; see the module docstring for the math.

    Args:
      x: float array, rank >= 3, even last dim.
      windows: ``(min, max)`` time scales.
      transpose_batch_sequence: whether the sequence axis comes first.
      group_method: ``"consecutive"`` or ``"alternate"``.
      positions: optional integer positions of shape ``(seq,)`` or ``(batch, seq)`` (in
        ``x``'s batch/sequence order); default ``arange(seq)``.
    Returns:
      The rotated array, same shape and dtype as ``x``.
    """
    method = canonical_group_method(group_method, "rotary_pos_emb_group_method")
    x = jnp.asarray(x)
    if x.ndim < 3:
        raise ValueError(f"rotary_pos_emb: x must have rank >= 3, got shape {x.shape}")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"rotary_pos_emb: x must be a float array, got {x.dtype}")
    width = x.shape[-1]
    if width % 2:
        raise ValueError(f"rotary_pos_emb: the last dim (head_dim) must be even, got {width}")
    seq_dim, batch_dim = (0, 1) if transpose_batch_sequence else (1, 0)
    seq, batch = x.shape[seq_dim], x.shape[batch_dim]
    if positions is None:
        pos = jnp.arange(seq)[None, :]
    else:
        pos = jnp.asarray(positions)
        if pos.ndim == 1:
            pos = pos[None, :]
        if pos.ndim != 2 or pos.shape[1] != seq or pos.shape[0] not in (1, batch):
            raise ValueError(
                f"rotary_pos_emb: positions must have shape ({seq},) or ({batch}, {seq}), got "
                f"{jnp.shape(positions)}"
            )
    angles = rotary_angles(pos, width, windows)  # (b|1, seq, half)
    if transpose_batch_sequence:
        angles = jnp.swapaxes(angles, 0, 1)
    angles = angles.reshape(angles.shape[:2] + (1,) * (x.ndim - 3) + angles.shape[2:])
    cos, sin = jnp.cos(angles), jnp.sin(angles)
    xf = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    if method == "alternate":
        a, b = xf[..., : width // 2], xf[..., width // 2 :]
        out = jnp.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)
    else:
        pairs = xf.reshape(*x.shape[:-1], width // 2, 2)
        a, b = pairs[..., 0], pairs[..., 1]
        out = jnp.stack([a * cos - b * sin, b * cos + a * sin], axis=-1).reshape(x.shape)
    return out.astype(x.dtype)
