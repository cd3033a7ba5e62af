"""Flax Linen modules for FP8 dense layers: ``DenseGeneral``, ``Fp8DotGeneral``, ``Fp8Einsum``.

All three compute with :func:`fp8jax.dense` and follow the enclosing
:func:`fp8jax.autocast`: outside it, or with FP8 disabled, they are plain high-precision layers
and need no FP8 variables. With :class:`~fp8jax.recipe.DelayedScaling` they keep their state in
the ``"fp8_meta"`` collection and one probe per call in ``"fp8_probe"`` (see
:mod:`fp8jax.flax._variables`), both created by ``init`` inside ``autocast(enabled=True)``; with
:class:`~fp8jax.recipe.Float8CurrentScaling` they need neither.

>>> import jax, jax.numpy as jnp, fp8jax
>>> from fp8jax.flax import DenseGeneral
>>> layer = DenseGeneral(features=4)
>>> with fp8jax.autocast(enabled=True, recipe=fp8jax.DelayedScaling(amax_history_len=8)):
...     variables = layer.init(jax.random.key(0), jnp.ones((2, 3)))
>>> jax.tree.map(jnp.shape, variables)  # doctest: +NORMALIZE_WHITESPACE
{'fp8_meta': {'amax_history': (3, 8), 'scale': (3,)}, 'fp8_probe': {'call_0': (3,)},
 'params': {'bias': (4,), 'kernel': (3, 4)}}
"""

from __future__ import annotations

import string
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np

from fp8jax.flax._params import declare
from fp8jax.flax._variables import Fp8Call, fp8_call
from fp8jax.functional.dense import dense_observed
from fp8jax.layers.checks import check_float_array, normalize_axes
from fp8jax.layers.dense import DenseGeneralConfig

__all__ = ["DEFAULT_RULES", "DenseGeneral", "Fp8DotGeneral", "Fp8Einsum"]

#: Logical axis names fp8jax's examples use, mapped onto a ``("data", "model")`` mesh for data
#: plus Megatron tensor parallelism; pass to :func:`flax.linen.logical_axis_rules`. ``batch``:
#: examples; ``length``: sequence; ``embed``: model width; ``mlp``: MLP hidden width; ``heads``:
#: attention heads; ``kv``: per-head width; ``act``: the gated pair of an MLP kernel;
#: ``relpos_buckets``: relative position buckets; ``exp``: a mixture of experts' expert dim
#: (replicated: expert parallelism is ``MoEBlock(expert_axis=...)``'s own). For FSDP, map
#: ``embed`` to ``"data"`` as well. Every name fp8jax's layers use has a rule
#: (``tests/test_sharding.py`` checks), so NNX's eager sharding maps all of them too.
DEFAULT_RULES: tuple[tuple[str, str | None], ...] = (
    ("batch", "data"),
    ("length", None),
    ("embed", None),
    ("mlp", "model"),
    ("heads", "model"),
    ("kv", None),
    ("act", None),
    ("relpos_buckets", None),
    ("exp", None),
)


