"""``grouped_gemm``: the ragged grouped FP8 GEMM of a mixture of experts, with
:func:`jax.lax.ragged_dot` semantics, beside its XLA reference.

Rows of the activations are sorted by group (expert); ``group_sizes [G]`` (int32, on the
device, summing to at most the rows) says how many belong to each; rows past the sum belong to
no group. Two forms, both in the FP8 GEMM's "NT" layout (both operands contiguous along the
contraction, as :func:`~fp8jax.ops.gemm` takes them):

- ``ragged="rows"`` (the forward GEMM, and the dgrad): ``a [M, K]``, ``b [G, N, K]`` ->
  ``out [M, N]``, row ``r`` of group ``g`` being ``a[r] . b[g]^T``; rows past the sum are 0.
  This is ``ragged_dot(a, swapaxes(b, 1, 2), group_sizes)``: the forward GEMM takes the
  kernel's transposed copy ``w_t [G, N, K]``, the dgrad the kernel ``w [G, K, N]`` itself
  (``dx = dy . w^T``, contracting N).
- ``ragged="contracting"`` (the wgrad): ``a [K, M]``, ``b [N, M]`` -> ``out [G, K, N]``,
  ``out[g] = a[:, cols_g] . b[:, cols_g]^T``, contracting each group's own columns (the
  transposed copies of the input and of the output gradient); an empty group's is 0.

Scales, applied as the FP8 GEMM applies them:

- per group (DelayedScaling, Float8CurrentScaling): ``a_scale_inv`` and ``b_scale_inv`` are
  float32 ``[G]`` (one inverse scale per group; ``()``/``(1,)``: one for all); each group's
  float32 accumulator is multiplied by ``a_scale_inv[g] * b_scale_inv[g]`` and rounded once to
  ``out_dtype``;
- block scaling (``a_block``, ``b_block`` given; Float8BlockScaling's ``(1, 128)`` and
  ``(128, 128)``, MXFP8's ``(1, 32)``): every element is dequantized with its block's scale and
  the products are summed in float32. ``"rows"``: ``a``'s blocks are one row high (a taller
  one would straddle two groups' rows) with the grid ``[M, ceil(K / bk)]``; ``b``'s are per
  group, grid ``[G, ceil(N / br), ceil(K / bk)]``. ``"contracting"``: both operands have ``(1,
  w)`` blocks along the ragged dim that restart at each group's first column (segment blocks,
  :mod:`fp8jax.ops.block.grouped_scaling`), grids ``[K, nb]`` and ``[N, nb]`` with ``nb =
  segment_grid_size(M, G, w)``, so no block mixes two experts' tokens.

The reference (:func:`grouped_gemm_reference`, the definition and the ``"xla"``
implementation) is :func:`jax.lax.ragged_dot_general` of the dequantized float32 operands
(``precision=HIGHEST``), then the per-group scales. On CPU, XLA lowers ``ragged_dot`` to a
masked dense dot over all groups (``G`` times the FLOPs).

The kernel path (``"kernel"``, the default) runs fp8jax's own kernels, one FFI target
``fp8jax_grouped_gemm`` on CPU and CUDA (cpp/ops/gemms.h; their shared numerics
cpp/common/grouped_gemm.h): each output is the float32 sum of the dequantized products in a fixed
order (the contraction index ascending, each product rounded before its add, never fused), then
the per-group scales, so the CPU kernel and the CUDA kernel give the same bits. Neither is a
masked dense product: each group's rows (``"rows"``) or columns (``"contracting"``) are its own
tiles, and the group offsets are read from ``group_sizes`` where the kernel runs (on a GPU on the
device: one launch, no host synchronisation, CUDA-graph compatible), clamped as the reference
clamps them. The CUDA kernel is a correctness path: shared-memory tiles, exact float32 sums on the
CUDA cores, no tensor cores (a cuBLASLt grouped path needs a grouped matmul with device-side
sizes, which cuBLAS 13.1 lacks). It replaces XLA's GPU ``ragged_dot`` at HIGHEST precision, which
it should not be slower than by construction; that is unmeasured on a GPU. Kernel and reference
sum in different orders: they give the same bits where the sums are exact, and agree within
float32 rounding elsewhere.

Sharding (the kernel path): ``"rows"`` keeps ``a``'s row split (each device computes its rows
with the sizes of the groups within them, from the global ``group_sizes`` and its position on
the mesh, so no collective) and ``b``'s N split (whole blocks); ``"contracting"`` keeps
``a``'s K and ``b``'s N splits; the group dim and the contraction are gathered. Under ``vmap``
both paths run one call per batch element (:func:`jax.lax.map`; JAX has no batched
``ragged_dot``).

Not differentiable itself: :func:`fp8jax.grouped_dense` defines the gradients.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from fp8jax import _ffi
from fp8jax.ops.base import checks, partition, switch
from fp8jax.ops.block.block_scaling import block_dequantize, check_block
from fp8jax.ops.block.grouped_scaling import (
    check_group_sizes,
    check_sum,
    clamped,
    group_ids,
    local_group_sizes,
    segment_block_dequantize,
    segment_grid_size,
)
from fp8jax.ops.gemms import _grouped_tensor_cores as tensor_core
from fp8jax.ops.gemms._grouped_tensor_cores import per_group

__all__ = ["grouped_gemm", "grouped_gemm_reference"]

#: Where each group's wgrad columns start in the padded layout the tensor-core path reads
#: (``grouped_gemm(padded=...)`` under per-group scales): a multiple of 16 FP8 codes, the
#: 16-byte alignment its TMA loads need. Callers that build that layout ask for it here.
TENSOR_CORE_PAD: int = tensor_core.SM90_PAD

#: The two forms of :func:`grouped_gemm` (see the module docstring).
RAGGED_FORMS = ("rows", "contracting")
ACCUMULATE_MODES = ("fast", "split")

_FAMILY = switch.register_family("gemm", "grouped_gemm")
_E5M2 = jnp.dtype(jnp.float8_e5m2)
_ROWS = lax.RaggedDotDimensionNumbers((((1,), (2,)), ((), ())), [0], [0])
_CONTRACTING = lax.RaggedDotDimensionNumbers((((1,), (1,)), ((), ())), [1], [])


def _check_scale(op: str, name: str, s: Any, groups: int) -> jax.Array:
    s = checks.array_arg(op, name, s)
    if s.dtype != jnp.float32 or s.shape not in ((), (1,), (groups,)):
        raise ValueError(
            f"{op}: {name} must be float32 of shape (), (1,) or [G] = ({groups},) (one inverse "
            f"scale per group), got {s.dtype}{list(s.shape)}"
        )
    return s


def _check_grid(op: str, name: str, s: Any, want: tuple[int, ...], block: tuple[int, int]):
    s = checks.array_arg(op, name, s)
    allowed = (jnp.dtype(jnp.float32), jnp.dtype(jnp.float8_e8m0fnu))
    if tuple(s.shape) != want or s.dtype not in allowed:
        raise ValueError(
            f"{op}: {name} must be the scale grid of {block[0]} x {block[1]} blocks, float32 or "
            f"float8_e8m0fnu of shape {list(want)}, got {s.dtype}{list(s.shape)}"
        )
    return s


def _validate(
    op, a, b, group_sizes, a_scale_inv, b_scale_inv, ragged, a_block, b_block, out_dtype, accumulate
):
    """Every argument check (TypeError/ValueError naming the argument); returns the checked
    values and the static config."""
    if not isinstance(ragged, str) or ragged not in RAGGED_FORMS:
        raise ValueError(f"{op}: ragged must be 'rows' or 'contracting', got {ragged!r}")
    a = checks.fp8_array(op, "a", a)
    b = checks.fp8_array(op, "b", b)
    if a.dtype == _E5M2 and b.dtype == _E5M2:
        raise TypeError(f"{op}: a and b cannot both be float8_e5m2 (no E5M2 x E5M2 GEMM)")
    rows = ragged == "rows"
    if rows and (a.ndim != 2 or b.ndim != 3 or a.shape[1] != b.shape[2]):
        raise ValueError(
            f"{op}: ragged='rows' takes a [M, K] and b [G, N, K] with the same K, got a "
            f"{a.shape} and b {b.shape}"
        )
    if not rows and (a.ndim != 2 or b.ndim != 2 or a.shape[1] != b.shape[1]):
        raise ValueError(
            f"{op}: ragged='contracting' takes a [K, M] and b [N, M] with the same M, got a "
            f"{a.shape} and b {b.shape}"
        )
    group_sizes = check_group_sizes(op, group_sizes, b.shape[0] if rows else None)
    groups = group_sizes.shape[0]
    m = a.shape[0] if rows else a.shape[1]
    check_sum(op, group_sizes, m, "rows of a" if rows else "columns of a and b")
    if (a_block is None) != (b_block is None):
        raise ValueError(f"{op}: give both a_block and b_block (block scaling) or neither")
    if a_block is None:
        a_scale_inv = _check_scale(op, "a_scale_inv", a_scale_inv, groups)
        b_scale_inv = _check_scale(op, "b_scale_inv", b_scale_inv, groups)
    else:
        a_block, b_block = check_block(op, a_block), check_block(op, b_block)
        if a_block[0] != 1:
            raise ValueError(
                f"{op}: a_block must be one row high (a taller block would straddle two "
                f"groups), got {a_block}"
            )
        if rows:
            if a_block[1] != b_block[1]:
                raise ValueError(f"{op}: a_block {a_block} and b_block {b_block} must tile K alike")
            kb = -(-a.shape[1] // a_block[1])
            a_scale_inv = _check_grid(op, "a_scale_inv", a_scale_inv, (m, kb), a_block)
            want = (groups, -(-b.shape[1] // b_block[0]), kb)
            b_scale_inv = _check_grid(op, "b_scale_inv", b_scale_inv, want, b_block)
        else:
            if b_block != a_block:
                raise ValueError(
                    f"{op}: ragged='contracting' takes the same (1, w) segment blocks for a and "
                    f"b, got a_block {a_block} and b_block {b_block}"
                )
            nb = segment_grid_size(m, groups, a_block[1])
            a_scale_inv = _check_grid(op, "a_scale_inv", a_scale_inv, (a.shape[0], nb), a_block)
            b_scale_inv = _check_grid(op, "b_scale_inv", b_scale_inv, (b.shape[0], nb), b_block)
    out_dt = checks.wide_dtype_arg(op, "out_dtype", out_dtype)
    if not isinstance(accumulate, str) or accumulate not in ACCUMULATE_MODES:
        raise ValueError(f"{op}: accumulate must be 'fast' or 'split', got {accumulate!r}")
    return a, b, group_sizes, a_scale_inv, b_scale_inv, (ragged, a_block, b_block, out_dt)


def _reference(a, b, group_sizes, a_scale_inv, b_scale_inv, *, ragged, a_block, b_block, out_dtype):
    """The definition (see the module docstring), on checked arguments."""
    groups = group_sizes.shape[0]
    m = a.shape[0] if ragged == "rows" else a.shape[1]
    sizes = clamped(group_sizes, m)
    if a_block is None:
        a_f, b_f = a.astype(jnp.float32), b.astype(jnp.float32)
    elif ragged == "rows":
        a_f = block_dequantize(a, a_scale_inv, a_block)
        b_f = jax.vmap(lambda q, s: block_dequantize(q, s, b_block))(b, b_scale_inv)
    else:
        a_f = segment_block_dequantize(a, a_scale_inv, sizes, a_block)
        b_f = segment_block_dequantize(b, b_scale_inv, sizes, b_block)
    dims = _ROWS if ragged == "rows" else _CONTRACTING
    acc = lax.ragged_dot_general(
        a_f, b_f, sizes, dims, precision=lax.Precision.HIGHEST, preferred_element_type=jnp.float32
    )
    if a_block is None:
        s = per_group(a_scale_inv, groups) * per_group(b_scale_inv, groups)
        if ragged == "rows":
            row = jnp.take(s, group_ids(sizes, m), mode="fill", fill_value=0.0)
            acc = acc * row[:, None]
        else:
            acc = acc * s[:, None, None]
    return acc.astype(out_dtype)


def grouped_gemm_reference(
    a: jax.Array,
    b: jax.Array,
    group_sizes: jax.Array,
    a_scale_inv: jax.Array,
    b_scale_inv: jax.Array,
    *,
    ragged: str = "rows",
    a_block: tuple[int, int] | None = None,
    b_block: tuple[int, int] | None = None,
    out_dtype: Any = jnp.bfloat16,
    accumulate: str = "fast",
) -> jax.Array:
    """Pure-XLA reference of :func:`grouped_gemm` (the definition of its numerics:
    ``ragged_dot_general`` of the dequantized float32 operands, then the per-group scales;
    ``accumulate`` is validated and otherwise ignored). Sizes whose running sum passes the rows
    are clamped to them (the kernels clamp them alike)."""
    a, b, gs, sa, sb, (ragged, ab, bb, out_dt) = _validate(
        "grouped_gemm_reference",
        a,
        b,
        group_sizes,
        a_scale_inv,
        b_scale_inv,
        ragged,
        a_block,
        b_block,
        out_dtype,
        accumulate,
    )
    return _reference(a, b, gs, sa, sb, ragged=ragged, a_block=ab, b_block=bb, out_dtype=out_dt)


@functools.partial(jax.jit, static_argnames=("ragged", "a_block", "b_block", "out_dtype"))
def _xla(a, b, group_sizes, a_scale_inv, b_scale_inv, *, ragged, a_block, b_block, out_dtype):
    return _reference(
        a,
        b,
        group_sizes,
        a_scale_inv,
        b_scale_inv,
        ragged=ragged,
        a_block=a_block,
        b_block=b_block,
        out_dtype=out_dtype,
    )


# ------------------------------------------------------------------ the kernel path


def ffi_operands(config, a, b, group_sizes, a_scale_inv, b_scale_inv):
    """The ``fp8jax_grouped_gemm`` call's operands and attributes: per-group scales as float32
    ``[G]``, scale grids as given (float32 or E8M0); attributes ``ragged`` (0 rows, 1
    contracting) and the two blocks (``0 x 0``: per-group scales)."""
    ragged, a_block, b_block, _ = config
    groups = group_sizes.shape[0]
    if a_block is None:
        a_scale_inv, b_scale_inv = per_group(a_scale_inv, groups), per_group(b_scale_inv, groups)
    ab, bb = a_block or (0, 0), b_block or (0, 0)
    attrs = dict(
        ragged=np.int64(ragged == "contracting"),
        a_block_rows=np.int64(ab[0]),
        a_block_cols=np.int64(ab[1]),
        b_block_rows=np.int64(bb[0]),
        b_block_cols=np.int64(bb[1]),
    )
    return (a, b, group_sizes, a_scale_inv, b_scale_inv), attrs


def out_shape(config, a, b, group_sizes) -> tuple[int, ...]:
    if config[0] == "rows":
        return (a.shape[0], b.shape[1])
    return (group_sizes.shape[0], a.shape[0], b.shape[0])


def _kernel_call(config, like, a, b, group_sizes, a_scale_inv, b_scale_inv):
    """The kernel: fp8jax's grouped GEMM handler of the platform (the CPU's, or CUDA's: one
    launch, the group sizes read on the device); its result typed as varying like the
    reference's, ``like`` (in a ``shard_map``)."""
    operands, attrs = ffi_operands(config, a, b, group_sizes, a_scale_inv, b_scale_inv)
    result = jax.ShapeDtypeStruct(out_shape(config, a, b, group_sizes), config[3])
    out = jax.ffi.ffi_call("fp8jax_grouped_gemm", result)(*operands, **attrs)
    return partition.vary_like(out, *like)


