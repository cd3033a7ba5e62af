"""One definition per op: :class:`OpDef` turns a declaration into a callable op.

An fp8jax op is its ``jnp`` reference, one FFI custom call, and a statement of how the call is
split over a device mesh. An :class:`OpDef` holds exactly that, and does the rest for every op:

* builds the ``jax.ffi.ffi_call`` (result types under explicit sharding included);
* derives the Shardy rule and the partitioning plan from the op's *factors* (one name per
  operand and output dimension, as in a Shardy rule; the same name means the same split), wraps
  the call in ``custom_partitioning`` (:func:`fp8jax.ops.base.partition.partitioned`) and makes each
  ``max_over`` output (an amax) global with one ``pmax`` over the mesh axes that split the
  operand it is the max of;
* adds vmap (:func:`fp8jax.ops.base.partition.batchable_call`: a vmapped call gets one more
  leading batch dimension, shared by every operand and output, factors ``g0 g1 ...``);
* jits the whole under the op's name, the op's static parameters marked static;
* runs the kernel or, when the family's implementation is ``"xla"``
  (:mod:`fp8jax.ops.base.switch`), the jitted reference instead, which XLA fuses, batches
  and partitions itself.

Example, a complete op (``cast_transpose``; validation lives in the public function)::

    CAST_TRANSPOSE = OpDef(
        name="cast_transpose",
        family="cast",
        target="fp8jax_cast_transpose",            # the C++/CUDA handlers' name
        reference=cast_transpose_reference,        # (x, scale, *, fp8_dtype) -> outputs
        outputs=lambda x, scale, *, fp8_dtype: (
            like(x, fp8_dtype), like(x, fp8_dtype, transpose=True),
            like(scale, jnp.float32), like(scale, jnp.float32),
        ),
        factors=_factors,   # (x_ndim, scale_ndim) -> (operands, outputs), e.g. for a matrix
                            # and a (1,) scale: (["m n", "s"], ["m n", "n m", "s", "s"])
        max_over={3: 0},                           # output 3 is the max over operand 0
    )
    q, q_t, scale_inv, amax = CAST_TRANSPOSE(x, scale, fp8_dtype=dt, amax_reduction="split")

The plan reads the first operand's sharding: every factor keeps the mesh axes that split it
there (``()`` when it does not occur there or is in ``need_replication``), and every operand and
output is split accordingly. This covers every elementwise, transposing and row-wise op; an op
whose split is decided otherwise (the GEMM, see ``_gemm_partition``) writes its own plan.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp

from fp8jax import _ffi
from fp8jax.ops.base import partition, switch

__all__ = []  # internal to fp8jax.ops: none of its names is public API

Factors = str | Sequence[str]
"""One array's factors: a space-separated string (``"m n"``) or a sequence of names."""


def like(
    operand: jax.Array,
    dtype: Any,
    *,
    shape: Sequence[int] | None = None,
    transpose: bool = False,
    dims: Sequence[int] | None = None,
    core: int | None = None,
) -> jax.ShapeDtypeStruct:
    """The type of an output laid out like ``operand``: its shape (last two dims swapped when
    ``transpose``; or ``shape``) with ``dtype``; under explicit sharding it carries
    ``operand``'s sharding, swapped likewise (see :func:`fp8jax.ops.base.partition.result`).

    ``dims``: the output is made of some of ``operand``'s dims: its trailing dims are
    ``operand``'s dims ``dims`` (negative indices, e.g. ``(-3, -1)`` for ``[m, k, n] ->
    [m, n]``), its leading dims are ``operand``'s dims before its last ``core`` (default: the
    most negative of ``dims``), vmap's batch dims; shape and sharding follow. With ``shape``
    too, the output has that shape and ``dims`` give only its sharding (e.g. a grid of block
    scales, split like the dims it counts blocks of)."""
    if dims is not None and shape is None:
        n_lead = operand.ndim - (core if core is not None else max(-d for d in dims))
        shape = (*operand.shape[:n_lead], *(operand.shape[d] for d in dims))
    elif shape is None:
        shape = operand.shape
        if transpose:
            shape = (*shape[:-2], shape[-1], shape[-2])
    return partition.result(tuple(shape), dtype, operand, transpose=transpose, dims=dims)


def lead(ndim: int, prefix: str = "d") -> str:
    """Distinct factors ``d0 d1 ...`` for ``ndim`` dims (``""`` for none)."""
    return " ".join(partition.factors(prefix, ndim))


def _names(spec: Factors) -> tuple[str, ...]:
    return tuple(spec.split()) if isinstance(spec, str) else tuple(spec)


_OPS: dict[str, OpDef] = {}  # every OpDef constructed, by name (see registered_ops)


