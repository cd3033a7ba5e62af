"""The grouped GEMM's tensor-core path on Hopper (``gemm_options(grouped_tensor_cores=True)``):
which calls take it, and the call of its CUDA target ``fp8jax_grouped_gemm_sm90`` (cpp/sm90/:
CUTLASS's grouped FP8 GEMMs, built only with CUTLASS's headers; docs/design.md). Everything else
about the op, its forms and its other paths, is :mod:`fp8jax.ops.gemms.grouped_gemm`'s.

The contracting form (the wgrad) reads each group's columns from a 16-byte aligned start, so its
operands come in a padded layout (each group's columns from a multiple of a width, zeros
between): laid out so by the caller (``grouped_gemm(padded=...)``: :func:`~fp8jax.ops.
transpose_padded`, or the segment-block cast's own layout), or padded here. Block scale grids go
to the kernel transposed, in the MN-major layout CUTLASS's blockwise kernels read.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fp8jax import _ffi
from fp8jax._support import capability
from fp8jax.ops.base import partition
from fp8jax.ops.block.grouped_scaling import clamped, segment_layout, segment_padded
from fp8jax.ops.gemms.gemm_options import get_gemm_options

__all__: list[str] = []  # internal: the public op is grouped_gemm


def per_group(s: jax.Array, groups: int) -> jax.Array:
    """Per-group inverse scales as float32 ``[G]`` (one value broadcast)."""
    return jnp.broadcast_to(jnp.reshape(s, (-1,)), (groups,)) if s.size == 1 else s


#: The instantiations of the tensor-core path (cpp/sm90/variants.h, which a test compares):
#: ``(a dtype, b dtype, out dtype, fast accumulation, block_n)``. ``block_n`` 0: per-group scales,
#: the layers' GEMMs under DelayedScaling and Float8CurrentScaling: the forward (fast), the dgrad
#: and the wgrad (split) of bfloat16 or float32 activations (float32: a bfloat16 input with
#: float32 params computes in float32) and float32 weights, HYBRID or E4M3. ``block_n`` 128 or 1:
#: Float8BlockScaling's float32 1 x 128 blocks of ``a`` with 128 x 128 blocks of ``b`` (the rows
#: form: forward, dgrad) or 1 x 128 segment blocks of both (the contracting form: wgrad), E4M3,
#: its default format; the blockwise kernel applies the scales at each 128-wide K block (no fast
#: accumulation).
SM90_VARIANTS = (
    ("float8_e4m3fn", "float8_e4m3fn", "bfloat16", True, 0),
    ("float8_e4m3fn", "float8_e4m3fn", "float32", True, 0),
    ("float8_e5m2", "float8_e4m3fn", "bfloat16", False, 0),
    ("float8_e5m2", "float8_e4m3fn", "float32", False, 0),
    ("float8_e4m3fn", "float8_e4m3fn", "bfloat16", False, 0),
    ("float8_e4m3fn", "float8_e5m2", "float32", False, 0),
    ("float8_e4m3fn", "float8_e4m3fn", "float32", False, 0),
    ("float8_e4m3fn", "float8_e4m3fn", "bfloat16", False, 128),
    ("float8_e4m3fn", "float8_e4m3fn", "float32", False, 128),
    ("float8_e4m3fn", "float8_e4m3fn", "float32", False, 1),
)
#: The contracting form's padding under per-group scales: each group's columns start at a
#: multiple of it (TMA reads from 16-byte aligned addresses), cpp/common/grouped_tc.h. Under
#: block scales the blocks' width (128), so that a group's segment blocks are the kernel's.
SM90_PAD = 16
SM90_BLOCK = 128
_SM90_TARGET = "fp8jax_grouped_gemm_sm90"


def sm90_workspace_bytes(groups: int) -> int:
    """The tensor-core path's workspace for ``groups`` groups, as ``grouped_tc::WorkspaceOf``
    lays it out (a test compares): its per-group arrays, each at a 128-byte boundary, then
    CUTLASS's own (at most 1 MiB)."""
    align = lambda n: -(-n // 128) * 128
    per_group = (3 * 4, 8, 8, 8, 4, 8, 32, 32, 32, 8, 8, 32, 32)
    return sum(align(groups * n) for n in per_group) + (1 << 20)


def sm90_runs_here() -> bool:
    """Whether a CUDA lowering may call the tensor-core target: JAX has no CUDA device (a
    lowering for an sm_90 build, as the structural tests make), or one is an sm_90 GPU and this
    install's CUDA extension registers the target (built with CUTLASS)."""
    if not _ffi.jax_has_cuda():
        return True
    cuda = _ffi.cuda_extension()
    if cuda is None or _SM90_TARGET not in cuda.registrations():
        return False
    return any(capability(d) == (9, 0) for d in jax.devices("cuda"))


def _block_n(config, a_scale_inv) -> int | None:
    """The variants' ``block_n`` of a call's scales, ``None`` where no variant takes them."""
    ragged, a_block, b_block, _ = config
    if a_block is None:
        return 0
    if jnp.dtype(a_scale_inv.dtype) != jnp.float32 or a_block != (1, SM90_BLOCK):
        return None
    want = (SM90_BLOCK, SM90_BLOCK) if ragged == "rows" else (1, SM90_BLOCK)
    return want[0] if b_block == want else None


def tensor_cores(config, a, b, a_scale_inv, accumulate: str) -> bool:
    """Whether this call runs on the tensor-core path: ``gemm_options(grouped_tensor_cores=
    True)``, dtypes and scales among :data:`SM90_VARIANTS`, ``N`` (and, in the rows form, ``K``)
    a multiple of 16, and a GPU where it runs (:func:`sm90_runs_here`)."""
    ragged, _, _, out_dtype = config
    block_n = _block_n(config, a_scale_inv)
    if not get_gemm_options().grouped_tensor_cores or block_n is None:
        return False
    key = (jnp.dtype(a.dtype).name, jnp.dtype(b.dtype).name, jnp.dtype(out_dtype).name,
           accumulate == "fast" and not block_n, block_n)  # fmt: skip
    if key not in SM90_VARIANTS:
        return False
    n = b.shape[1] if ragged == "rows" else b.shape[0]
    k = a.shape[1] if ragged == "rows" else 0
    return n % 16 == 0 and k % 16 == 0 and sm90_runs_here()


def grown_grid(s: jax.Array, groups: int) -> jax.Array:
    """A padded layout's segment grid ``[R, P / w]`` grown by the ``G - 1`` columns (of 1) that
    ``segment_grid_size(P, G, w)`` counts: the grid of the same blocks read as unpadded."""
    ones = jnp.ones((s.shape[0], groups - 1), s.dtype)
    return jnp.concatenate([s, ones], axis=1) if groups > 1 else s


def call(config, fast, padded, like, a, b, group_sizes, a_scale_inv, b_scale_inv):
    """The tensor-core path on this device's blocks: the contracting form's operands padded so
    each group's columns start at a multiple of :data:`SM90_PAD` (per-group scales) or of the
    blocks' width (the sizes clamped first, so they fit), unless they come so (``padded``); block
    scale grids transposed to the MN-major layout the kernel reads; the workspace an XLA
    result."""
    ragged, a_block, b_block, out_dtype = config
    groups = group_sizes.shape[0]
    blocks = a_block is not None
    width = SM90_BLOCK if blocks else SM90_PAD
    if ragged == "contracting" and not padded:
        group_sizes = clamped(group_sizes, a.shape[1])
        a = segment_padded(a, group_sizes, width)
        b = segment_padded(b, group_sizes, width)
        if blocks:  # the same blocks, in the padded layout
            a_scale_inv = grown_grid(a_scale_inv, groups)
            b_scale_inv = grown_grid(b_scale_inv, groups)
    if not blocks:
        sa, sb = per_group(a_scale_inv, groups), per_group(b_scale_inv, groups)
    elif ragged == "rows":
        sa, sb = a_scale_inv.T, jnp.swapaxes(b_scale_inv, 1, 2)
    else:
        sa, sb = a_scale_inv.T, b_scale_inv.T
    results = (
        jax.ShapeDtypeStruct(_out_shape(ragged, a, b, groups), out_dtype),
        jax.ShapeDtypeStruct((sm90_workspace_bytes(groups),), jnp.uint8),
    )
    ab, bb = a_block or (0, 0), b_block or (0, 0)
    out, _ = jax.ffi.ffi_call(_SM90_TARGET, results)(
        a, b, group_sizes, sa, sb,
        ragged=np.int64(ragged == "contracting"),
        a_block_rows=np.int64(ab[0]), a_block_cols=np.int64(ab[1]),
        b_block_rows=np.int64(bb[0]), b_block_cols=np.int64(bb[1]),
        pad_width=np.int64((padded or width) if ragged == "contracting" else 0),
        fast_accum=np.int64(fast),
    )  # fmt: skip
    return partition.vary_like(out, *like)


def _out_shape(ragged: str, a, b, groups: int) -> tuple[int, ...]:
    return (a.shape[0], b.shape[1]) if ragged == "rows" else (groups, a.shape[0], b.shape[0])


def padded_grids(a, b, group_sizes, a_scale_inv, b_scale_inv, padded, ragged, a_block):
    """Block scales of padded operands: their grids ``[K, P / w]`` and ``[N, P / w]`` (one scale
    per block of the padded layout) grown to the segment grids of ``P`` columns that the checks
    and the kernels read (the same blocks, :func:`_grown_grid`). Other calls: as given."""
    if not (isinstance(padded, (int, np.integer)) and not isinstance(padded, bool) and padded > 0
            and ragged == "contracting" and a_block is not None and jnp.ndim(a) == 2
            and jnp.ndim(b) == 2 and jnp.ndim(group_sizes) == 1):  # fmt: skip
        return a_scale_inv, b_scale_inv
    if isinstance(a_block, tuple) and len(a_block) == 2 and a_block[1] != padded:
        raise ValueError(
            f"grouped_gemm: padded block-scaled operands are padded to the blocks' width "
            f"{a_block[1]}, got padded={padded}"
        )
    groups, cols = jnp.shape(group_sizes)[0], jnp.shape(a)[1]
    grids = []
    for name, s, rows in (("a_scale_inv", a_scale_inv, jnp.shape(a)[0]),
                          ("b_scale_inv", b_scale_inv, jnp.shape(b)[0])):  # fmt: skip
        want = (rows, cols // padded)
        if tuple(jnp.shape(s)) != want:
            raise ValueError(
                f"grouped_gemm: with padded={padded}, {name} must be the padded layout's grid "
                f"{list(want)} (one scale per block of {padded} columns), got {list(jnp.shape(s))}"
            )
        grids.append(grown_grid(jnp.asarray(s), groups))
    return tuple(grids)


def unpadded(x: jax.Array, group_sizes: jax.Array, width: int) -> jax.Array:
    """``x [R, P]`` in the padded layout of ``width`` (:func:`~fp8jax.ops.transpose_padded`'s)
    with its groups' columns gathered back together: ``[R, P]``, zeros past the sum."""
    pos, _ = segment_layout(group_sizes, x.shape[1], width)
    bits = jax.lax.bitcast_convert_type(x, jnp.uint8)
    out = jnp.take(bits, pos, axis=1, mode="fill", fill_value=0)
    return jax.lax.bitcast_convert_type(out, x.dtype)