@functools.cache
def has_cuda_kernel() -> bool:
    """Whether this install's CUDA extension registers ``fp8jax_grouped_gemm`` (every CUDA build
    does; False without the CUDA extension)."""
    cuda = _ffi.cuda_extension()
    return cuda is not None and "fp8jax_grouped_gemm" in cuda.registrations()


def _local(config, tc, a, b, group_sizes, a_scale_inv, b_scale_inv):
    """The op on one device's blocks (``group_sizes``: the groups within its rows): fp8jax's
    kernel on CPU and CUDA (the same FFI target, each platform's handler), the reference
    elsewhere; nothing to run for an empty operand. ``tc``: ``None``, or (fast accumulation,
    the operands' padding) for the tensor-core path on CUDA."""
    ragged, a_block, b_block, out_dtype = config

    def reference(*args):
        return _reference(
            *args, ragged=ragged, a_block=a_block, b_block=b_block, out_dtype=out_dtype
        )

    args = (a, b, group_sizes, a_scale_inv, b_scale_inv)
    kernel = functools.partial(_kernel_call, config, args)
    if tc is not None and tc[1]:  # padded operands: the other paths gather them back first
        width = tc[1]
        unpad = lambda fn: (
            lambda a, b, gs, sa, sb: fn(
                tensor_core.unpadded(a, gs, width),
                tensor_core.unpadded(b, gs, width),
                clamped(gs, a.shape[1]),
                sa,
                sb,
            )
        )
        kernel, reference = unpad(kernel), unpad(reference)
    if 0 in a.shape or 0 in b.shape:
        return reference(*args)
    cuda = kernel if tc is None else functools.partial(tensor_core.call, config, *tc, args)
    return lax.platform_dependent(*args, cpu=kernel, cuda=cuda, default=reference)