class DenseGeneral(DenseGeneralConfig, nn.Module):
    """FP8 drop-in for :class:`flax.linen.DenseGeneral` (same arguments, params and shapes).

    The params are ``kernel`` (contracted input dims + features) and ``bias`` (features), drawn
    exactly as Flax draws them, so a checkpoint of ``nn.DenseGeneral`` loads unchanged and the same
    ``init`` key gives the same params.

    Inside ``fp8jax.autocast(enabled=True, recipe=...)`` the layer runs as one FP8 GEMM forward and
    two backward (:func:`fp8jax.dense`); otherwise it is a plain high-precision dense.

    Attributes:
      features: int or tuple of output features.
      axis: input axes to contract (int or tuple; default the last).
      batch_dims: only ``()``: FP8 GEMMs here have no batch dims (ValueError otherwise).
      use_bias: whether to add a bias.
      dtype: computation and output dtype; default: promoted from inputs and params.
      param_dtype: dtype of the params.
      kernel_init: initializer of the kernel, called with the flat ``(prod(contracted),
        prod(features))`` shape as in Flax.
      bias_init: initializer of the bias.
      precision: only ``None`` (FP8 has no precision knob; ValueError otherwise).
      kernel_axes: logical axis names of the kernel (one per kernel dim: contracted dims, then
        features), e.g. ``("embed", "mlp")``; ``()`` (default) adds no annotation. When given, the
        kernel is created with :func:`flax.linen.with_logical_partitioning`, so
        ``nn.get_partition_spec`` and :func:`flax.linen.logical_axis_rules` map it onto a mesh.
      bias_axes: logical axis names of the bias (one per feature dim); ``()``: none.
      output_axes: logical axis names of the output (one per output dim), applied with
        :func:`flax.linen.with_logical_constraint`; ``()``: no constraint.
      input_axes: logical axis names of the input (one per input dim), a constraint as
        ``output_axes`` (TE's argument); ``()`` or ``None``: none.
      transpose_batch_sequence: TE's argument; no effect (the layer acts on ``axis`` only).
      enable_low_rank_adaptation, low_rank_adaptation_dim, low_rank_adaptation_alpha,
        quantization_checkpoint_name: TE's arguments, accepted at TE's defaults (LoRA off,
        no name); anything else is a ValueError (docs/porting-from-te.md).

    The FP8 state (``fp8_meta``, ``fp8_probe``) is never annotated: it is a few floats per
    layer and stays replicated, so every device holds (and computes) the same scales.
    """

    @nn.compact
    def __call__(self, inputs: jax.Array) -> jax.Array:
        """Contracts ``inputs``' ``axis`` dims with the kernel; returns the rest + features."""
        _, inputs = self.check(inputs)
        axes = normalize_axes("DenseGeneral", "axis", self.axis, inputs.ndim)
        contract = tuple(inputs.shape[a] for a in axes)
        params = declare(self, "DenseGeneral", self.param_specs(contract))
        fp8 = fp8_call(self)
        return self.forward(inputs, params, fp8, fp8.where)


def _fp8_dense(
    fp8: Fp8Call, x: jax.Array, kernel: jax.Array, bias: Any, axes: Any, dtype: Any
) -> jax.Array:
    """:func:`fp8jax.dense` as this call of a module runs it (its switch, recipe, state and
    probe); under calibration the forward observations are stored in the call's probe."""
    result = dense_observed(
        x, kernel, bias, fp8.meta, fp8.recipe,
        probe=fp8.probe, axis=axes, dtype=dtype, enabled=fp8.enabled, where=fp8.where,
    )  # fmt: skip
    if fp8.record is not None and result.observed is not None:
        fp8.record(result.observed)
    return result.out


def _dim_numbers(dimension_numbers: Any) -> tuple[tuple[int, ...], ...]:
    try:
        (lc, rc), (lb, rb) = dimension_numbers
        return tuple(lc), tuple(rc), tuple(lb), tuple(rb)
    except (TypeError, ValueError):
        raise ValueError(
            "Fp8DotGeneral: dimension_numbers must be ((lhs_contract, rhs_contract), "
            f"(lhs_batch, rhs_batch)), got {dimension_numbers!r}"
        ) from None


