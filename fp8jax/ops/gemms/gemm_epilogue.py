"""An MLP's FP8 GEMMs with cuBLASLt's GELU epilogues: the activation and its gradient leave the
GEMM already cast to FP8, one pass over them fewer each way. Private to fp8jax's layers
(:func:`fp8jax.layernorm_mlp` uses them under :func:`~fp8jax.ops.gemm_options`'s
``fused_epilogues``); the references define the numerics.

Layout as :func:`~fp8jax.ops.gemm` ("NT"): ``a`` FP8 ``[M, K]``, ``b`` FP8 ``[N, K]``, and
``p = (f32(a) @ f32(b).T) * a_scale_inv * b_scale_inv`` in float32.

``gemm_gelu`` (the first GEMM, forward)::

    h = p (+ f32(bias))                  float32, never rounded to the layer's dtype
    aux = float16(h)                     the GELU input, kept for the backward
    q, scale_inv, amax = quantize(gelu(h), scale)   gelu: tanh approximation in float32
                                         (activation's formula); amax = max |gelu(h)|

``gemm_dgelu`` (the second GEMM's dgrad, backward; ``a`` the output gradient, ``b`` the kernel)::

    dh = p * gelu'(f32(aux))             float32
    q, scale_inv, amax = quantize(dh, scale)
    dbias = sum over M of dh, rounded once to ``dbias_dtype`` (bfloat16 or float16: cuBLASLt
                                         returns the bias gradient in its 16-bit epilogue type)

Against the separate kernels (a GEMM writing ``h`` in the layer's dtype, then
``activation_cast_transpose``; the dgrad writing ``da``, then
``dactivation_cast_transpose_dbias``), nothing is rounded to the layer's dtype between the GEMM
and the cast, the GELU input is kept as float16 rather than the layer's dtype (a pre-activation
beyond +-65504 would become inf), and the bias gradient is rounded to 16 bits. On a GPU the tanh
is cuBLASLt's and the sums are the GEMM's, so results agree with the references within the
GEMM's tolerance, not bit for bit; on CPU the references run.

Why these two and what they save, in bytes per element of the activation ``[M, N]`` (16-bit
layer dtype; the transposed FP8 copy that the next GEMM's wgrad reads is still needed, and is
made by a transpose of the FP8 codes, 1 byte read and 1 written):

* forward, separate: the GEMM writes ``h`` (2), ``activation_cast_transpose`` reads it (2) and
  writes ``q`` and ``q_t`` (1 + 1): 6. Fused: the GEMM writes ``q`` (1) and ``aux`` (2), the
  transpose reads ``q`` (1) and writes ``q_t`` (1): 5.
* backward, separate: the dgrad writes ``da`` (2), ``dactivation_cast_transpose_dbias`` reads
  ``da`` and ``h`` (2 + 2) and writes ``dh_q`` and ``dh_t`` (1 + 1): 8. Fused: the dgrad reads
  ``aux`` (2) and writes ``dh_q`` (1), the transpose 1 + 1: 5. A DGELU epilogue with a 16-bit
  output would save nothing (2 + 2 written and read back + 2 for the cast: 8), hence the FP8
  output.

For the MLP of docs/performance.md (16384 tokens, FFN 16384: 2**28 activation elements) that is
3.2 GiB of the step's traffic moved 4 bytes per element fewer, 1 GiB, about 0.3 ms of an H100's
HBM time (unmeasured).

Sharding: M and N stay split as the operands are (amax made global with one ``pmax`` over the
mesh, the bias gradient with one ``psum`` over the axes that split M, in float32, of each
device's partial as its epilogue rounded it to 16 bits: with M split the bias gradient carries
one 16-bit rounding per device's partial sum, which matters only where those cancel); K is never
split (the GELU needs the whole sum), so a K-split operand is gathered. Not for explicit mesh
axes (the layers take the separate kernels there). Under :func:`jax.vmap` one GEMM per batch
element (:func:`jax.lax.map`).
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
from fp8jax.ops.casts.quantize import quantize_reference
from fp8jax.ops.fused.activation import act_f32, dact_f32
from fp8jax.ops.gemms._gemm_partition import divisible_axes, operand_dims, reused_plan
from fp8jax.ops.gemms.gemm import WORKSPACE_BYTES, gemm_reference, pad_operands
from fp8jax.ops.gemms.gemm_options import get_gemm_options

__all__ = []  # internal to fp8jax.ops: none of its names is public API

_F16 = jnp.dtype(jnp.float16)
_F32 = jnp.dtype(jnp.float32)
EPILOGUE_DTYPES = (jnp.dtype(jnp.bfloat16), _F16)
"""The 16-bit dtypes a bias (gradient) of the GELU epilogues may have (cuBLASLt's C type)."""
_GELU, _DGELU = 1, 2  # the handlers' epilogue codes (cpp/cuda/gemm_setup.h, GemmEpilogue)
switch.register_family("gemm", "gemm_gelu")
switch.register_family("gemm", "gemm_dgelu")


def _product(a, b, a_scale_inv, b_scale_inv) -> jax.Array:
    """``p``: the float32 scaled product of the module docstring."""
    return gemm_reference(a, b, a_scale_inv, b_scale_inv, out_dtype=_F32)


def gemm_gelu_reference(
    a: jax.Array,
    b: jax.Array,
    a_scale_inv: jax.Array,
    b_scale_inv: jax.Array,
    scale: jax.Array,
    *,
    fp8_dtype: Any,
    bias: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """The definition of :func:`gemm_gelu`: ``(q, aux, scale_inv, amax)`` (module docstring)."""
    h = _product(a, b, a_scale_inv, b_scale_inv)
    if bias is not None:
        h = h + bias.astype(_F32)
    q, scale_inv, amax = quantize_reference(act_f32("gelu", h), scale, fp8_dtype)
    return q, h.astype(_F16), scale_inv, amax


def gemm_dgelu_reference(
    a: jax.Array,
    b: jax.Array,
    a_scale_inv: jax.Array,
    b_scale_inv: jax.Array,
    aux: jax.Array,
    scale: jax.Array,
    *,
    fp8_dtype: Any,
    dbias_dtype: Any = jnp.bfloat16,
    with_dbias: bool = True,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """The definition of :func:`gemm_dgelu`: ``(q, scale_inv, amax, dbias or None)``."""
    dh = _product(a, b, a_scale_inv, b_scale_inv) * dact_f32("gelu", aux.astype(_F32))
    q, scale_inv, amax = quantize_reference(dh, scale, fp8_dtype)
    dbias = jnp.sum(dh, axis=0).astype(dbias_dtype) if with_dbias else None
    return q, scale_inv, amax, dbias


# The "xla" implementations: the references, jitted (XLA fuses, batches and partitions them).
_GELU_XLA = jax.jit(gemm_gelu_reference, static_argnames="fp8_dtype")
_DGELU_XLA = jax.jit(
    gemm_dgelu_reference, static_argnames=("fp8_dtype", "dbias_dtype", "with_dbias")
)


# ------------------------------------------------------------------ the CUDA calls


def _pad_cols(x: jax.Array, cols: int) -> jax.Array:
    return x if x.shape[1] == cols else jnp.pad(x, ((0, 0), (0, cols - x.shape[1])))


def _gelu_cuda(a, b, a_sinv, b_sinv, scale, bias, *, cfg):
    """``fp8jax_gemm_gelu`` (cpp/cuda/gemm_cublaslt.cc) on K and N padded to multiples of 16
    (zero columns of ``b`` give ``h = 0``, ``gelu(0) = 0``: the amax is unchanged)."""
    fp8_dtype, bias_dtype, fast_accum, autotune = cfg
    m, n = a.shape[0], b.shape[0]
    a_p, b_p, bias_p = pad_operands(a, b, bias)
    n_p = b_p.shape[0]
    outs = (
        jax.ShapeDtypeStruct((m, n_p), fp8_dtype),
        jax.ShapeDtypeStruct((m, n_p), _F16),
        jax.ShapeDtypeStruct((1,), _F32),
        jax.ShapeDtypeStruct((WORKSPACE_BYTES,), jnp.uint8),
    )
    q, aux, amax, _ = jax.ffi.ffi_call("fp8jax_gemm_gelu", outs)(
        a_p, b_p, a_sinv, b_sinv, jnp.zeros((0,), bias_dtype) if bias is None else bias_p,
        jnp.reshape(scale, (1,)), has_bias=np.int64(bias is not None),
        fast_accum=np.int64(fast_accum), autotune=np.int64(autotune),
    )  # fmt: skip
    return q[:, :n], aux[:, :n], jnp.reshape(amax, ())


def _dgelu_cuda(a, b, a_sinv, b_sinv, aux, scale, *, cfg):
    """``fp8jax_gemm_dgelu`` on K and N padded to multiples of 16 (zero columns: ``p = 0``)."""
    fp8_dtype, dbias_dtype, with_dbias, autotune = cfg
    m, n = a.shape[0], b.shape[0]
    a_p, b_p, _ = pad_operands(a, b, None)
    n_p = b_p.shape[0]
    outs = (
        jax.ShapeDtypeStruct((m, n_p), fp8_dtype),
        jax.ShapeDtypeStruct((1,), _F32),
        jax.ShapeDtypeStruct((n_p if with_dbias else 0,), dbias_dtype),
        jax.ShapeDtypeStruct((WORKSPACE_BYTES,), jnp.uint8),
    )
    q, amax, dbias, _ = jax.ffi.ffi_call("fp8jax_gemm_dgelu", outs)(
        a_p, b_p, a_sinv, b_sinv, _pad_cols(aux, n_p), jnp.reshape(scale, (1,)),
        has_bias=np.int64(with_dbias), fast_accum=np.int64(0), autotune=np.int64(autotune),
    )  # fmt: skip
    return q[:, :n], jnp.reshape(amax, ()), (dbias[:n] if with_dbias else None)


def _views(a, b, dtypes):
    """FP8 views of ``a`` and ``b`` (``uint8`` codes of ``dtypes``; ``None``: FP8 already)."""
    if dtypes is None:
        return a, b
    return lax.bitcast_convert_type(a, dtypes[0]), lax.bitcast_convert_type(b, dtypes[1])


def _gelu_2d(a, b, a_sinv, b_sinv, scale, bias, *, cfg, dtypes):
    """One device's ``gemm_gelu`` -> ``(q, aux, amax)``: cuBLASLt on CUDA, the reference
    elsewhere."""
    a, b = _views(a, b, dtypes)

    def reference(a, b, a_sinv, b_sinv, scale, bias):
        q, aux, _, amax = gemm_gelu_reference(a, b, a_sinv, b_sinv, scale, fp8_dtype=cfg[0],
                                              bias=bias)  # fmt: skip
        return q, aux, amax

    if 0 in a.shape or b.shape[0] == 0:
        return reference(a, b, a_sinv, b_sinv, scale, bias)
    cuda = functools.partial(_gelu_cuda, cfg=cfg)
    return lax.platform_dependent(
        a, b, a_sinv, b_sinv, scale, bias, cpu=reference, cuda=cuda, default=reference
    )


def _dgelu_2d(a, b, a_sinv, b_sinv, aux, scale, *, cfg, dtypes):
    """One device's ``gemm_dgelu`` -> ``(q, amax, dbias or None)``."""
    a, b = _views(a, b, dtypes)
    fp8_dtype, dbias_dtype, with_dbias, _ = cfg

    def reference(a, b, a_sinv, b_sinv, aux, scale):
        q, _, amax, dbias = gemm_dgelu_reference(
            a, b, a_sinv, b_sinv, aux, scale, fp8_dtype=fp8_dtype, dbias_dtype=dbias_dtype,
            with_dbias=with_dbias,
        )  # fmt: skip
        return q, amax, dbias

    if 0 in a.shape or b.shape[0] == 0:
        return reference(a, b, a_sinv, b_sinv, aux, scale)
    cuda = functools.partial(_dgelu_cuda, cfg=cfg)
    return lax.platform_dependent(
        a, b, a_sinv, b_sinv, aux, scale, cpu=reference, cuda=cuda, default=reference
    )


# ------------------------------------------------------------------ sharding and vmap


def _mn(mesh, a, b):
    """The axes that split M (``a``'s rows) and N (``b``'s rows, less M's); K is never split."""
    m = operand_dims(a)[0]
    n = divisible_axes(mesh, tuple(x for x in operand_dims(b)[0] if x not in m), b.shape[0])
    return m, n


def _rep(mesh, x):
    return partition.named(mesh, ((),) * x.ndim)


@functools.cache
def _partitioned_gelu(cfg, dtypes, has_bias):
    def kernel(a, b, a_sinv, b_sinv, scale, *bias):
        return _gelu_2d(a, b, a_sinv, b_sinv, scale, bias[0] if bias else None, cfg=cfg,
                        dtypes=dtypes)  # fmt: skip

    def plan(mesh, args):
        a, b = args[0], args[1]
        m, n = _mn(mesh, a, b)
        ins = [partition.named(mesh, (m, ())), partition.named(mesh, (n, ()))]
        ins += [_rep(mesh, x) for x in args[2:5]]
        ins += [partition.named(mesh, (n,))] if has_bias else []
        mn = partition.named(mesh, (m, n))
        amax_axes = partition.amax_axes(mesh, (m, n), "mesh")

        def local(*xs):
            q, aux, amax = kernel(*xs)
            return q, aux, partition.pmax_over(amax, amax_axes)

        return ins, [mn, mn, partition.named(mesh, ())], local

    rule = "m k, n k, , , " + (", n" if has_bias else "") + " -> m n, m n, "
    return partition.partitioned(kernel, plan, rule, need_replication=("k",))


@functools.cache
def _partitioned_dgelu(cfg, dtypes, has_reuse):
    """``gemm_dgelu`` split over a mesh; with ``has_reuse`` two more operands, ``(w_t, x_t)``
    as for :func:`~fp8jax.ops.gemms.gemm.gemm_reusing`: under FSDP the forward GEMM's gathered
    kernel is transposed on each device instead of gathered again."""
    with_dbias = cfg[2]

    def kernel(from_reuse, a, b, a_sinv, b_sinv, aux, scale, *reuse):
        if from_reuse:
            b = jnp.swapaxes(reuse[0], 0, 1)
        q, amax, dbias = _dgelu_2d(a, b, a_sinv, b_sinv, aux, scale, cfg=cfg, dtypes=dtypes)
        return (q, amax, dbias) if with_dbias else (q, amax)

    def plan(mesh, args):
        a, b = args[0], args[1]
        reused = reused_plan(mesh, a, *args[6:]) if has_reuse else None
        if reused is not None and reused[2]:
            reused = None  # the forward split its N: K here, which the GELU cannot take
        m, n = reused[:2] if reused else _mn(mesh, a, b)
        ins = [partition.named(mesh, (m, ())),
               _as_is(mesh, b) if reused else partition.named(mesh, (n, ())),
               _rep(mesh, args[2]), _rep(mesh, args[3]), partition.named(mesh, (m, n)),
               _rep(mesh, args[5])]  # fmt: skip
        if has_reuse:
            ins += [partition.named(mesh, ((), n)) if reused else _as_is(mesh, args[6])]
            ins += [_as_is(mesh, args[7])]
        amax_axes = partition.amax_axes(mesh, (m, n), "mesh")
        m_axes = partition.splitting_axes(mesh, (m,))

        def local(*xs):
            q, amax, *dbias = kernel(reused is not None, *xs)
            out = (q, partition.pmax_over(amax, amax_axes))
            if with_dbias:  # the rows' partial sums made global, added in float32
                d = dbias[0]
                out += (jax.lax.psum(d.astype(_F32), m_axes).astype(d.dtype) if m_axes else d,)
            return out

        outs = [partition.named(mesh, (m, n)), partition.named(mesh, ())]
        return ins, outs + ([partition.named(mesh, (n,))] if with_dbias else []), local

    rule = "m k, n k, , , m n, " + (", r0 r1, r2 r3" if has_reuse else "")
    rule += " -> m n, " + (", n" if with_dbias else "")
    return partition.partitioned(
        functools.partial(kernel, False), plan, rule, need_replication=("k",)
    )


def _as_is(mesh, x):
    """An operand's own sharding (one the kernel does not read as laid out: never resharded)."""
    if isinstance(x.sharding, jax.sharding.NamedSharding):
        return x.sharding
    return _rep(mesh, x)


def _mapped(op):
    """``op`` with a vmap rule: one call per batch element (:func:`jax.lax.map`)."""

    @jax.custom_batching.custom_vmap
    def call(*args):
        return op(*args)

    @call.def_vmap
    def rule(axis_size, in_batched, *args):
        del axis_size
        batched = [x for x, bt in zip(args, in_batched, strict=True) if bt]

        def one(xs):
            it = iter(xs)
            return call(*[next(it) if bt else x for x, bt in zip(args, in_batched, strict=True)])

        outs = lax.map(one, tuple(batched))
        return outs, jax.tree.map(lambda _: True, outs)

    return call


# ------------------------------------------------------------------ the layers' entry points


def _operands(op, a, b, a_scale_inv, b_scale_inv, scale, dtypes):
    """Checks and FP8 views: ``(a_view, b_view, a_scale_inv, b_scale_inv, scale, codes)``."""
    if dtypes is None:
        a, b = checks.fp8_array(op, "a", a), checks.fp8_array(op, "b", b)
        a_view, b_view, codes = a, b, None
    else:
        codes = tuple(checks.fp8_dtype_arg(op, "dtypes", d) for d in dtypes)
        for name, v in (("a", a), ("b", b)):
            if jnp.result_type(v) != jnp.uint8:
                raise TypeError(f"{op}: {name} must hold uint8 codes, got {jnp.result_type(v)}")
        a_view, b_view = _views(a, b, codes)
    if a_view.ndim != 2 or b_view.ndim != 2 or a_view.shape[1] != b_view.shape[1]:
        raise ValueError(
            f"{op}: a must be [M, K] and b [N, K] (the same K), got {a_view.shape} and "
            f"{b_view.shape}"
        )
    if a_view.dtype == jnp.float8_e5m2 and b_view.dtype == jnp.float8_e5m2:
        raise TypeError(f"{op}: a and b cannot both be float8_e5m2")
    named = (("a_scale_inv", a_scale_inv), ("b_scale_inv", b_scale_inv), ("scale", scale))
    scalars = [checks.scalar_f32(op, name, v) for name, v in named]
    return (a_view, b_view, *(jnp.reshape(s, ()) for s in scalars), codes)


def gemm_gelu(
    a: jax.Array,
    b: jax.Array,
    a_scale_inv: jax.Array,
    b_scale_inv: jax.Array,
    scale: jax.Array,
    *,
    fp8_dtype: Any,
    bias: jax.Array | None = None,
    dtypes: tuple[Any, Any] | None = None,
    implementation: str | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """``gelu`` of the FP8 GEMM ``a @ b.T`` (+ ``bias``), cast to FP8 with ``scale``:
    ``(q [M, N], aux [M, N] float16, scale_inv, amax)`` (module docstring).

    ``a`` and ``b`` are FP8, or with ``dtypes = (a's, b's)`` the ``uint8`` codes of FP8 tensors
    of those dtypes (as the layers keep them); ``bias`` ``[N]`` bfloat16 or float16;
    ``fp8_dtype`` ``q``'s (E5M2 only with an E5M2 operand). ``implementation``: ``"kernel"``
    (cuBLASLt's GELU epilogue on CUDA, the reference on CPU) or ``"xla"``; default: the
    ``"gemm"`` family's choice."""
    op = "gemm_gelu"
    a_v, b_v, a_sinv, b_sinv, scale, codes = _operands(op, a, b, a_scale_inv, b_scale_inv,
                                                       scale, dtypes)  # fmt: skip
    fp8 = checks.fp8_dtype_arg(op, "fp8_dtype", fp8_dtype)
    if bias is not None:
        bias = checks.array_arg(op, "bias", bias)
        if bias.shape != (b_v.shape[0],) or bias.dtype not in EPILOGUE_DTYPES:
            raise ValueError(f"{op}: bias must be bfloat16 or float16 [N], got {bias.dtype}"
                             f"{list(bias.shape)}")  # fmt: skip
    if switch.choose(op, "gemm", implementation) == "xla":
        return _GELU_XLA(a_v, b_v, a_sinv, b_sinv, scale, fp8_dtype=fp8, bias=bias)
    _ffi.ensure_registered()
    bias_dtype = EPILOGUE_DTYPES[0] if bias is None else jnp.dtype(bias.dtype)
    cfg = (np.dtype(fp8), bias_dtype, True, get_gemm_options().autotune)
    call = _partitioned_gelu(cfg, codes, bias is not None)
    args = (a, b, a_sinv, b_sinv, scale) + (() if bias is None else (bias,))
    q, aux, amax = _mapped(call)(*args)
    return q, aux, (1.0 / scale).astype(_F32), amax


def gemm_dgelu(
    a: jax.Array,
    b: jax.Array,
    a_scale_inv: jax.Array,
    b_scale_inv: jax.Array,
    aux: jax.Array,
    scale: jax.Array,
    *,
    fp8_dtype: Any,
    dbias_dtype: Any = jnp.bfloat16,
    with_dbias: bool = True,
    reuse: tuple[jax.Array, jax.Array] | None = None,
    dtypes: tuple[Any, Any] | None = None,
    implementation: str | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """The gradient through ``gelu`` of the FP8 dgrad ``a @ b.T`` at the GELU input ``aux``
    (float16 ``[M, N]``, from :func:`gemm_gelu`), cast to FP8 with ``scale``, with its column
    sums: ``(q, scale_inv, amax, dbias [N] of dbias_dtype or None)`` (module docstring).
    Split (full-precision) accumulation, as every dgrad. ``reuse = (w_t, x_t)``: the forward
    GEMM's ``b`` (``b`` transposed, codes as ``b``) and its ``a`` transposed, read for their
    shardings only (:func:`~fp8jax.ops.gemms.gemm.gemm_reusing`). Other arguments as for
    :func:`gemm_gelu`."""
    op = "gemm_dgelu"
    a_v, b_v, a_sinv, b_sinv, scale, codes = _operands(op, a, b, a_scale_inv, b_scale_inv,
                                                       scale, dtypes)  # fmt: skip
    fp8 = checks.fp8_dtype_arg(op, "fp8_dtype", fp8_dtype)
    aux = checks.array_arg(op, "aux", aux)
    if aux.dtype != _F16 or aux.shape != (a_v.shape[0], b_v.shape[0]):
        raise ValueError(f"{op}: aux must be float16 [M, N], got {aux.dtype}{list(aux.shape)}")
    dbias_dtype = jnp.dtype(dbias_dtype)
    if dbias_dtype not in EPILOGUE_DTYPES:
        raise ValueError(f"{op}: dbias_dtype must be bfloat16 or float16, got {dbias_dtype}")
    with_dbias = bool(with_dbias)
    if switch.choose(op, "gemm", implementation) == "xla":
        return _DGELU_XLA(a_v, b_v, a_sinv, b_sinv, aux, scale, fp8_dtype=fp8,
                          dbias_dtype=dbias_dtype, with_dbias=with_dbias)  # fmt: skip
    _ffi.ensure_registered()
    cfg = (np.dtype(fp8), dbias_dtype, with_dbias, get_gemm_options().autotune)
    op = _partitioned_dgelu(cfg, codes, reuse is not None)
    outs = _mapped(op)(a, b, a_sinv, b_sinv, aux, scale, *(reuse or ()))
    q, amax = outs[0], outs[1]
    return q, (1.0 / scale).astype(_F32), amax, (outs[2] if with_dbias else None)