def registered_ops() -> dict[str, OpDef]:
    """Every op declared with :class:`OpDef`, by name (importing :mod:`fp8jax.ops` declares
    them all). The GEMM, which plans its own partitioning, is not an OpDef."""
    import fp8jax.ops  # noqa: F401  (declares every op)

    return dict(_OPS)


@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class OpDef:
    """The declaration of one op (see the module docstring).

    Attributes:
      name: the public name, used in error messages and as the jitted function's name.
      family: the implementation switch family (``"cast"``, ``"scaling"``, ...); registered
        with :mod:`fp8jax.ops.base.switch` on construction.
      target: the FFI target the C++ and CUDA handlers are registered under.
      reference: ``(*operands, **params) -> output or tuple of outputs`` in ``jnp``: the
        definition of the op's numerics and its ``"xla"`` implementation.
      outputs: ``(*operands, **params) -> tuple of jax.ShapeDtypeStruct``, usually built with
        :func:`like`; called with the per-device blocks when partitioned.
      factors: ``(*ndims) -> (operand factors, output factors)``, one :data:`Factors` per
        operand and output, given the operands' ranks (without vmap's batch dims). Factor names
        ``g0``, ``g1``, ... are reserved for those batch dims.
      attrs: ``(**params) -> dict`` of FFI attributes (e.g. ``np.int64`` values); none if
        ``None``.
      max_over: ``{output index: operand index}``: that output is a max over the whole operand
        (an amax), all-reduced with ``pmax`` over the mesh axes that split the operand (or the
        whole mesh, when called with ``amax_reduction="mesh"``).
      sum_over: ``{output index: operand index}``: that output is a sum of the operand over
        the operand's factors that the output does not have (e.g. a bias gradient ``"n"`` of a
        gradient ``"m n"``), all-reduced with ``psum`` over the mesh axes that split those
        factors (never over replicas, whatever ``amax_reduction`` says).
      need_replication: factors that are never split (their dims are gathered first).
      workspace: ``(*operands, **params) -> jax.ShapeDtypeStruct`` or ``None``: a scratch
        buffer the kernel needs (e.g. dbias's per-tile partial sums), made per call on each
        device from the local blocks, passed as one more operand and aliased to one more
        result, which is dropped. A buffer XLA allocates, rather than the handler at run time,
        keeps the CUDA handler command-buffer (CUDA graph) compatible.
      coarse: ``(**params) -> {factor: (base factor, block)}``: output factors that count
        ``block``-sized blocks of an operand factor (a grid of block scales): split like the
        base factor, and only where each device's part of the base dim is a multiple of
        ``block`` (else a ValueError: a block would straddle two devices).
      view, unview: run another op's handler on a free view of the operands (e.g. a ``[m, g,
        n]`` gradient as the ``[m, g * n]`` matrix a 2-D kernel reads): ``view(*operands,
        **params)`` gives the operands the handler sees (``outputs`` and ``workspace`` describe
        its results for them) and ``unview(operands, results, **params)`` the op's outputs.
        Applied to each device's block, after the split (the factors are the op's own), so a
        split that the reshape would merge away never needs a gather.
    """

    name: str
    family: str
    target: str
    reference: Callable[..., Any]
    outputs: Callable[..., Sequence[jax.ShapeDtypeStruct]]
    factors: Callable[..., tuple[Sequence[Factors], Sequence[Factors]]]
    attrs: Callable[..., Mapping[str, Any]] | None = None
    max_over: Mapping[int, int] = dataclasses.field(default_factory=dict)
    sum_over: Mapping[int, int] = dataclasses.field(default_factory=dict)
    need_replication: tuple[str, ...] = ()
    workspace: Callable[..., jax.ShapeDtypeStruct] | None = None
    coarse: Callable[..., Mapping[str, tuple[str, int]]] | None = None
    view: Callable[..., tuple[jax.Array, ...]] | None = None
    unview: Callable[..., tuple[jax.Array, ...]] | None = None

    def __post_init__(self) -> None:
        switch.register_family(self.family, self.name)
        _OPS[self.name] = self

        def run(params, reduction, impl, *operands):
            if impl == "xla":
                outs = self.reference(*operands, **dict(params))
                return tuple(outs) if isinstance(outs, (tuple, list)) else (outs,)
            make = functools.partial(_batched, self, params, reduction)
            return partition.batchable_call(make, *operands)

        run.__name__ = run.__qualname__ = self.name
        object.__setattr__(self, "_jitted", jax.jit(run, static_argnums=(0, 1, 2)))

    def rule(self, n_batch: int, *ndims: int) -> str:
        """The Shardy rule for operands of ranks ``ndims`` whose ``n_batch`` leading dims are
        vmap's, e.g. ``"d0 d1, s -> d0 d1, s, s"``."""
        ins, outs = self._specs(n_batch, ndims)
        return f"{', '.join(map(' '.join, ins))} -> {', '.join(map(' '.join, outs))}"

    def __call__(
        self,
        *operands: jax.Array,
        implementation: str | None = None,
        amax_reduction: str = "split",
        **params: Any,
    ) -> tuple[jax.Array, ...]:
        """Runs the op on validated ``operands`` with static ``params``; returns all outputs.

        ``implementation`` is the caller's ``implementation=`` argument (``None``: the
        enclosing :func:`fp8jax.ops.implementation` choice for this op's family).
        """
        impl = switch.choose(self.name, self.family, implementation)
        if impl == "kernel":
            _ffi.ensure_registered()
        else:
            amax_reduction = "split"  # XLA groups its own reductions; one cache entry
        key = tuple(sorted(params.items()))
        return self._jitted(key, amax_reduction, impl, *operands)  # type: ignore[attr-defined]

    def _specs(
        self, n_batch: int, ndims: Sequence[int]
    ) -> tuple[list[tuple[str, ...]], list[tuple[str, ...]]]:
        """Each operand's and output's factors, vmap's batch factors in front."""
        ins, outs = self.factors(*(n - n_batch for n in ndims))
        batch = tuple(partition.factors("g", n_batch))
        ins = [batch + _names(s) for s in ins]
        outs = [batch + _names(s) for s in outs]
        for i, (spec, n) in enumerate(zip(ins, ndims, strict=True)):
            if len(spec) != n:
                raise ValueError(
                    f"{self.name}: factors give operand {i} {len(spec)} dims, it has {n}"
                )
        return ins, outs