class Fp8DotGeneral(nn.Module):
    """FP8 ``lax.dot_general`` for injection: ``nn.Dense(..., dot_general_cls=Fp8DotGeneral)``.

    Works wherever a Flax layer takes ``dot_general_cls`` (``nn.Dense``, ``nn.DenseGeneral``
    without ``batch_dims``): the layer instantiates it on every call and calls it as
    ``dot_general(lhs, rhs, dimension_numbers, precision=..., preferred_element_type=...)``, with
    ``rhs`` the weight. The contraction may not have batch dims (ValueError); the rhs contracted
    dims are moved to the front for :func:`fp8jax.dense`. The FP8 state and probes live in
    the ``fp8_meta``/``fp8_probe`` collections of this submodule (e.g.
    ``Dense_0/Fp8DotGeneral_0``). With FP8 off it is exactly ``lax.dot_general``.
    """

    @nn.compact
    def __call__(
        self,
        lhs: jax.Array,
        rhs: jax.Array,
        dimension_numbers: Any,
        precision: Any = None,
        preferred_element_type: Any = None,
    ) -> jax.Array:
        """``lax.dot_general(lhs, rhs, dimension_numbers)`` with FP8 operands when enabled."""
        owner = "Fp8DotGeneral"
        lhs = check_float_array(owner, "lhs", lhs)
        rhs = check_float_array(owner, "rhs", rhs)
        lc, rc, lb, rb = _dim_numbers(dimension_numbers)
        if lb or rb:
            raise ValueError(
                f"{owner}: batch dims are not supported (got lhs_batch={lb}, rhs_batch={rb}); "
                "fold them into the non-contracted dims of lhs"
            )
        if len(lc) != len(rc) or not lc:
            raise ValueError(
                f"{owner}: lhs and rhs must contract the same number (>= 1) of dims, got "
                f"{lc} and {rc}"
            )
        lc_n = tuple(_normalize_one(owner, "lhs_contract", a, lhs.ndim) for a in lc)
        rc_n = tuple(_normalize_one(owner, "rhs_contract", a, rhs.ndim) for a in rc)
        for a, b in zip(lc_n, rc_n, strict=True):
            if lhs.shape[a] != rhs.shape[b]:
                raise ValueError(
                    f"{owner}: contracted dims differ: lhs {lhs.shape} dim {a} vs rhs "
                    f"{rhs.shape} dim {b}"
                )
        fp8 = fp8_call(self)
        if not fp8.enabled:
            return jax.lax.dot_general(
                lhs,
                rhs,
                dimension_numbers,
                precision=precision,
                preferred_element_type=preferred_element_type,
            )
        if precision is not None:
            raise ValueError(
                f"{owner}: precision must be None with FP8 enabled (an FP8 GEMM has no "
                f"precision setting), got {precision!r}"
            )
        free = tuple(d for d in range(rhs.ndim) if d not in rc_n)
        perm = rc_n + free
        kernel = rhs if perm == tuple(range(rhs.ndim)) else jnp.transpose(rhs, perm)
        dtype = preferred_element_type or jnp.result_type(lhs, rhs)
        return _fp8_dense(fp8, lhs, kernel, None, lc_n, dtype)


def _normalize_one(owner: str, name: str, axis: Any, ndim: int) -> int:
    if not isinstance(axis, (int, np.integer)) or not -ndim <= axis < ndim:
        raise ValueError(f"{owner}: {name} axis {axis!r} is out of range for rank {ndim}")
    return int(axis) % ndim


class _Equation:
    """A parsed two-operand einsum ``x,w->out`` that one dense layer can compute."""

    def __init__(self, equation: Any, x_ndim: int, w_ndim: int) -> None:
        owner = "Fp8Einsum"
        if not isinstance(equation, str):
            raise TypeError(f"{owner}: equation must be a str, got {equation!r}")
        eq = equation.replace(" ", "")
        lhs, arrow, out = eq.partition("->")
        operands = lhs.split(",")
        if len(operands) != 2:
            raise ValueError(
                f"{owner}: equation must have exactly two operands (x, w), got {equation!r}"
            )
        x_spec, w_spec = operands
        if "." in w_spec:
            raise ValueError(f"{owner}: the weight w may not have '...' in {equation!r}")
        letters = set(string.ascii_letters)
        used = set(x_spec + w_spec + out) & letters
        spare = iter(c for c in string.ascii_letters if c not in used)
        ell: list[str] = []
        if "..." in x_spec:
            n_ell = x_ndim - (len(x_spec) - 3)
            if n_ell < 0:
                raise ValueError(f"{owner}: x of rank {x_ndim} does not fit {x_spec!r}")
            ell = [next(spare) for _ in range(n_ell)]
            x_spec = x_spec.replace("...", "".join(ell), 1)
        if not arrow:  # implicit output: '...' first, then labels seen once, sorted
            once = sorted(c for c in set(x_spec + w_spec) if (x_spec + w_spec).count(c) == 1)
            out = "".join(ell) + "".join(c for c in once if c not in ell)
        elif "..." in out:
            out = out.replace("...", "".join(ell), 1)
        for name, spec, ndim in (("x", x_spec, x_ndim), ("w", w_spec, w_ndim)):
            if not set(spec) <= letters:
                raise ValueError(f"{owner}: bad labels for {name} in {equation!r}")
            if len(spec) != ndim:
                raise ValueError(
                    f"{owner}: {name} has rank {ndim} but {equation!r} gives it {len(spec)} labels"
                )
            if len(set(spec)) != len(spec):
                raise ValueError(f"{owner}: a label repeats within {name} in {equation!r}")
        if not set(out) <= letters or len(set(out)) != len(out):
            raise ValueError(f"{owner}: bad or repeated output labels in {equation!r}")
        if set(out) - set(x_spec + w_spec):
            raise ValueError(f"{owner}: output labels not in any operand in {equation!r}")
        shared = set(x_spec) & set(w_spec)
        if shared & set(out):
            raise ValueError(
                f"{owner}: labels {sorted(shared & set(out))} are in x, w and the output "
                f"(batch dims of a weight) in {equation!r}; only contracted dims may be shared"
            )
        if not shared:
            raise ValueError(f"{owner}: {equation!r} contracts no dim of x with w")
        lost = (set(x_spec) | set(w_spec)) - shared - set(out)
        if lost:
            raise ValueError(
                f"{owner}: labels {sorted(lost)} of one operand are summed away in {equation!r}; "
                "every non-contracted dim must appear in the output"
            )
        self.x, self.w, self.out = x_spec, w_spec, out
        self.contracted = [c for c in w_spec if c in shared]  # in w's order
        self.w_free = [c for c in w_spec if c not in shared]