def _dims(x) -> tuple[tuple[str, ...], ...]:
    if isinstance(x.sharding, jax.sharding.NamedSharding):
        return partition.dim_axes(x.sharding, x.shape)
    return ((),) * x.ndim


def _whole(mesh, axes, size, block) -> tuple[str, ...]:
    return axes if partition.whole_blocks(mesh, axes, size, block) else ()


def _plan_splits(mesh, config, a, b):
    """``(split of a's dim 0, split of b's N dim)`` the kernel runs with."""
    ragged, _, b_block, _ = config
    rows = ragged == "rows"
    first = _dims(a)[0]
    n_dim = 1 if rows else 0
    n = tuple(x for x in _dims(b)[n_dim] if x not in first)
    n = _whole(mesh, n, b.shape[n_dim], b_block[0] if (b_block and rows) else 1)
    n = n if b.shape[n_dim] % max(1, int(np.prod([mesh.shape[x] for x in n]))) == 0 else ()
    return first, n


@functools.cache
def _partitioned(config, a_scale_ndim, b_scale_ndim, tc):
    ragged, a_block, _, _ = config
    rows = ragged == "rows"
    blocks = a_block is not None

    def kernel(m_axes, a, b, group_sizes, sa, sb):
        if rows and m_axes:  # this device's rows: the groups' sizes within them
            start = lax.axis_index(m_axes) * a.shape[0]
            group_sizes = local_group_sizes(group_sizes, start, a.shape[0])
        return (_local(config, tc, a, b, group_sizes, sa, sb),)

    def plan(mesh, args):
        a, b = args[0], args[1]
        first, n = _plan_splits(mesh, config, a, b)
        rep = lambda nd: partition.named(mesh, ((),) * nd)
        if rows:
            ins = [partition.named(mesh, (first, ())), partition.named(mesh, ((), n, ())), rep(1)]
            sa = partition.named(mesh, (first, ())) if blocks else rep(a_scale_ndim)
            sb = partition.named(mesh, ((), n, ())) if blocks else rep(b_scale_ndim)
            out = partition.named(mesh, (first, n))
        else:
            ins = [partition.named(mesh, (first, ())), partition.named(mesh, (n, ())), rep(1)]
            sa = partition.named(mesh, (first, ())) if blocks else rep(a_scale_ndim)
            sb = partition.named(mesh, (n, ())) if blocks else rep(b_scale_ndim)
            out = partition.named(mesh, ((), first, n))
        m_axes = partition.splitting_axes(mesh, (first,)) if rows else ()
        return [*ins, sa, sb], [out], functools.partial(kernel, m_axes)

    if rows:
        sa = "m sa1" if blocks else "sa" * a_scale_ndim
        sb = "g nb kb" if blocks else "sb" * b_scale_ndim
        rule = f"m k, g n k, g, {sa}, {sb} -> m n"
        need = ("k", "g")
    else:
        sa = "k sa1" if blocks else "sa" * a_scale_ndim
        sb = "n sb1" if blocks else "sb" * b_scale_ndim
        rule = f"k m, n m, g, {sa}, {sb} -> g k n"
        need = ("m", "g")
    op = partition.partitioned(functools.partial(kernel, ()), plan, rule, need_replication=need)
    return lambda *args: op(*args)[0]


