"""``gemm``: the FP8 matrix multiply, cuBLASLt on CUDA beside its XLA reference.

Layout contract ("NT": both operands K-major, as Hopper's FP8 tensor cores want them)::

    a: FP8 [M, K],  b: FP8 [N, K]  ->
    out[M, N] = (f32(a) @ f32(b).T) * (a_scale_inv * b_scale_inv) (+ f32(bias)[None, :]),
    rounded once to out_dtype

Numerics contract (the GEMM's part; the casts' is in docs/numerics.md): products and sums in
float32; the combined scale is applied to the float32 accumulator, the bias added in float32, and
the result rounded once to ``out_dtype``.
``accumulate="fast"`` (forward GEMMs) lets Hopper's tensor cores keep partial sums in their own,
reduced-precision accumulator; ``"split"`` (dgrad and wgrad) promotes them to full float32 at
regular intervals. On CPU both modes are the same exact-float32 XLA dot.

Per platform (:func:`jax.lax.platform_dependent`, so only the branch for the platform being
compiled is lowered):

- CPU (and any platform other than CUDA): the reference *is* the implementation, an XLA dot of the
  float32 upcasts (``precision=HIGHEST``) times the scales. No fp8jax kernel runs.
- CUDA: the FFI custom call ``fp8jax_gemm`` (cuBLASLt, ``cpp/cuda/gemm_cublaslt.cc``). cuBLASLt's
  FP8 kernels need K and the leading dimensions in multiples of 16 bytes, so this wrapper pads K
  (both operands) and N (rows of ``b`` and the bias) with zeros up to multiples of 16 and slices
  the result back to ``[M, N]``; zero padding adds exact zeros to every sum, so it does not change
  the result. Padding costs one copy of the padded operand; shapes that are already multiples of
  16 (every real layer) are passed through untouched. cuBLASLt's FP8 bias epilogue takes a bias of
  the output type for bf16/f16 outputs only, so a float32 bias is added by XLA after the kernel
  (the same float32 add as the reference). XLA allocates the kernel's 32 MiB workspace as a second
  output, so the kernel allocates nothing at run time. Its ``autotune`` attribute (from
  :func:`fp8jax.ops.gemm_options`, default on) makes the handler time cuBLASLt's candidates the
  first time it meets a problem, outside CUDA-graph capture (``cpp/cuda/gemm_autotune.h``).

With ``fp8jax.ops.implementation(gemm="xla")`` (or ``implementation="xla"``) the GEMM is
:func:`gemm_reference` on every platform, jitted, and XLA batches and partitions its own dot;
the custom partitioning and vmap rule below are the kernel path's. This op is not an
:class:`~fp8jax.ops.base.opdef.OpDef`: its split is decided from both operands (M, N and K, a
``psum`` for a split K, the FSDP reuse), its vmap folds a batch into M, and on CPU it has no
kernel, so it keeps its own plan (``_gemm_partition``) and calls the same switch.

Under :func:`jax.vmap`, a batch of ``a`` alone (``b``, scales and bias shared) folds into M: one
GEMM of ``[B*M, K]``. Any other batching runs one GEMM per batch element (:func:`jax.lax.map`).

``gemm`` is a forward op on already-quantized tensors and is not differentiable itself; layers
define their gradients with :func:`jax.custom_vjp` and call ``gemm`` for dgrad and wgrad.
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
from fp8jax.ops.gemms import _gemm_partition
from fp8jax.ops.gemms.gemm_options import get_gemm_options

__all__ = ["gemm", "gemm_reference"]

ACCUMULATE_MODES = ("fast", "split")
# cuBLASLt FP8: K and the output's leading dimension in multiples of 16 bytes (K of FP8 operands).
PAD_MULTIPLE = 16
WORKSPACE_BYTES = 32 * 2**20

_E5M2 = jnp.dtype(jnp.float8_e5m2)
_FAMILY = switch.register_family("gemm", "gemm")
_DIMS_NT = (((1,), (1,)), ((), ()))


def _validate(
    op: str,
    a: Any,
    b: Any,
    a_scale_inv: Any,
    b_scale_inv: Any,
    out_dtype: Any,
    bias: Any,
    accumulate: Any,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array, np.dtype, jax.Array | None]:
    """Every argument check of :func:`gemm`, before any kernel; errors name the argument."""
    a = checks.fp8_array(op, "a", a)
    b = checks.fp8_array(op, "b", b)
    if a.dtype == _E5M2 and b.dtype == _E5M2:
        raise TypeError(
            f"{op}: a and b cannot both be float8_e5m2 (cuBLASLt has no E5M2 x E5M2 GEMM); "
            "use float8_e4m3fn for at least one operand"
        )
    if a.ndim != 2:
        raise ValueError(f"{op}: a must be 2-D [M, K], got shape {a.shape}")
    if b.ndim != 2:
        raise ValueError(f"{op}: b must be 2-D [N, K] (K-major, 'NT' layout), got shape {b.shape}")
    if a.shape[1] != b.shape[1]:
        raise ValueError(
            f"{op}: a [M, K] and b [N, K] must share K (their last dim), got a {a.shape} and "
            f"b {b.shape}"
        )
    a_scale_inv = checks.scalar_f32(op, "a_scale_inv", a_scale_inv)
    b_scale_inv = checks.scalar_f32(op, "b_scale_inv", b_scale_inv)
    out_dt = checks.wide_dtype_arg(op, "out_dtype", out_dtype)
    if not isinstance(accumulate, str) or accumulate not in ACCUMULATE_MODES:
        raise ValueError(f"{op}: accumulate must be 'fast' or 'split', got {accumulate!r}")
    if bias is not None:
        bias = checks.array_arg(op, "bias", bias)
        if bias.dtype != out_dt:
            raise TypeError(
                f"{op}: bias must have dtype out_dtype ({out_dt}), got dtype {bias.dtype}"
            )
        if bias.shape != (b.shape[0],):
            raise ValueError(
                f"{op}: bias must have shape (N,) = ({b.shape[0]},), got shape {bias.shape}"
            )
    return a, b, a_scale_inv, b_scale_inv, out_dt, bias


def _reference_2d(
    a: jax.Array,
    b: jax.Array,
    a_scale_inv: jax.Array,
    b_scale_inv: jax.Array,
    bias: jax.Array | None,
    *,
    out_dtype: np.dtype,
    out_sharding: Any = None,
) -> jax.Array:
    acc = lax.dot_general(
        a.astype(jnp.float32),
        b.astype(jnp.float32),
        _DIMS_NT,
        precision=lax.Precision.HIGHEST,
        preferred_element_type=jnp.float32,
        out_sharding=out_sharding,
    )
    y = acc * (jnp.reshape(a_scale_inv, ()) * jnp.reshape(b_scale_inv, ()))
    if bias is not None:
        y = y + bias.astype(jnp.float32)
    return y.astype(out_dtype)


@functools.partial(jax.jit, static_argnames="out_dtype")
def _xla(
    a: jax.Array,
    b: jax.Array,
    a_scale_inv: jax.Array,
    b_scale_inv: jax.Array,
    bias: jax.Array | None,
    *,
    out_dtype: np.dtype,
) -> jax.Array:
    """The ``"xla"`` implementation: the reference, which XLA batches and partitions itself
    (its own dot sharding; a ``reuse`` hint has nothing to steer there). Under explicit sharding
    the result is laid out as the kernel's rule lays it out, which JAX cannot pick itself when
    K is split (a wgrad over split tokens, a row-parallel GEMM)."""
    out_sharding = None
    if partition.explicit_mesh() and a.ndim == 2:
        out_sharding = partition.explicit_matmul_spec(a, b, b_rows_are_n=True)
    return _reference_2d(
        a, b, a_scale_inv, b_scale_inv, bias, out_dtype=out_dtype, out_sharding=out_sharding
    )


def gemm_reference(
    a: jax.Array,
    b: jax.Array,
    a_scale_inv: jax.Array,
    b_scale_inv: jax.Array,
    *,
    out_dtype: Any = jnp.bfloat16,
    bias: jax.Array | None = None,
    accumulate: str = "fast",
) -> jax.Array:
    """Pure-XLA reference of :func:`gemm` (the definition of its numerics; ``accumulate`` is
    validated and otherwise ignored: the reference always accumulates in exact float32 order of
    XLA's dot)."""
    a, b, a_scale_inv, b_scale_inv, out_dt, bias = _validate(
        "gemm_reference", a, b, a_scale_inv, b_scale_inv, out_dtype, bias, accumulate
    )
    return _reference_2d(a, b, a_scale_inv, b_scale_inv, bias, out_dtype=out_dt)


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def pad_operands(
    a: jax.Array,
    b: jax.Array,
    bias: jax.Array | None,
    multiple: int = PAD_MULTIPLE,
) -> tuple[jax.Array, jax.Array, jax.Array | None]:
    """Zero-pads K (``a`` and ``b`` columns) and N (``b`` rows, ``bias``) up to ``multiple``.

    The GEMM of the padded operands, sliced to ``[:, :N]``, equals the GEMM of the originals:
    padded K adds ``0 * 0`` terms, padded N adds output columns that are dropped. Operands that
    already have aligned sizes are returned as they are (no copy).
    """
    m, k = a.shape
    n = b.shape[0]
    kp, np_ = round_up(k, multiple), round_up(n, multiple)
    if kp != k:
        a = jnp.pad(a, ((0, 0), (0, kp - k)))
    if kp != k or np_ != n:
        b = jnp.pad(b, ((0, np_ - n), (0, kp - k)))
    if bias is not None and np_ != n:
        bias = jnp.pad(bias, (0, np_ - n))
    del m
    return a, b, bias


def _cuda_2d(
    a: jax.Array,
    b: jax.Array,
    a_scale_inv: jax.Array,
    b_scale_inv: jax.Array,
    bias: jax.Array | None,
    *,
    out_dtype: np.dtype,
    fast_accum: bool,
    autotune: bool = True,
) -> jax.Array:
    m, n = a.shape[0], b.shape[0]
    a_p, b_p, bias_p = pad_operands(a, b, bias)
    fuse_bias = bias_p is not None and out_dtype != jnp.float32
    bias_arg = bias_p if fuse_bias else jnp.zeros((0,), out_dtype)
    out_types = (
        jax.ShapeDtypeStruct((m, b_p.shape[0]), out_dtype),
        jax.ShapeDtypeStruct((WORKSPACE_BYTES,), jnp.uint8),
    )
    call = jax.ffi.ffi_call("fp8jax_gemm", out_types)
    out, _workspace = call(
        a_p,
        b_p,
        a_scale_inv,
        b_scale_inv,
        bias_arg,
        has_bias=np.int64(fuse_bias),
        fast_accum=np.int64(fast_accum),
        a_scale_mode=np.int64(0),  # per-tensor scales (block scales: fp8jax.ops.gemms.blockwise)
        b_scale_mode=np.int64(0),
        autotune=np.int64(autotune),
    )
    out = out[:, :n] if out.shape[1] != n else out
    if bias is not None and not fuse_bias:  # float32 output: the reference's float32 add
        out = out + bias
    return out


def _gemm_2d(
    a: jax.Array,
    b: jax.Array,
    a_scale_inv: jax.Array,
    b_scale_inv: jax.Array,
    bias: jax.Array | None,
    *,
    out_dtype: np.dtype,
    accumulate: str,
    autotune: bool = True,
) -> jax.Array:
    reference = functools.partial(_reference_2d, out_dtype=out_dtype)
    if 0 in (a.shape[0], a.shape[1], b.shape[0]):
        return reference(a, b, a_scale_inv, b_scale_inv, bias)  # empty: no kernel to run
    cuda = functools.partial(
        _cuda_2d, out_dtype=out_dtype, fast_accum=accumulate == "fast", autotune=autotune
    )
    return lax.platform_dependent(
        a, b, a_scale_inv, b_scale_inv, bias, cpu=reference, cuda=cuda, default=reference
    )


@functools.cache
def local_gemm(codes: tuple[np.dtype, np.dtype] | None, autotune: bool = True) -> Any:
    """The per-device 2-D GEMM; with ``codes = (a_dtype, b_dtype)`` its operands are the
    ``uint8`` codes of FP8 tensors of those dtypes, viewed as FP8 on each device. ``autotune``:
    the custom call's attribute (:mod:`fp8jax.ops.gemm_options`)."""

    def local(a, b, *args, **kwargs):
        if codes is not None:
            a = lax.bitcast_convert_type(a, codes[0])
            b = lax.bitcast_convert_type(b, codes[1])
        return _gemm_2d(a, b, *args, autotune=autotune, **kwargs)

    return local


@functools.cache
def _batchable_gemm(
    out_dtype: np.dtype,
    accumulate: str,
    codes: tuple[np.dtype, np.dtype] | None = None,
    autotune: bool = True,
) -> Any:
    """The 2-D GEMM for one (out_dtype, accumulate, codes, autotune), with its vmap rule."""

    @jax.custom_batching.custom_vmap
    def gemm_2d(a, b, a_scale_inv, b_scale_inv, bias):
        # Partitioned under jit on a mesh (see _gemm_partition); plain _gemm_2d otherwise.
        op = _gemm_partition.partitioned_gemm(
            local_gemm(codes, autotune),
            out_dtype,
            accumulate,
            bias is not None,
            jnp.ndim(a_scale_inv),
            jnp.ndim(b_scale_inv),
        )
        return op(a, b, a_scale_inv, b_scale_inv, bias)

    @gemm_2d.def_vmap
    def _vmap_rule(axis_size, in_batched, a, b, a_scale_inv, b_scale_inv, bias):
        args = (a, b, a_scale_inv, b_scale_inv, bias)
        batched = [bool(x) for x in in_batched[:4]] + [bias is not None and bool(in_batched[4])]
        if not any(batched):
            return gemm_2d(*args), False
        if batched == [True, False, False, False, False]:
            # Only the activations carry the batch: fold it into M, one GEMM.
            _, m, k = a.shape
            out = gemm_2d(a.reshape(axis_size * m, k), b, a_scale_inv, b_scale_inv, bias)
            return out.reshape(axis_size, m, out.shape[-1]), True

        def one(xs):
            it = iter(xs)
            return gemm_2d(*[next(it) if bt else x for x, bt in zip(args, batched, strict=True)])

        mapped = tuple(x for x, bt in zip(args, batched, strict=True) if bt)
        return lax.map(one, mapped), True

    return gemm_2d


@functools.cache
def _batchable_gemm_reuse(
    out_dtype: np.dtype,
    accumulate: str,
    codes: tuple[np.dtype, np.dtype] | None = None,
    autotune: bool = True,
) -> Any:
    """:func:`_batchable_gemm` (no bias) that also takes ``reuse = (w_t, x_t)``, see
    :func:`gemm_reusing`."""

    @jax.custom_batching.custom_vmap
    def gemm_2d(a, b, a_scale_inv, b_scale_inv, w_t, x_t):
        op = _gemm_partition.partitioned_gemm(
            local_gemm(codes, autotune),
            out_dtype,
            accumulate,
            False,
            jnp.ndim(a_scale_inv),
            jnp.ndim(b_scale_inv),
            True,
        )
        return op(a, b, a_scale_inv, b_scale_inv, None, (w_t, x_t))

    @gemm_2d.def_vmap
    def _vmap_rule(axis_size, in_batched, a, b, a_scale_inv, b_scale_inv, w_t, x_t):
        # reuse only steers the sharding: under vmap, the plain GEMM's own batching rule.
        del axis_size, w_t, x_t
        axes = (*(0 if bt else None for bt in in_batched[:4]), None)
        plain = _batchable_gemm(out_dtype, accumulate, codes, autotune)
        return jax.vmap(plain, in_axes=axes)(a, b, a_scale_inv, b_scale_inv, None), True

    return gemm_2d


def _validate_reuse(b: jax.Array, reuse: Any) -> tuple[jax.Array, jax.Array]:
    w_t = checks.fp8_array("gemm", "reuse[0]", reuse[0])
    x_t = checks.array_arg("gemm", "reuse[1]", reuse[1])
    if w_t.shape != b.shape[::-1] or w_t.dtype != b.dtype:
        raise ValueError(
            f"gemm: reuse[0] must be b's transpose, {b.dtype}{list(b.shape[::-1])}, got "
            f"{w_t.dtype}{list(w_t.shape)}"
        )
    if x_t.ndim != 2 or x_t.shape[0] != b.shape[0]:
        raise ValueError(
            f"gemm: reuse[1] must be the forward input transposed, [{b.shape[0]}, M], got "
            f"{list(x_t.shape)}"
        )
    return w_t, x_t


def gemm_reusing(
    a: jax.Array,
    b: jax.Array,
    a_scale_inv: jax.Array,
    b_scale_inv: jax.Array,
    *,
    reuse: tuple[jax.Array, jax.Array],
    out_dtype: Any = jnp.bfloat16,
    accumulate: str = "split",
    implementation: str | None = None,
) -> jax.Array:
    """:func:`gemm` for a layer's dgrad, ``a = g [M, N]``, ``b = w_q [K, N]``; equal to
    ``gemm(a, b, ...)`` in value. ``reuse = (w_t, x_t)``: the forward GEMM's ``b`` (``w_q``
    transposed) and ``a`` transposed (``[K, M]``). Under jit on a mesh where the forward GEMM
    gathered ``w_t`` (FSDP), the gathered copy is reused, transposed on each device, instead of
    gathering ``w_q`` again (see :mod:`fp8jax.ops.gemms._gemm_partition`). Private to fp8jax's
    layers."""
    a, b, a_scale_inv, b_scale_inv, out_dt, _ = _validate(
        "gemm", a, b, a_scale_inv, b_scale_inv, out_dtype, None, accumulate
    )
    w_t, x_t = _validate_reuse(b, reuse)
    if switch.choose("gemm", _FAMILY, implementation) == "xla":
        return _xla(a, b, a_scale_inv, b_scale_inv, None, out_dtype=out_dt)
    _ffi.ensure_registered()
    op = _batchable_gemm_reuse(out_dt, accumulate, None, get_gemm_options().autotune)
    return op(a, b, a_scale_inv, b_scale_inv, w_t, x_t)


def gemm_codes(
    a: jax.Array,
    b: jax.Array,
    a_scale_inv: jax.Array,
    b_scale_inv: jax.Array,
    *,
    dtypes: tuple[Any, Any],
    out_dtype: Any = jnp.bfloat16,
    bias: jax.Array | None = None,
    accumulate: str = "fast",
    reuse: tuple[jax.Array, jax.Array] | None = None,
    implementation: str | None = None,
) -> jax.Array:
    """:func:`gemm` (or with ``reuse``, :func:`gemm_reusing`) on the ``uint8`` codes of FP8
    tensors: ``a``, ``b`` and ``reuse[0]`` hold codes of FP8 ``dtypes = (a_dtype, b_dtype)``
    (``reuse[0]`` has ``b``'s), viewed as FP8 only on each device. Private to fp8jax's layers,
    which keep their FP8 residuals as codes (see :mod:`fp8jax.functional.dense`): the sharding
    machinery then moves the very value the layer saved, so an FSDP gather is shared by both
    GEMMs."""
    for name, v in (("a", a), ("b", b)) + ((("reuse[0]", reuse[0]),) if reuse else ()):
        if jnp.result_type(v) != jnp.uint8:
            raise TypeError(f"gemm_codes: {name} must hold uint8 codes, got {jnp.result_type(v)}")
    a_dt, b_dt = (checks.fp8_dtype_arg("gemm_codes", "dtypes", d) for d in dtypes)
    a_view, b_view = lax.bitcast_convert_type(a, a_dt), lax.bitcast_convert_type(b, b_dt)
    _, _, a_scale_inv, b_scale_inv, out_dt, bias = _validate(
        "gemm", a_view, b_view, a_scale_inv, b_scale_inv, out_dtype, bias, accumulate
    )
    if reuse is not None and bias is not None:
        raise ValueError("gemm_codes: reuse (a dgrad GEMM) takes no bias")
    if reuse is not None:
        _validate_reuse(b_view, (lax.bitcast_convert_type(reuse[0], b_dt), reuse[1]))
    if switch.choose("gemm", _FAMILY, implementation) == "xla":
        return _xla(a_view, b_view, a_scale_inv, b_scale_inv, bias, out_dtype=out_dt)
    _ffi.ensure_registered()
    codes = (np.dtype(a_dt), np.dtype(b_dt))
    autotune = get_gemm_options().autotune
    if reuse is None:
        op = _batchable_gemm(out_dt, accumulate, codes, autotune)
        return op(a, b, a_scale_inv, b_scale_inv, bias)
    op = _batchable_gemm_reuse(out_dt, accumulate, codes, autotune)
    return op(a, b, a_scale_inv, b_scale_inv, reuse[0], reuse[1])


def gemm(
    a: jax.Array,
    b: jax.Array,
    a_scale_inv: jax.Array,
    b_scale_inv: jax.Array,
    *,
    out_dtype: Any = jnp.bfloat16,
    bias: jax.Array | None = None,
    accumulate: str = "fast",
    implementation: str | None = None,
) -> jax.Array:
    """FP8 GEMM: ``(f32(a) @ f32(b).T) * a_scale_inv * b_scale_inv (+ bias)`` as ``out_dtype``.

    Args:
      a: FP8 ``[M, K]`` (``float8_e4m3fn`` or ``float8_e5m2``).
      b: FP8 ``[N, K]``: K-major, i.e. the *transposed* right-hand matrix ("NT" layout). ``a`` and
        ``b`` may not both be ``float8_e5m2`` (cuBLASLt has no E5M2 x E5M2 GEMM).
      a_scale_inv, b_scale_inv: float32, shape ``()`` or ``(1,)``: the dequantization factors that
        :func:`fp8jax.ops.quantize` returns with each tensor.
      out_dtype: bfloat16 (default), float16 or float32.
      bias: ``None`` or ``[N]`` of ``out_dtype``, added in float32 before the single rounding.
      accumulate: ``"fast"`` (forward GEMMs) or ``"split"`` (full-precision accumulation, for
        dgrad and wgrad). Only the CUDA kernel distinguishes them.
      implementation: ``"kernel"`` (cuBLASLt on CUDA; on CPU the XLA dot either way) or
        ``"xla"`` (:func:`gemm_reference`, XLA's own dot of the upcast operands, batched and
        partitioned by XLA); default: the enclosing :func:`fp8jax.ops.implementation` choice
        for ``"gemm"``.

    Returns:
      ``[M, N]`` array of ``out_dtype``.

    On CUDA, K and N are zero-padded to multiples of 16 for cuBLASLt and the result is sliced back
    (see the module docstring); on CPU this is the XLA dot of :func:`gemm_reference`.

    >>> import jax.numpy as jnp, fp8jax
    >>> a = jnp.ones((2, 3), jnp.float8_e4m3fn)
    >>> b = jnp.full((4, 3), 2.0, jnp.float8_e4m3fn)
    >>> fp8jax.ops.gemm(a, b, jnp.float32(0.5), jnp.float32(1.0)).tolist()
    [[3.0, 3.0, 3.0, 3.0], [3.0, 3.0, 3.0, 3.0]]
    """
    a, b, a_scale_inv, b_scale_inv, out_dt, bias = _validate(
        "gemm", a, b, a_scale_inv, b_scale_inv, out_dtype, bias, accumulate
    )
    if switch.choose("gemm", _FAMILY, implementation) == "xla":
        return _xla(a, b, a_scale_inv, b_scale_inv, bias, out_dtype=out_dt)
    _ffi.ensure_registered()
    op = _batchable_gemm(out_dt, accumulate, None, get_gemm_options().autotune)
    return op(a, b, a_scale_inv, b_scale_inv, bias)
