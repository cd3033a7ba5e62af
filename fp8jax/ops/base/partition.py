"""How the fp8jax custom calls are split over a device mesh (shared by every op module).

XLA cannot see inside an FFI custom call, so without help it gathers every sharded operand onto
every device before the call. Each op therefore wraps its ``jax.ffi.ffi_call`` twice:

* :func:`partitioned` makes a :class:`jax.experimental.custom_partitioning` function from the
  op's kernel call, a Shardy ``sharding_rule`` string (used when
  ``jax.config.jax_use_shardy_partitioner`` is on, the default) and a ``plan`` that decides,
  from the operands' shardings, the shardings the kernel runs with and which mesh axes an
  output must be max-reduced over. Each device then runs the kernel on its own block; an amax
  is made global with one ``pmax`` over exactly the mesh axes that split the tensor.
* :func:`batchable_call` puts a :func:`jax.custom_batching.custom_vmap` around it, because a
  ``custom_partitioning`` function has no vmap rule of its own. Under ``vmap`` it does what
  ``vmap_method="broadcast_all"`` does for the bare ``ffi_call`` (unbatched operands are
  broadcast, the kernel takes the batch as leading group dimensions) and calls the partitioned
  op again with one more leading batch dimension, which the sharding rule treats as a
  dimension shared by every operand and output. So ``vmap`` of a sharded call and sharding of
  a vmapped call both work, at any nesting depth.

On one device (or when the computation is not partitioned at all, e.g. inside a fully manual
``shard_map`` body) ``custom_partitioning`` inlines the kernel call unchanged, so results are
bit-identical to a plain ``ffi_call``. Inside ``shard_map`` each device sees only its own block,
so an amax computed there is the *local* amax; reducing it is the caller's business. In a
``shard_map`` that is manual over only some mesh axes the bare kernel runs (XLA cannot apply a
custom partitioning there), replicated over the automatic axes. Each op module wraps its public
entry in :func:`jax.jit`, so an eager call on sharded arrays is partitioned too.

Choices common to every op: a dimension that its mesh axes do not divide evenly is run unsplit
(XLA would pad the blocks, and padding must not reach an amax); scales and amaxes are
replicated (except along vmapped batch dims, which they share with the tensor); under explicit
sharding (``AxisType.Explicit``) the outputs' types carry the shardings above (:func:`result`).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import Mesh, NamedSharding, PartitionSpec

__all__ = []  # internal to fp8jax.ops: none of its names is public API

DimAxes = tuple[tuple[str, ...], ...]
"""Per array dimension, the mesh axes that split it (``()``: not split)."""

Plan = tuple[Sequence[NamedSharding], Sequence[NamedSharding], Callable[..., tuple[jax.Array, ...]]]
"""What a ``plan`` returns: the operand shardings the kernel runs with, the output shardings,
and the per-device function of the local blocks (the kernel, then e.g. :func:`reduce_outputs`)."""


def entry_axes(entry: Any) -> tuple[str, ...]:
    """The mesh axes of one ``PartitionSpec`` entry (``None``, a name or a tuple of names)."""
    if entry is None:
        return ()
    if isinstance(entry, (tuple, list)):
        return tuple(entry)
    return (entry,)


def dim_axes(sharding: NamedSharding, shape: Sequence[int]) -> DimAxes:
    """The mesh axes that split each dimension of an array of ``shape`` with ``sharding``.

    A dimension that the axes do not divide evenly is reported as not split: XLA would pad its
    blocks, and padding must not reach a kernel that computes an amax.
    """
    spec = tuple(sharding.spec)
    spec = spec + (None,) * (len(shape) - len(spec))
    sizes = sharding.mesh.shape
    out = []
    for n, entry in zip(shape, spec, strict=True):
        axes = entry_axes(entry)
        out.append(axes if n % math.prod(sizes[a] for a in axes) == 0 else ())
    return tuple(out)


def spec(dims: DimAxes) -> PartitionSpec:
    """The :class:`~jax.sharding.PartitionSpec` that splits dimension ``i`` over ``dims[i]``."""
    return PartitionSpec(*(None if not a else a[0] if len(a) == 1 else tuple(a) for a in dims))


def named(mesh: Mesh, dims: DimAxes) -> NamedSharding:
    """A :class:`~jax.sharding.NamedSharding` that splits dimension ``i`` over ``dims[i]``."""
    return NamedSharding(mesh, spec(dims))


def batch_only(dims: DimAxes, n_batch: int, ndim: int) -> DimAxes:
    """Dims for an ``ndim``-rank operand that shares only the ``n_batch`` leading (vmap) dims
    of the operand with ``dims``, and is replicated in the rest (a per-tensor scale, say)."""
    return dims[:n_batch] + ((),) * (ndim - n_batch)


def splitting_axes(mesh: Mesh, dims: DimAxes) -> tuple[str, ...]:
    """The mesh axes (of size > 1) that split any of ``dims``: a reduction over the whole array
    needs exactly these. Axes that are unused, or only replicate the array, are left out."""
    return tuple(a for d in dims for a in d if mesh.shape[a] > 1)


def whole_blocks(mesh: Mesh, axes: Sequence[str], size: int, block: int) -> bool:
    """Whether a dim of ``size`` split over mesh ``axes`` leaves every device whole ``block``-sized
    blocks of it: an unsplit dim always does (a ragged last block stays on its one device), a
    split one when it divides evenly into parts that are multiples of ``block``."""
    shards = math.prod(mesh.shape[a] for a in axes)
    return shards == 1 or (size % shards == 0 and (size // shards) % block == 0)


def amax_axes(mesh: Mesh, dims: DimAxes, reduction: str) -> tuple[str, ...]:
    """The mesh axes an amax of a tensor split as ``dims`` is max-reduced over.

    ``"split"``: exactly the axes that split the tensor (the fewest devices). ``"mesh"``: every
    mesh axis (of size > 1) as soon as any splits the tensor; a max over devices that hold
    copies of the same block changes nothing, and since every amax of a program then uses the
    same device group, XLA's all-reduce combiner can merge all of them into one all-reduce.
    A replicated tensor's amax is not reduced in either mode.
    """
    split = splitting_axes(mesh, dims)
    if reduction == "split" or not split:
        return split
    return tuple(a for a in mesh.axis_names if mesh.shape[a] > 1)


def pmax_over(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    """``jax.lax.pmax`` over ``axes`` (one all-reduce); ``x`` unchanged when there are none."""
    return jax.lax.pmax(x, axes) if axes else x


def reduce_outputs(
    kernel: Callable[..., tuple[jax.Array, ...]],
    pmax: Sequence[tuple[str, ...]],
    psum: Sequence[tuple[str, ...]],
) -> Callable[..., tuple[jax.Array, ...]]:
    """The per-device function: ``kernel`` on the local blocks, then output ``i`` max-reduced
    over ``pmax[i]`` (an amax made global) and sum-reduced over ``psum[i]`` (a partial sum over
    the local rows made global); ``()``: left as it is."""

    def local(*args):
        outs = kernel(*args)
        outs = [pmax_over(o, a) for o, a in zip(outs, pmax, strict=True)]
        return tuple(jax.lax.psum(o, a) if a else o for o, a in zip(outs, psum, strict=True))

    return local


def factors(prefix: str, n: int) -> list[str]:
    """``n`` distinct Shardy factor names: ``prefix0 prefix1 ...``."""
    return [f"{prefix}{i}" for i in range(n)]


def result(
    shape: Sequence[int],
    dtype: Any,
    like: jax.Array,
    *,
    transpose: bool = False,
    dims: Sequence[int] | None = None,
) -> jax.ShapeDtypeStruct:
    """The ``ffi_call`` result type for an output laid out like operand ``like``.

    Under explicit sharding (``jax.sharding.AxisType.Explicit``, where shardings are part of
    the type) the result carries ``like``'s sharding, its last two dims swapped when
    ``transpose``; otherwise no sharding (the partitioning rule decides). ``dims``, when
    given, names for each trailing output dim the (negative) dim of ``like`` whose sharding it
    takes; the output's leading dims before them take ``like``'s leading dims in order.
    """
    sharding = jax.typeof(like).sharding
    axis_types = getattr(getattr(sharding, "mesh", None), "axis_types", ())
    if not any(t == jax.sharding.AxisType.Explicit for t in axis_types):
        return jax.ShapeDtypeStruct(shape, dtype)
    spec = (*sharding.spec, *(None,) * (like.ndim - len(sharding.spec)))
    if dims is not None:
        n_lead = len(shape) - len(dims)
        spec = (*spec[:n_lead], *(spec[d] for d in dims))
        sharding = NamedSharding(sharding.mesh, PartitionSpec(*spec))
    elif transpose:
        sharding = NamedSharding(sharding.mesh, PartitionSpec(*spec[:-2], spec[-1], spec[-2]))
    return jax.ShapeDtypeStruct(shape, dtype, sharding=sharding)


def decode(mesh: Mesh, sharding: Any, shape: Sequence[int]) -> NamedSharding | None:
    """``sharding`` (any :class:`jax.sharding.Sharding`, e.g. the partitioner's HLO sharding) of
    an array of ``shape`` as a :class:`NamedSharding` over ``mesh``, from where each device's
    block starts; ``None`` when a dim is split other than along whole mesh axes (Shardy splits a
    mesh axis into sub-axes where a dim holds fewer parts than the axis has devices).

    The partitioner hands the custom partitioning callbacks its shardings undecoded
    (``decode_shardings=False``): JAX's own decoding raises an internal ``IndivisibleError`` on a
    sub-axis sharding of any operand or result, before fp8jax could name the problem."""
    if isinstance(sharding, NamedSharding) and sharding.mesh.shape == mesh.shape:
        return sharding
    shape = tuple(int(n) for n in shape)
    try:
        starts = sharding.devices_indices_map(shape)
        part = sharding.shard_shape(shape)
    except (ValueError, TypeError, AttributeError):  # another device set or rank
        return None
    grid = mesh.devices
    if set(grid.flat) != set(starts):
        return None
    coords = np.indices(grid.shape)  # coords[i]: each device's position along mesh axis i
    entries = []
    for d, n in enumerate(shape):
        if part[d] in (0, n):
            entries.append(())
            continue
        index = np.vectorize(lambda dev, d=d: (starts[dev][d].start or 0) // part[d])(grid)
        used = [i for i in range(grid.ndim) if np.any(np.diff(index, axis=i))]
        for order in itertools.permutations(used):
            expect = np.zeros(grid.shape, np.int64)
            for i in order:  # the first axis is the major one
                expect = expect * grid.shape[i] + coords[i]
            if np.array_equal(expect, index):
                entries.append(tuple(mesh.axis_names[i] for i in order))
                break
        else:
            return None
    return NamedSharding(mesh, spec(tuple(entries)))


def _replicated_plan(
    kernel: Callable[..., Any], mesh: Mesh, arg_shapes: Sequence[Any], n_out: int
) -> tuple[Mesh, Plan]:
    """Fallback when the operands carry no named mesh: run the whole op on every device."""
    if mesh.empty:
        devices = sorted(arg_shapes[0].sharding.device_set, key=lambda d: d.id)
        mesh = Mesh(np.array(devices), ("fp8jax_replicated",))
    rep = NamedSharding(mesh, PartitionSpec())
    return mesh, ([rep] * len(arg_shapes), [rep] * n_out, kernel)


def partitioned(
    kernel: Callable[..., tuple[jax.Array, ...]],
    plan: Callable[[Mesh, Sequence[Any]], Plan],
    rule: str | Callable[[Mesh], tuple[str, dict[str, int]]],
    *,
    need_replication: tuple[str, ...] = (),
    factor_sizes: dict[str, int] | None = None,
) -> Callable[..., tuple[jax.Array, ...]]:
    """Wraps ``kernel`` (arrays in, tuple of arrays out) in ``custom_partitioning``.

    ``plan(mesh, arg_shapes)`` sees the operands (``ShapeDtypeStruct`` with a ``NamedSharding``)
    and returns a :data:`Plan`; the partitioner reshards the operands to the plan's operand
    shardings and each device runs the plan's function on its blocks (traced with the mesh
    axes bound, so it may use collectives over them). ``rule`` is the Shardy sharding rule that
    propagation uses; it must agree with the plan (same factor for a dimension that keeps its
    sharding); ``need_replication`` names its factors that must not be split;
    ``factor_sizes`` gives the sizes of factors used only inside compound factors. ``rule`` may
    instead be a function of the mesh (the lowering's; its device count when it has none) that
    returns the rule and its factor sizes.
    """
    op = custom_partitioning(kernel)

    def resolve(mesh: Mesh, arg_shapes: Sequence[Any], n_out: int) -> tuple[Mesh, Plan]:
        # Plans read only the first operand's sharding (GSPMD may not know the others yet).
        if mesh.empty:
            return _replicated_plan(kernel, mesh, arg_shapes, n_out)
        decoded = [decode(mesh, a.sharding, a.shape) for a in arg_shapes]
        if decoded[0] is None:
            return _replicated_plan(kernel, mesh, arg_shapes, n_out)
        args = [a if d is None else jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=d)
                for a, d in zip(arg_shapes, decoded, strict=True)]  # fmt: skip
        return mesh, plan(mesh, args)

    def partition(mesh, arg_shapes, result_shape):
        mesh, (arg_shardings, out_shardings, local) = resolve(mesh, arg_shapes, len(result_shape))
        return mesh, _per_device(local), tuple(out_shardings), tuple(arg_shardings)

    def infer_sharding_from_operands(mesh, arg_shapes, result_shape):  # the GSPMD partitioner
        return tuple(resolve(mesh, arg_shapes, len(result_shape))[1][1])

    if callable(rule):

        def mesh_rule(*args):  # (*static_args, mesh, value_types, result_types)
            mesh = args[-3]
            text, sizes = rule(mesh)
            return text, {"need_replication_factors": need_replication, **sizes}

        op.def_partition(
            partition,
            infer_sharding_from_operands=infer_sharding_from_operands,
            decode_shardings=False,
            sharding_rule=mesh_rule,
        )
    else:
        op.def_partition(
            partition,
            infer_sharding_from_operands=infer_sharding_from_operands,
            decode_shardings=False,
            sharding_rule=rule,
            need_replication_factors=need_replication,
            **(factor_sizes or {}),
        )

    def call(*args):
        # In a shard_map body that leaves some mesh axes automatic, XLA's partitioner cannot
        # take custom partitioning rules (it mixes up the manual axes; it even aborts), so the
        # bare kernel runs there: correct, replicated over the automatic axes.
        return kernel(*args) if _partly_manual() else op(*args)

    return call


def explicit_mesh() -> bool:
    """Whether we trace under a mesh with explicit axes (``AxisType.Explicit``, the default of
    ``jax.make_mesh``), where an array's sharding is part of its type."""
    types = getattr(jax.sharding.get_abstract_mesh(), "axis_types", ())
    return any(t == jax.sharding.AxisType.Explicit for t in types)


def explicit_matmul_spec(a: jax.Array, b: jax.Array, *, b_rows_are_n: bool) -> PartitionSpec:
    """The spec of ``a [M, K] . b`` under explicit sharding, as the GEMM's rule gives it: M keeps
    ``a``'s rows' axes, N takes ``b``'s N axes not already used by M. ``b`` is ``[N, K]`` when
    ``b_rows_are_n``, else ``[K, N]`` (e.g. for the plain ``jnp.dot`` of a disabled layer)."""

    def axes(x, dim):
        spec = (*jax.typeof(x).sharding.spec, None, None)
        return entry_axes(spec[dim])

    m = axes(a, 0)
    n = tuple(x for x in axes(b, 0 if b_rows_are_n else 1) if x not in m)
    return spec((m, n))


def _per_device(local: Callable[..., Any]) -> Callable[..., Any]:
    """``local``, traced as the per-device body it is: under explicit sharding
    (``AxisType.Explicit``) JAX >= 0.12 traces a partition body with the explicit mesh still
    current, so the reducer of a ``pmax`` gets a sharding annotation that XLA rejects
    ("Unsupported reduction computation"). The body is traced with the mesh axes manual, as in
    a ``shard_map``; otherwise it is traced as it is."""

    def body(*args):
        if not explicit_mesh():
            return local(*args)
        mesh = jax.sharding.get_abstract_mesh()
        manual = {a: jax.sharding.AxisType.Manual for a in mesh.axis_names}
        with jax.sharding.use_abstract_mesh(mesh.update_axis_types(manual)):
            return local(*args)

    return body


def varying_axes(x: Any) -> frozenset[str]:
    """The manual mesh axes ``x`` varies over inside a ``shard_map`` (empty outside one):
    ``typeof(x).vma`` up to JAX 0.11, ``typeof(x).manual_axis_type.varying`` since."""
    t = jax.typeof(x)
    if hasattr(t, "manual_axis_type") and t.manual_axis_type is not None:
        return frozenset(t.manual_axis_type.varying)
    return frozenset(getattr(t, "vma", ()) or ())


def varying(x: jax.Array, axes: Sequence[str]) -> jax.Array:
    """``x`` marked as varying over the manual mesh ``axes`` it does not vary over yet (inside
    a ``shard_map``: JAX tracks which axes a value varies over, and a branch of
    ``lax.platform_dependent`` or a ``custom_vjp`` cotangent must have its peers' type)."""
    have = varying_axes(x)
    missing = tuple(a for a in axes if a not in have)
    if not missing:
        return x
    if hasattr(jax.lax, "pcast"):
        return jax.lax.pcast(x, missing, to="varying")
    return jax.lax.pvary(x, missing)  # JAX < 0.11


def vary_like(out: jax.Array, *args: jax.Array) -> jax.Array:
    """``out`` (an FFI call's result, which carries no varying axes) marked as varying over
    every manual mesh axis any of ``args`` varies over, as XLA's own ops' results are."""
    axes: list[str] = []
    for x in args:
        for a in sorted(varying_axes(x)):
            if a not in axes:
                axes.append(a)
    return varying(out, axes) if axes else out


def _partly_manual() -> bool:
    """Whether we trace inside a ``shard_map`` that is manual over some mesh axes but not all."""
    types = getattr(jax.sharding.get_abstract_mesh(), "axis_types", ())
    manual = [t == jax.sharding.AxisType.Manual for t in types]
    return any(manual) and not all(manual)


def batchable_call(
    make_op: Callable[[int], Callable[..., tuple[jax.Array, ...]]],
    *args: jax.Array,
    n_batch: int = 0,
) -> tuple[jax.Array, ...]:
    """Calls ``make_op(n_batch)(*args)`` so that :func:`jax.vmap` adds a leading batch dim.

    ``make_op(k)`` returns the op for operands with ``k`` leading batch dimensions (shared by
    every operand and output, each batch element its own tensor). Under ``vmap`` every operand
    gets the batch dimension in front (unbatched ones broadcast, as ``broadcast_all`` does) and
    ``make_op(k + 1)`` runs; every output is batched.
    """

    @jax.custom_batching.custom_vmap
    def call(*xs):
        return tuple(make_op(n_batch)(*xs))

    @call.def_vmap
    def rule(axis_size, in_batched, *xs):
        xs = [
            x if b else jnp.broadcast_to(x, (axis_size, *x.shape))
            for x, b in zip(xs, in_batched, strict=True)
        ]
        out = batchable_call(make_op, *xs, n_batch=n_batch + 1)
        return out, tuple(True for _ in out)

    return call(*args)


def _groups(src: Sequence[int], dst: Sequence[int]) -> list[tuple[list[int], list[int]]]:
    """The contiguous groups of dims of a reshape from ``src`` to ``dst``: each a pair of dim
    lists with equal products (size-1 dims join the group before them, or the first)."""
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(src) or j < len(dst):
        a: list[int] = []
        b: list[int] = []
        pa = pb = 1
        while True:
            if i < len(src) and (not a or pa < pb or (pa == pb and src[i] == 1 and not b)):
                a.append(i)
                pa *= src[i]
                i += 1
            elif j < len(dst) and (not b or pb < pa):
                b.append(j)
                pb *= dst[j]
                j += 1
            else:
                break
        while i < len(src) and src[i] == 1:  # trailing size-1 dims join this group
            a.append(i)
            i += 1
        while j < len(dst) and dst[j] == 1:
            b.append(j)
            j += 1
        groups.append((a, b))
    return groups


def reshape(x: jax.Array, shape: Sequence[int]) -> jax.Array:
    """``x.reshape(shape)``, under explicit sharding (``AxisType.Explicit``) with the result's
    sharding stated. A merge of dims keeps the axes of its first dim larger than 1, and a split
    gives a dim's axes to its first part larger than 1 where they divide it; an axis that
    cannot follow (the later dims of a merge, e.g. the heads of a ``(hidden, 3, heads)`` fused
    QKV kernel merged into ``3 * heads``) is gathered first, as XLA's partitioner does on an
    automatic-axis mesh, where JAX itself would refuse the reshape ("This reshape is not
    supported")."""
    shape = tuple(int(n) for n in shape)
    if not explicit_mesh() or tuple(x.shape) == shape:
        return x.reshape(shape)
    mesh = jax.sharding.get_abstract_mesh()
    have = [entry_axes(e) for e in (*jax.typeof(x).sharding.spec, *(None,) * x.ndim)[: x.ndim]]
    keep = list(have)
    out: list[tuple[str, ...]] = [()] * len(shape)
    for src, dst in _groups(x.shape, shape):
        big = [d for d in src if x.shape[d] > 1]
        axes = have[big[0]] if big else ()
        for d in src:
            if d not in big[:1]:
                keep[d] = ()  # a merge's later dims (or size-1 ones) cannot stay split
        target = next((d for d in dst if shape[d] > 1), None)
        size = math.prod(mesh.shape[a] for a in axes)
        if target is None or shape[target] % size:
            if big:
                keep[big[0]] = ()
            continue
        out[target] = axes
    if keep != have:
        x = jax.sharding.reshard(x, spec(keep))
    return jax.lax.reshape(x, shape, out_sharding=spec(out))


def dot_last(a: jax.Array, b: jax.Array, **kwargs: Any) -> jax.Array:
    """``a``'s last dim contracted with ``b``'s first (``lax.dot_general``, as a plain-Flax
    dense layer computes it); under explicit sharding with the output's sharding stated as the
    FP8 GEMM's rule gives it (``a``'s other dims keep their axes, ``b``'s features take theirs
    not already used), where JAX cannot pick one itself because the contracted dim is split
    (a row-parallel layer)."""
    dims = (((a.ndim - 1,), (0,)), ((), ()))
    if explicit_mesh():
        spec_a = [entry_axes(e) for e in (*jax.typeof(a).sharding.spec, *(None,) * a.ndim)]
        spec_b = [entry_axes(e) for e in (*jax.typeof(b).sharding.spec, *(None,) * b.ndim)]
        rows = spec_a[: a.ndim - 1]
        used = {x for r in rows for x in r}
        cols = [tuple(x for x in c if x not in used) for c in spec_b[1 : b.ndim]]
        kwargs["out_sharding"] = spec((*rows, *cols))
    return jax.lax.dot_general(a, b, dims, **kwargs)
