"""Sample inputs for every op, the table the conformance suite runs (tests/ops/test_conformance.py
and tests/distributed/test_ops_conformance.py).

``SAMPLES`` maps each op (every name in :func:`fp8jax.ops._opdef.registered_ops`, plus the GEMM,
which is not an OpDef) to a builder ``(key) -> {variant: Sample}``: representative arguments of
the op's public function, one variant per option combination that changes the kernel's path
(FP8 format, input dtype, gated or not, zero-centred gamma, rank, recipe). ``key`` is a seed; a
builder gives the same shapes for every key (vmap stacks two). The leading dim of the first
operand is a multiple of 8 (the distributed suite splits it over 8 devices).

A new op needs one entry here (``test_every_op_has_a_sample`` fails until it has one), and then
only the tests that are specific to it in its own file.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Callable, Mapping
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fp8jax import DelayedScaling, ops
from fp8jax.ops.cast_transpose import grouped_cast_transpose_dbias

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
M, N = 16, 24  # rows (a multiple of 8) and columns of the samples

# Kernel vs reference on CPU where the two are not the same bits: the norms sum a row in another
# order (tests/ops/test_norm.py's tolerance), the activations' tanh/erfc/exp are the C library's
# (tests/ops/test_activation.py's); an FP8 code may then be its neighbour.
NORM_CLOSE = {"ulps": 1, "rtol": 2.0**-7, "atol": 64 * 2.0**-23 * 16}
ACT_CLOSE = {"ulps": 1, "rtol": 2.0**-7, "atol": 16 * 2.0**-23 * 64}
# cuBLASLt's and XLA's FP8 GEMMs on a GPU (accumulation orders differ): test_gemm.py's allowance.
GEMM_GPU_CLOSE = {"rtol": 2 * (2.0**-9 + 2.0**-23), "atol": 1e-3}


@dataclasses.dataclass(frozen=True)
class Sample:
    """One call of an op's public function: ``fn(*args, **kwargs)``.

    ``close``: ``assert_matches`` tolerance of kernel vs reference on CPU (``None``: the same
    bits). ``gpu_close``: added on a GPU, where ``"xla"`` is not the reference's bits. ``sums``:
    outputs summed over the rows (dbias, dgamma), which a mesh adds in another order.
    """

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    close: Mapping[str, float] | None = None
    gpu_close: Mapping[str, float] | None = None
    sums: tuple[int, ...] = ()

    def bound(self) -> dict[str, Any]:
        """Every argument by its parameter name."""
        return dict(inspect.signature(self.fn).bind(*self.args, **self.kwargs).arguments)

    def operands(self) -> dict[str, jax.Array]:
        """The array arguments, by name, in order."""
        return {k: v for k, v in self.bound().items() if isinstance(v, (jax.Array, np.ndarray))}

    def static(self) -> dict[str, Any]:
        """The other arguments, by name."""
        return {k: v for k, v in self.bound().items() if k not in self.operands()}

    def call(self, *arrays: Any, **overrides: Any) -> tuple[jax.Array, ...]:
        """The op on ``arrays`` (the operands, in order; default this sample's), all outputs as a
        tuple; ``overrides`` replace keyword arguments (``implementation=``)."""
        names = list(self.operands())
        arrays = arrays or tuple(self.operands().values())
        out = self.fn(**self.static(), **dict(zip(names, arrays, strict=True)), **overrides)
        return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _normal(rng, shape, dtype, scale=1.0, shift=0.0):
    return jnp.asarray((rng.standard_normal(shape) * scale + shift).astype(np.float32), dtype)


def _dyadic(rng, shape, dtype):
    """Multiples of 1/8 in [-8, 8): their float32 sums are exact in any order (dbias)."""
    return jnp.asarray(rng.integers(-64, 64, shape).astype(np.float32) / 8, dtype)


def _scale(value, shape=()):
    return jnp.full(shape, value, jnp.float32)


def _fp8(rng, shape, dtype):
    return jnp.asarray((rng.standard_normal(shape) * 8).astype(np.float32), dtype)


# ------------------------------------------------------------------ the casts


def _quantize(key):
    r = np.random.default_rng(key)
    return {
        "f32-e4m3": Sample(ops.quantize, (_normal(r, (M, N), F32, 300), _scale(0.9), E4M3)),
        "bf16-e5m2-vec1": Sample(
            ops.quantize, (_normal(r, (M, N), BF16, 3e4), _scale(0.5, (1,)), E5M2)
        ),
        "f16-rank3": Sample(ops.quantize, (_normal(r, (M, 3, 5), F16, 100), _scale(2.0), E4M3)),
    }


def _dequantize(key):
    r = np.random.default_rng(key)
    return {
        "e4m3-f32": Sample(ops.dequantize, (_fp8(r, (M, N), E4M3), _scale(1 / 3), F32)),
        "e5m2-bf16": Sample(ops.dequantize, (_fp8(r, (M, N), E5M2), _scale(300.0, (1,)), BF16)),
        "e4m3-f16-rank3": Sample(ops.dequantize, (_fp8(r, (M, 2, 7), E4M3), _scale(0.25), F16)),
    }


def _cast_transpose(key):
    r = np.random.default_rng(key)
    return {
        "f32-e4m3": Sample(ops.cast_transpose, (_normal(r, (M, N), F32, 300), _scale(0.9), E4M3)),
        "bf16-e5m2-rank3": Sample(
            ops.cast_transpose, (_normal(r, (M, 8, 9), BF16, 3e4), _scale(0.5, (1,)), E5M2)
        ),
    }


def _cast_transpose_dbias(key):
    r = np.random.default_rng(key)
    return {
        "f32-e4m3": Sample(
            ops.cast_transpose_dbias, (_dyadic(r, (M, N), F32), _scale(30.0), E4M3), sums=(4,)
        ),
        "bf16-e5m2": Sample(
            ops.cast_transpose_dbias,
            (_dyadic(r, (M, 40), BF16), _scale(1.0, (1,)), E5M2),
            sums=(4,),
        ),
    }


def _grouped_cast_transpose_dbias(key):
    r = np.random.default_rng(key)
    g = _dyadic(r, (M, 3, 8), BF16)
    return {"bf16-e4m3": Sample(grouped_cast_transpose_dbias, (g, _scale(4.0), E4M3), sums=(4,))}


# ------------------------------------------------------------------ the activations

_ACTS = {"gelu": ("gelu",), "swiglu": ("silu", "linear"), "reglu": ("relu", "linear")}


def _act_x(r, acts, dtype):
    return _normal(r, (M, len(acts), N), dtype, 3)


def _activation(key):
    r = np.random.default_rng(key)
    out = {}
    for (name, acts), dt in zip(_ACTS.items(), (F32, BF16, F16), strict=True):
        close = None if name == "reglu" else ACT_CLOSE
        out[name] = Sample(ops.activation, (_act_x(r, acts, dt), acts), close=close)
    return out


def _dactivation(key):
    r = np.random.default_rng(key)
    out = {}
    for (name, acts), dt in zip(_ACTS.items(), (F32, BF16, F16), strict=True):
        close = None if name == "reglu" else ACT_CLOSE
        x, g = _act_x(r, acts, dt), _normal(r, (M, N), dt)
        out[name] = Sample(ops.dactivation, (g, x, acts), close=close)
    return out


def _activation_cast_transpose(key):
    r = np.random.default_rng(key)
    return {
        "gelu-e4m3": Sample(
            ops.activation_cast_transpose,
            (_act_x(r, ("gelu",), F32), _scale(16.0), E4M3, ("gelu",)),
            close=ACT_CLOSE,
        ),
        "swiglu-e5m2": Sample(
            ops.activation_cast_transpose,
            (_act_x(r, _ACTS["swiglu"], BF16), _scale(1.0, (1,)), E5M2, _ACTS["swiglu"]),
            close=ACT_CLOSE,
        ),
    }


def _dactivation_cast_transpose_dbias(key):
    r = np.random.default_rng(key)
    out = {}
    for name, dt, fp8 in (("reglu", F32, E4M3), ("swiglu", BF16, E5M2)):
        acts = _ACTS[name]
        x = _dyadic(r, (M, len(acts), N), dt)
        g = _dyadic(r, (M, N), dt)
        close = None if name == "reglu" else ACT_CLOSE  # relu on dyadic values: exact sums
        out[name] = Sample(
            ops.dactivation_cast_transpose_dbias,
            (g, x, _scale(2.0), fp8, acts),
            close=close,
            sums=(4,),
        )
    return out


# ------------------------------------------------------------------ the norms


def _norm_params(r, h, norm_type):
    gamma = _normal(r, (h,), F32, 0.2, 1.0)
    beta = _normal(r, (h,), F32, 0.2) if norm_type == "layernorm" else None
    return gamma, beta


def _forward(norm_type):
    def build(key):
        r = np.random.default_rng(key)
        out = {}
        for name, shape, dt, zc in (
            ("f32", (M, N), F32, False),
            ("bf16-zc-rank3", (M, 2, 40), BF16, True),
        ):
            gamma, beta = _norm_params(r, shape[-1], norm_type)
            out[name] = Sample(
                ops.norm_forward,
                (_normal(r, shape, dt, 3, 0.5), gamma, beta),
                dict(norm_type=norm_type, epsilon=1e-5, zero_centered_gamma=zc),
                close=NORM_CLOSE,
            )
        return out

    return build


def _forward_fp8(norm_type):
    def build(key):
        r = np.random.default_rng(key)
        out = {}
        for name, shape, dt, fp8, zc in (
            ("f32-e4m3", (M, N), F32, E4M3, False),
            ("bf16-e5m2-zc-rank3", (M, 2, 40), BF16, E5M2, True),
        ):
            gamma, beta = _norm_params(r, shape[-1], norm_type)
            out[name] = Sample(
                ops.norm_forward_fp8,
                (_normal(r, shape, dt, 3, 0.5), gamma, beta, _scale(32.0), fp8),
                dict(norm_type=norm_type, epsilon=1e-5, zero_centered_gamma=zc),
                close=NORM_CLOSE,
            )
        return out

    return build


def _norm_backward(key):
    r = np.random.default_rng(key)
    out = {}
    for norm_type, shape, dt, zc in (
        ("layernorm", (M, N), F32, False),
        ("rmsnorm", (M, 2, 40), BF16, True),
    ):
        x = _normal(r, shape, dt, 3, 0.5)
        gamma, beta = _norm_params(r, shape[-1], norm_type)
        _, mu, rsigma = ops.norm_forward_reference(
            x, gamma, beta, norm_type=norm_type, epsilon=1e-5
        )
        out[norm_type] = Sample(
            ops.norm_backward,
            (_normal(r, shape, dt), x, mu, rsigma, gamma),
            dict(norm_type=norm_type, zero_centered_gamma=zc),
            close=NORM_CLOSE,
            sums=(1, 2),
        )
    return out


# ------------------------------------------------------------------ scaling and the GEMM


def _update_fp8_states(key):
    r = np.random.default_rng(key)
    out = {}
    for name, recipe, backward in (
        ("max", DelayedScaling(amax_history_len=4), False),
        (
            "most_recent-margin2-bwd",
            DelayedScaling(amax_history_len=3, margin=2, amax_compute_algo="most_recent"),
            [True, False] * (M // 2),
        ),
    ):
        hist = jnp.asarray(np.abs(r.standard_normal((M, recipe.amax_history_len))) * 10, F32)
        amaxes = np.abs(r.standard_normal(M)).astype(np.float32) * 100
        amaxes[[1, 5, 9]] = [np.nan, np.inf, 0.0]  # not recorded, not recorded, kept scale
        scales = jnp.asarray(r.uniform(0.5, 2, M), F32)
        out[name] = Sample(
            ops.update_fp8_states,
            (hist, scales, jnp.asarray(amaxes), recipe),
            dict(backward=backward),
            gpu_close={"ulps": 2},  # XLA:GPU's division (DIV_ULPS)
        )
    return out


def _gemm(key):
    r = np.random.default_rng(key)
    a, b = _fp8(r, (M, 32), E4M3), _fp8(r, (N, 32), E4M3)
    b5 = _fp8(r, (N, 32), E5M2)
    bias = _normal(r, (N,), F32)
    return {
        "e4m3-bf16": Sample(ops.gemm, (a, b, _scale(0.5), _scale(0.25)), gpu_close=GEMM_GPU_CLOSE),
        "e4m3xe5m2-f32-bias-split": Sample(
            ops.gemm,
            (a, b5, _scale(0.5, (1,)), _scale(2.0)),
            dict(out_dtype=F32, bias=bias, accumulate="split"),
            gpu_close=GEMM_GPU_CLOSE,
        ),
    }


SAMPLES: dict[str, Callable[[int], dict[str, Sample]]] = {
    "quantize": _quantize,
    "dequantize": _dequantize,
    "cast_transpose": _cast_transpose,
    "cast_transpose_dbias": _cast_transpose_dbias,
    "grouped_cast_transpose_dbias": _grouped_cast_transpose_dbias,
    "activation": _activation,
    "dactivation": _dactivation,
    "activation_cast_transpose": _activation_cast_transpose,
    "dactivation_cast_transpose_dbias": _dactivation_cast_transpose_dbias,
    "layernorm_forward": _forward("layernorm"),
    "rmsnorm_forward": _forward("rmsnorm"),
    "layernorm_forward_fp8": _forward_fp8("layernorm"),
    "rmsnorm_forward_fp8": _forward_fp8("rmsnorm"),
    "norm_backward": _norm_backward,
    "update_fp8_states": _update_fp8_states,
    "gemm": _gemm,
}

NOT_OPDEFS = {"gemm": ("gemm", "fp8jax_gemm")}
"""Ops outside the OpDef registry: (family, FFI target). The GEMM's target is CUDA only."""


def family_and_target(op: str) -> tuple[str, str]:
    """The op's implementation family and FFI target."""
    if op in NOT_OPDEFS:
        return NOT_OPDEFS[op]
    from fp8jax.ops._opdef import registered_ops

    d = registered_ops()[op]
    return d.family, d.target


@functools.cache
def _built(op: str, key: int) -> dict[str, Sample]:
    return SAMPLES[op](key)


def cases() -> list[tuple[str, str]]:
    """Every ``(op, variant)``, for ``pytest.mark.parametrize``."""
    return [(op, v) for op in SAMPLES for v in _built(op, 0)]


def sample(op: str, variant: str, key: int = 0) -> Sample:
    """The variant's sample built from ``key`` (cached)."""
    return _built(op, key)[variant]