def _explicit_spec(config, a, b):
    """Under explicit sharding, the result's spec as the plan gives it."""

    def axes(x, dim):
        spec = (*jax.typeof(x).sharding.spec, None, None, None)
        return partition.entry_axes(spec[dim])

    rows = config[0] == "rows"
    first = axes(a, 0)
    n = tuple(x for x in axes(b, 1 if rows else 0) if x not in first)
    return partition.spec((first, n) if rows else ((), first, n))


def _one_call_per_element(fn):
    """``fn`` whose vmap is one call per batch element (:func:`jax.lax.map`): a batched
    ``ragged_dot`` is not implemented by JAX, and each element has its own group sizes."""
    call = jax.custom_batching.custom_vmap(fn)

    @call.def_vmap
    def rule(axis_size, in_batched, *args):
        del axis_size
        batched = tuple(x for x, bt in zip(args, in_batched, strict=True) if bt)

        def one(xs):
            it = iter(xs)
            return call(*(next(it) if bt else x for x, bt in zip(args, in_batched, strict=True)))

        return lax.map(one, batched), True

    return call


@functools.cache
def _batchable(config, a_scale_ndim, b_scale_ndim, tc):
    def call(a, b, group_sizes, sa, sb):
        op = _partitioned(config, a_scale_ndim, b_scale_ndim, tc)
        if not partition.explicit_mesh():
            return op(a, b, group_sizes, sa, sb)
        spec = _explicit_spec(config, a, b)
        return jax.sharding.auto_axes(op, out_sharding=spec)(a, b, group_sizes, sa, sb)

    return _one_call_per_element(call)