def _kernel(op: OpDef, params: tuple[tuple[str, Any], ...]) -> Callable[..., tuple[Any, ...]]:
    """The bare FFI call, arrays in, tuple of arrays out."""
    kw = dict(params)
    attrs = dict(op.attrs(**kw)) if op.attrs is not None else {}

    def kernel(*operands):
        args = tuple(op.view(*operands, **kw)) if op.view is not None else operands
        out = tuple(op.outputs(*args, **kw))
        if op.workspace is None:
            call = jax.ffi.ffi_call(op.target, out, vmap_method="broadcast_all")
            res = tuple(call(*args, **attrs))
        else:
            ws = op.workspace(*args, **kw)
            ws = jax.ShapeDtypeStruct(ws.shape, ws.dtype)
            call = jax.ffi.ffi_call(
                op.target,
                (*out, ws),
                vmap_method="broadcast_all",
                input_output_aliases={len(args): len(out)},
            )
            res = tuple(call(*args, jnp.zeros(ws.shape, ws.dtype), **attrs))[:-1]
        return tuple(op.unview(operands, res, **kw)) if op.unview is not None else res

    return kernel


@functools.cache
def _partitioned(
    op: OpDef,
    params: tuple[tuple[str, Any], ...],
    reduction: str,
    n_batch: int,
    shapes: tuple[tuple[int, ...], ...],
) -> Callable[..., tuple[Any, ...]]:
    """The kernel wrapped in ``custom_partitioning`` with the plan its factors imply. Cached, so
    a jit cache sees one partitioned function per configuration."""
    ins, outs = op._specs(n_batch, tuple(len(s) for s in shapes))
    batch = set(partition.factors("g", n_batch))
    kernel = _kernel(op, params)

    def plan(mesh, arg_shapes):
        first = arg_shapes[0]
        dims = partition.dim_axes(first.sharding, first.shape)
        axes = {f: a for f, a in zip(ins[0], dims, strict=True) if f not in op.need_replication}
        axes.update(_block_axes(op, params, ins[0], mesh, first.shape, axes))

        def split(spec):
            return partition.named(mesh, tuple(axes.get(f, ()) for f in spec))

        pmax = [()] * len(outs)
        for o, i in op.max_over.items():
            tensor = tuple(axes.get(f, ()) for f in ins[i] if f not in batch)
            pmax[o] = partition.amax_axes(mesh, tensor, reduction)
        psum = [()] * len(outs)
        for o, i in op.sum_over.items():
            summed = tuple(axes.get(f, ()) for f in ins[i] if f not in outs[o])
            psum[o] = partition.splitting_axes(mesh, summed)
        local = kernel
        if op.max_over or op.sum_over:
            local = partition.reduce_outputs(kernel, pmax, psum)
        return [split(s) for s in ins], [split(s) for s in outs], local

    if op.coarse is None:
        rule = op.rule(n_batch, *(len(s) for s in shapes))
        return partition.partitioned(kernel, plan, rule, need_replication=op.need_replication)
    coarse = op.coarse(**dict(params))

    def mesh_rule(mesh):
        devices = mesh.size if not mesh.empty else jax.device_count()
        return _coarse_rule(ins, outs, shapes[0], coarse, devices)

    return partition.partitioned(kernel, plan, mesh_rule, need_replication=op.need_replication)