class Fp8Einsum(nn.Module):
    """FP8 two-operand einsum for models that contract weights with ``jnp.einsum``.

    ``Fp8Einsum()(equation, x, w)`` computes ``jnp.einsum(equation, x, w)`` with ``x`` the
    activation and ``w`` the weight, as one :func:`fp8jax.dense` between transposes and
    reshapes. Every dim that ``x`` and ``w`` share must be contracted (no batch dims of the
    weight), every other dim must appear in the output, ``...`` may stand for leading dims of
    ``x``. Other equations raise ValueError (whether FP8 is on or not). With FP8 off it is exactly
    ``jnp.einsum``. State and probes live in this module's ``fp8_meta``/``fp8_probe``.

    >>> import jax, jax.numpy as jnp
    >>> x, w = jnp.ones((2, 5, 8)), jnp.ones((8, 4, 16))
    >>> Fp8Einsum().apply({}, "btd,dnh->btnh", x, w).shape
    (2, 5, 4, 16)
    """

    @nn.compact
    def __call__(
        self,
        equation: str,
        x: jax.Array,
        w: jax.Array,
        precision: Any = None,
        preferred_element_type: Any = None,
    ) -> jax.Array:
        """``jnp.einsum(equation, x, w)`` with FP8 operands when enabled."""
        owner = "Fp8Einsum"
        x = check_float_array(owner, "x", x)
        w = check_float_array(owner, "w", w)
        eq = _Equation(equation, x.ndim, w.ndim)
        for c in eq.contracted:
            if x.shape[eq.x.index(c)] != w.shape[eq.w.index(c)]:
                raise ValueError(
                    f"{owner}: dim {c!r} is {x.shape[eq.x.index(c)]} in x {x.shape} but "
                    f"{w.shape[eq.w.index(c)]} in w {w.shape}"
                )
        fp8 = fp8_call(self)
        if not fp8.enabled:
            return jnp.einsum(
                equation, x, w, precision=precision, preferred_element_type=preferred_element_type
            )
        if precision is not None:
            raise ValueError(
                f"{owner}: precision must be None with FP8 enabled (an FP8 GEMM has no "
                f"precision setting), got {precision!r}"
            )
        perm = tuple(eq.w.index(c) for c in eq.contracted + eq.w_free)
        kernel = w if perm == tuple(range(w.ndim)) else jnp.transpose(w, perm)
        axes = tuple(eq.x.index(c) for c in eq.contracted)
        dtype = preferred_element_type or jnp.result_type(x, w)
        y = _fp8_dense(fp8, x, kernel, None, axes, dtype)
        y_labels = [c for c in eq.x if c not in eq.contracted] + eq.w_free
        out_perm = tuple(y_labels.index(c) for c in eq.out)
        return y if out_perm == tuple(range(y.ndim)) else jnp.transpose(y, out_perm)