@functools.cache
def _xla_batchable(config):
    ragged, a_block, b_block, out_dtype = config
    xla = functools.partial(
        _xla, ragged=ragged, a_block=a_block, b_block=b_block, out_dtype=out_dtype
    )
    return _one_call_per_element(xla)


def grouped_gemm(
    a: jax.Array,
    b: jax.Array,
    group_sizes: jax.Array,
    a_scale_inv: jax.Array,
    b_scale_inv: jax.Array,
    *,
    ragged: str = "rows",
    a_block: tuple[int, int] | None = None,
    b_block: tuple[int, int] | None = None,
    out_dtype: Any = jnp.bfloat16,
    accumulate: str = "fast",
    padded: int = 0,
    implementation: str | None = None,
) -> jax.Array:
    """The ragged grouped FP8 GEMM (see the module docstring for the forms and scales).

    Args:
      a, b: FP8 operands (``float8_e4m3fn`` or ``float8_e5m2``, not both E5M2): ``a [M, K]``,
        ``b [G, N, K]`` for ``ragged="rows"``; ``a [K, M]``, ``b [N, M]`` for
        ``"contracting"``.
      group_sizes: int32 ``[G]``, the rows (``"rows"``) or contracted columns
        (``"contracting"``) of each group, in order; they must sum to at most ``M`` (a
        ValueError when the values are known while tracing; otherwise the running sum is
        clamped to ``M``, and a negative size read as 0, by the kernels as by the reference).
      a_scale_inv, b_scale_inv: float32 ``[G]`` (or one value) without blocks; the scale grids
        with ``a_block``/``b_block``.
      ragged: ``"rows"`` or ``"contracting"``.
      a_block, b_block: the blocks of a block-scaled pair (both or neither).
      out_dtype: bfloat16 (default), float16 or float32.
      accumulate: ``"fast"`` (forward) or ``"split"`` (dgrad, wgrad): as for
        :func:`~fp8jax.ops.gemm`.
      padded: ``"contracting"`` only: ``a``'s and ``b``'s columns are in the padded layout of
        this width (:func:`~fp8jax.ops.transpose_padded`'s, or
        :func:`~fp8jax.ops.segment_block_quantize`'s with ``padded=True``: group ``g``'s
        ``group_sizes[g]`` columns start at a multiple of ``padded``, the columns between are
        ignored), ``M`` its padded width, a multiple of ``padded``; under block scales
        ``padded`` is the blocks' width and the grids are ``[K, M / padded]`` and ``[N, M /
        padded]``. The tensor-core path reads the operands as they are; every other path
        gathers the columns back first. ``0`` (default): not padded.
      implementation: ``"kernel"`` or ``"xla"`` (:func:`grouped_gemm_reference`, jitted);
        default: the enclosing :func:`fp8jax.ops.implementation` choice for ``"gemm"``.

    Returns:
      ``[M, N]`` (``"rows"``) or ``[G, K, N]`` (``"contracting"``) of ``out_dtype``.

    >>> import jax.numpy as jnp, fp8jax
    >>> a = jnp.ones((3, 4), jnp.float8_e4m3fn)
    >>> b = jnp.stack([jnp.full((2, 4), 1.0), jnp.full((2, 4), 2.0)]).astype(jnp.float8_e4m3fn)
    >>> sizes = jnp.array([1, 1], jnp.int32)  # row 0: group 0, row 1: group 1, row 2: none
    >>> one = jnp.ones((2,), jnp.float32)
    >>> fp8jax.ops.grouped_gemm(a, b, sizes, one, one, out_dtype=jnp.float32).tolist()
    [[4.0, 4.0], [8.0, 8.0], [0.0, 0.0]]
    """
    a_scale_inv, b_scale_inv = tensor_core.padded_grids(
        a, b, group_sizes, a_scale_inv, b_scale_inv, padded, ragged, a_block
    )
    a, b, gs, sa, sb, config = _validate(
        "grouped_gemm",
        a,
        b,
        group_sizes,
        a_scale_inv,
        b_scale_inv,
        ragged,
        a_block,
        b_block,
        out_dtype,
        accumulate,
    )
    padded = _check_padded("grouped_gemm", padded, config, a)
    xla = switch.choose("grouped_gemm", _FAMILY, implementation) == "xla"
    tc = not xla and tensor_core.tensor_cores(config, a, b, sa, accumulate)
    if padded and not tc:  # the other paths read the columns gathered back
        a, b, gs = (tensor_core.unpadded(a, gs, padded), tensor_core.unpadded(b, gs, padded),
                    clamped(gs, a.shape[1]))  # fmt: skip
        padded = 0
    if xla:
        return _xla_batchable(config)(a, b, gs, sa, sb)
    _ffi.ensure_registered()
    tc_key = (accumulate == "fast" and config[1] is None, padded) if tc else None
    return _batchable(config, jnp.ndim(sa), jnp.ndim(sb), tc_key)(a, b, gs, sa, sb)


def _check_padded(op: str, padded: Any, config, a) -> int:
    if not isinstance(padded, (int, np.integer)) or isinstance(padded, bool) or padded < 0:
        raise ValueError(f"{op}: padded must be an int >= 0, got {padded!r}")
    if not padded:
        return 0
    ragged, a_block, _, _ = config
    if ragged != "contracting":
        raise ValueError(f"{op}: padded applies to ragged='contracting' only")
    want = tensor_core.SM90_PAD if a_block is None else a_block[1]  # checked by padded_grids
    if padded % want or a.shape[1] % padded:
        raise ValueError(
            f"{op}: padded must be a multiple of {want} that divides a's and b's columns "
            f"({a.shape[1]}), got {padded}"
        )
    return int(padded)