def _coarse_rule(ins, outs, shape, coarse, devices: int):
    """The Shardy rule of an op with coarse factors, and its factor sizes, for a mesh of
    ``devices``: a coarse factor of block 1 is its base factor; one whose base dim holds a
    multiple of ``devices`` blocks splits the base into the compound ``(name name_in)`` wherever
    the base occurs, so that propagation splits the grid like the dim; others stay independent
    factors (a ragged dim or one block is never split; the plan splits the others' grids, and
    the partitioner reshards them to what propagation chose). A split finer than the block count
    would make Shardy cut a mesh axis into sub-axes for the grid, which JAX's custom partitioning
    cannot express: it failed with an internal KeyError; this way the plan's ValueError, naming
    the dim and the split, is what the user sees."""
    rename, compound, sizes = {}, {}, {}
    for name, (base, block) in coarse.items():
        if block == 1:
            rename[name] = base
            continue
        dim = shape[ins[0].index(base)]
        if dim % block or dim == block or (dim // block) % devices:
            continue  # ragged, one block (Shardy wants no size-1 part), or too few blocks
        if base in compound:  # a second coarse factor with the same base
            prev = compound[base]
            if sizes[f"{prev}_in"] == block:
                rename[name] = prev
            continue
        compound[base] = name
        sizes[f"{name}_in"] = block

    def spell(spec):
        out = []
        for f in spec:
            f = rename.get(f, f)
            out.append(f"({compound[f]} {compound[f]}_in)" if f in compound else f)
        return " ".join(out)

    return f"{', '.join(map(spell, ins))} -> {', '.join(map(spell, outs))}", sizes


def _block_axes(op: OpDef, params, factors, mesh, shape, axes) -> dict[str, tuple[str, ...]]:
    """The mesh axes of each coarse factor (a scale grid's dim), given ``axes`` of the first
    operand's factors ``factors`` (of ``shape``): its base dim's, where each device holds whole
    blocks of it; else the ValueError of :func:`_whole_blocks`."""
    out = {}
    for name, (base, size) in (op.coarse(**dict(params)) if op.coarse else {}).items():
        d = factors.index(base) - len(factors)
        out[name] = _whole_blocks(op, mesh, d, shape[d], axes.get(base, ()), size)
    return out


def _check_blocks_at_trace(op: OpDef, params, n_batch: int, operands: Sequence[jax.Array]):
    """Under explicit sharding (``AxisType.Explicit``) the first operand's sharding is part of
    its type, so a split that is not whole blocks is refused here, at trace time, with the
    ValueError the partitioner would raise (which reaches the user inside XLA's compile error,
    a ``JaxRuntimeError``)."""
    if op.coarse is None or not partition.explicit_mesh():
        return
    x = operands[0]
    sharding = jax.typeof(x).sharding
    if not isinstance(sharding, jax.sharding.NamedSharding):
        return
    factors = op._specs(n_batch, tuple(jnp.ndim(v) for v in operands))[0][0]
    dims = partition.dim_axes(sharding, x.shape)
    _block_axes(op, params, factors, sharding.mesh, x.shape, dict(zip(factors, dims, strict=True)))


def _whole_blocks(op: OpDef, mesh, d: int, size: int, axes: tuple[str, ...], block: int):
    """``axes``, the mesh axes splitting dim ``d`` (of ``size``) of the first operand, when each
    device's part holds whole ``block``-sized blocks; else a ValueError naming the op, the dim,
    the sizes and the fix."""
    if not partition.whole_blocks(mesh, axes, size, block):
        shards = math.prod(mesh.shape[a] for a in axes)
        raise ValueError(
            f"{op.name}: dim {d} of x (size {size}) is split {shards} ways (mesh axes {axes}), "
            f"so a device's part ({size // shards}) is not a multiple of the block ({block}) and "
            "a block would straddle two devices. Split it so each device holds a multiple of "
            f"{block} elements of it, or keep it whole (replicated) for this op."
        )
    return axes


def _batched(
    op: OpDef, params: tuple[tuple[str, Any], ...], reduction: str, n_batch: int
) -> Callable[..., tuple[Any, ...]]:
    """The op for operands with ``n_batch`` leading vmap dims (what ``batchable_call`` wants)."""

    def call(*operands):
        _check_blocks_at_trace(op, params, n_batch, operands)
        shapes = tuple(tuple(x.shape) for x in operands)
        return _partitioned(op, params, reduction, n_batch, shapes)(*operands)

    return call
