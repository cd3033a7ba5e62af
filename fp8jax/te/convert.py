"""TransformerEngine's delayed-scaling state in checkpoints, to and from fp8jax's layout.

TE's JAX modules keep, per GEMM, six variables in their FP8 collection (``fp8_metas`` by
default; MaxText's ``_overwrite_with_gradient``): ``{p}{postfix}_scale`` ``float32[1]`` and
``{p}{postfix}_amax_history`` ``float32[L]`` for ``p`` in ``x``, ``kernel``, ``grad``. fp8jax's
own modules keep one :class:`~fp8jax.state.Fp8Meta` per module in ``fp8_meta``:
``amax_history`` ``float32[R, L]`` and ``scale`` ``float32[R]``, rows in GEMM triples
(input, kernel, grad_output).

The histories are in opposite orders. TE's delayed quantizer (``DelayedScaleQuantizer.update``
in ``transformer_engine/jax/quantize/quantizer.py``) writes the new amax at index 0, reduces,
then rolls the history by -1 and zeroes index 0: a stored TE history has the **newest amax
last** (index ``L-1``), older ones towards index 1, and index 0 is the zeroed slot the next
step writes. fp8jax's has the newest first (index 0) and the oldest last. Both reduce the same
``L`` amaxes at the next step, so the conversion is a reversal of the last axis:
``fp8jax = te[..., ::-1]`` (fp8jax's last slot, which falls off before the next reduction,
gets TE's zeroed slot) and ``te = fp8jax[..., ::-1]`` with index 0 zeroed (fp8jax's oldest
amax, which the next step would drop anyway). Scales mean the same in both
(``q = x * scale``) and are copied.

:mod:`fp8jax.te`'s own modules (``TransformerEngineBase.generate_quantizer_set``) keep TE's
variable names with the history in fp8jax's order: pass ``history_order="fp8jax"`` for them.

>>> import jax.numpy as jnp
>>> te = {"x_scale": jnp.ones(1), "x_amax_history": jnp.array([0.0, 1.0, 2.0]),
...       "kernel_scale": jnp.ones(1), "kernel_amax_history": jnp.zeros(3),
...       "grad_scale": jnp.ones(1), "grad_amax_history": jnp.zeros(3)}
>>> convert_te_state({"dense": te})["dense"]["amax_history"][0].tolist()
[2.0, 1.0, 0.0]

Leading axes (``nn.scan``'s stacked layers) are kept: ``[..., L]`` and ``[..., 1]`` become
``[..., R, L]`` and ``[..., R]``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import jax.numpy as jnp

__all__ = ["HISTORY_ORDERS", "TE_PREFIXES", "convert_te_state", "to_te_state"]

#: TE's variable prefix of each row of a GEMM triple (input, kernel, grad_output).
TE_PREFIXES: tuple[str, ...] = ("x", "kernel", "grad")
#: ``"te"``: TransformerEngine's history order (newest last); ``"fp8jax"``: newest first
#: (fp8jax's, and that of :mod:`fp8jax.te`'s own modules).
HISTORY_ORDERS: tuple[str, ...] = ("te", "fp8jax")

_NAME = re.compile(r"^(x|kernel|grad)(.*)_(scale|amax_history)$")


def _check_order(op: str, history_order: Any) -> None:
    if history_order not in HISTORY_ORDERS:
        raise ValueError(
            f"{op}: history_order must be one of {HISTORY_ORDERS}, got {history_order!r}"
        )


def _te_groups(op: str, path: str, node: Mapping) -> dict[str, dict[str, Any]] | None:
    """The GEMMs (by postfix) of a mapping of TE variables; ``None`` if it holds none."""
    groups: dict[str, dict[str, Any]] = {}
    for key, value in node.items():
        m = _NAME.match(key) if isinstance(key, str) else None
        if m is None or isinstance(value, Mapping):
            continue
        prefix, postfix, kind = m.groups()
        groups.setdefault(postfix, {})[f"{prefix}_{kind}"] = value
    if not groups:
        return None
    want = {f"{p}_{k}" for p in TE_PREFIXES for k in ("scale", "amax_history")}
    for postfix, got in groups.items():
        if set(got) != want:
            missing = sorted(want - set(got))
            raise ValueError(
                f"{op}: collection at {path or '<root>'!r}, postfix {postfix!r}: TE's state of "
                f"a GEMM has six variables; missing {missing}"
            )
    return groups


def convert_te_state(
    collection: Mapping,
    *,
    history_order: str = "te",
    gemm_order: Sequence[str] | None = None,
) -> dict:
    """TE's FP8 collection as fp8jax's ``fp8_meta`` collection.

    Every mapping in ``collection`` holding TE variables (``x_scale``, ``x_amax_history``, ...,
    ``grad_amax_history``, optionally with a postfix after the prefix) becomes
    ``{"amax_history": float32[..., 3 G, L], "scale": float32[..., 3 G]}``, the ``G`` GEMMs
    stacked in ``gemm_order`` (their postfixes; default: sorted, so ``""`` alone for a dense
    layer, ``"_0"``, ``"_1"`` for TE's ``LayerNormMLP``, which is fp8jax's fc1, fc2 order).
    Its other entries (sub-modules) are converted recursively and kept; non-FP8 leaves are
    copied.

    Args:
      collection: the FP8 collection of a TE model (``variables["fp8_metas"]``, or
        MaxText's ``variables["_overwrite_with_gradient"]``).
      history_order: ``"te"`` (a TransformerEngine checkpoint: newest amax last) or
        ``"fp8jax"`` (a collection of :mod:`fp8jax.te`'s modules: newest first).
      gemm_order: the postfixes in fp8jax's row order, for modules with several GEMMs.
    """
    op = "convert_te_state"
    _check_order(op, history_order)
    if not isinstance(collection, Mapping):
        raise TypeError(
            f"{op}: collection must be a mapping (a Flax variable collection), got "
            f"{type(collection).__name__}"
        )
    if gemm_order is not None and (
        isinstance(gemm_order, str) or not all(isinstance(p, str) for p in gemm_order)
    ):
        raise TypeError(
            f"{op}: gemm_order must be a sequence of postfixes (str), got {gemm_order!r}"
        )
    return _from_te(op, "", collection, history_order, gemm_order)


def _from_te(op, path, node, order, gemm_order) -> dict:
    out: dict[str, Any] = {}
    groups = _te_groups(op, path, node)
    if groups is not None:
        postfixes = sorted(groups) if gemm_order is None else list(gemm_order)
        if sorted(postfixes) != sorted(groups):
            raise ValueError(
                f"{op}: gemm_order={list(postfixes)!r} does not name the GEMMs at "
                f"{path or '<root>'!r}: {sorted(groups)!r}"
            )
        hists, scales = [], []
        for postfix in postfixes:
            g = groups[postfix]
            for p in TE_PREFIXES:
                h = jnp.asarray(g[f"{p}_amax_history"], jnp.float32)
                s = jnp.asarray(g[f"{p}_scale"], jnp.float32)
                if h.ndim < 1 or s.shape != (*h.shape[:-1], 1):
                    raise ValueError(
                        f"{op}: {path or '<root>'!r}/{p}{postfix}_*: scale {s.shape} and "
                        f"amax_history {h.shape} do not match TE's [..., 1] and [..., L]"
                    )
                hists.append(h[..., ::-1] if order == "te" else h)
                scales.append(s)
        out["amax_history"] = jnp.stack(hists, axis=-2)
        out["scale"] = jnp.concatenate(scales, axis=-1)
    for key, value in node.items():
        if isinstance(value, Mapping):
            out[key] = _from_te(op, f"{path}/{key}" if path else str(key), value, order, gemm_order)
        elif not (isinstance(key, str) and _NAME.match(key)):
            out[key] = value
    return out


def to_te_state(
    collection: Mapping,
    *,
    history_order: str = "te",
    postfixes: Sequence[str] | None = None,
) -> dict:
    """fp8jax's ``fp8_meta`` collection as TE's (the inverse of :func:`convert_te_state`).

    Every mapping with exactly ``amax_history`` ``[..., 3 G, L]`` and ``scale`` ``[..., 3 G]``
    becomes TE's six variables per GEMM, named with ``postfixes[g]`` (default: ``""`` for
    one GEMM, ``"_0"``, ``"_1"``, ... for several). With ``history_order="te"`` the histories
    are reversed and index 0 (TE's slot for the next amax) is zeroed: fp8jax's oldest amax,
    which the next step drops, is not kept.
    """
    op = "to_te_state"
    _check_order(op, history_order)
    if not isinstance(collection, Mapping):
        raise TypeError(
            f"{op}: collection must be a mapping (a Flax variable collection), got "
            f"{type(collection).__name__}"
        )
    if postfixes is not None and (
        isinstance(postfixes, str) or not all(isinstance(p, str) for p in postfixes)
    ):
        raise TypeError(f"{op}: postfixes must be a sequence of str, got {postfixes!r}")
    return _to_te(op, "", collection, history_order, postfixes)


def _to_te(op, path, node, order, postfixes) -> dict:
    out: dict[str, Any] = {}
    if set(node) == {"amax_history", "scale"} and not any(
        isinstance(v, Mapping) for v in node.values()
    ):
        hist = jnp.asarray(node["amax_history"], jnp.float32)
        scale = jnp.asarray(node["scale"], jnp.float32)
        where = path or "<root>"
        if hist.ndim < 2 or scale.shape != hist.shape[:-1] or hist.shape[-2] % 3:
            raise ValueError(
                f"{op}: {where!r}: amax_history {hist.shape} and scale {scale.shape} are not "
                "an Fp8Meta of GEMM triples ([..., 3 G, L] and [..., 3 G])"
            )
        gemms = hist.shape[-2] // 3
        names = (
            list(postfixes)
            if postfixes is not None
            else ([""] if gemms == 1 else [f"_{g}" for g in range(gemms)])
        )
        if len(names) != gemms:
            raise ValueError(
                f"{op}: {where!r} has {gemms} GEMMs but postfixes={names!r} names {len(names)}"
            )
        if order == "te":
            hist = hist[..., ::-1].at[..., 0].set(0.0)
        for g, postfix in enumerate(names):
            for i, p in enumerate(TE_PREFIXES):
                row = 3 * g + i
                out[f"{p}{postfix}_amax_history"] = hist[..., row, :]
                out[f"{p}{postfix}_scale"] = scale[..., row : row + 1]
        return out
    for key, value in node.items():
        if isinstance(value, Mapping):
            out[key] = _to_te(op, f"{path}/{key}" if path else str(key), value, order, postfixes)
        else:
            out[key] = value
    return out
