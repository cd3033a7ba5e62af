"""How far a layer's FP8 GEMMs may be from exact float32 sums on the backend under test, and how
such a difference travels through the rest of a layer: elementwise bounds for the tests that
compare a layer with an emulation of its casts (tests/functional/test_dense.py,
tests/functional/test_layernorm_mlp.py).

On CPU the FP8 GEMM is XLA's float32 dot of the dequantized operands (``ops.gemm_reference``), so
a layer equals its emulation to float32 summation order and those tests keep their tight
tolerances. On a GPU the ``"kernel"`` GEMM runs on FP8 tensor cores, which add the products of
each 32-deep MMA in an accumulator of about 14 mantissa bits ("split" accumulation promotes the
partial sums to float32 every few MMAs, "fast" never does). As in tests/ops/test_gemm.py, whose
GPU runs hold it for every dtype combination and both modes up to K = 2048, a GEMM with exact
FP8 operands ``a`` [M, K], ``b`` [K, N] then satisfies, elementwise,

    |gemm(a, b) + bias - (a @ b + bias)| <= (K + 2) * 2**-13 * (|a| @ |b| + |bias|)

(``K - 1`` adds, the scale multiply and the bias add, each off by at most 2**-13 of what it
sums), and the emulation's own float32 dot is within ``(K + 2) * 2**-23`` of the same. A GEMM
that is off moves everything after it: the activation of its output, the FP8 rounding of that
(an element near the midpoint of two FP8 values may round to the other one), the amax of a
current-scaled tensor and so every element's scale, the next GEMM. :class:`Bound` carries an
elementwise radius through those steps: the layer's value lies within ``radius`` of the
emulation's, whatever the tensor cores did within the bound above.
"""

from __future__ import annotations

import dataclasses

import jax
import ml_dtypes
import numpy as np

ON_GPU = jax.default_backend() in ("gpu", "cuda")
TENSOR_CORE_EPS = 2.0**-13  # FP8 MMA accumulation keeps ~14 mantissa bits (tests/ops/test_gemm.py)
EPS32 = float(np.finfo(np.float32).eps)  # 2**-23: twice float32's unit roundoff
# Float32 evaluation of the same function by the layer's kernel and by the emulation's op
# (fused or not, FMA contraction, the order of a few operations): a few ulps, allowed 8.
SLACK = 8 * EPS32

# max |act'| and max |act''| over the reals (``relu'`` jumps at 0: handled apart); e.g. gelu's
# derivative peaks at 1.1290 near x = 1.5, its second derivative at sqrt(2 / pi) = 0.7979 at 0.
LIPSCHITZ = {"gelu": 1.13, "gelu_exact": 1.13, "silu": 1.1, "relu": 1.0, "linear": 1.0}
LIPSCHITZ_DERIVATIVE = {"gelu": 0.8, "gelu_exact": 0.8, "silu": 0.5, "linear": 0.0}


def tensor_cores(implementation: str) -> bool:
    """Whether the layer's FP8 GEMMs run on tensor cores: a GPU and the ``"kernel"`` GEMM (the
    ``"xla"`` one is ``gemm_reference``'s float32 dot there too)."""
    return ON_GPU and implementation == "kernel"


def _f64(v) -> np.ndarray:
    return np.asarray(v, np.float64)


@dataclasses.dataclass(frozen=True)
class Bound:
    """An emulated tensor ``value`` and an elementwise ``radius``: the layer's tensor lies in
    ``[value - radius, value + radius]``. Both float64 numpy arrays."""

    value: np.ndarray
    radius: np.ndarray

    @classmethod
    def exact(cls, value) -> Bound:
        """A tensor the layer computes exactly as the emulation does (an input, a cast of one)."""
        v = _f64(value)
        return cls(v, np.zeros_like(v))

    @property
    def abs_max(self) -> np.ndarray:
        """Elementwise bound on the layer's ``|value|``."""
        return np.abs(self.value) + self.radius

    def like(self, value, radius) -> Bound:
        return Bound(_f64(value), _f64(radius))

    def reshape(self, *shape) -> Bound:
        return Bound(self.value.reshape(*shape), self.radius.reshape(*shape))

    @property
    def T(self) -> Bound:
        return Bound(self.value.T, self.radius.T)

    def __getitem__(self, index) -> Bound:
        return Bound(self.value[index], self.radius[index])

    def times(self, other: Bound, out) -> Bound:
        """The elementwise product, emulated as ``out``."""
        r = np.abs(self.value) * other.radius + self.radius * np.abs(other.value)
        r = r + self.radius * other.radius + SLACK * np.abs(_f64(out))
        return self.like(out, r)

    def apply(self, lipschitz: float, out) -> Bound:
        """A float32 function with that Lipschitz constant, emulated as ``out``."""
        return self.like(out, lipschitz * self.radius + SLACK * np.abs(_f64(out)))

    def sum_rows(self, out) -> Bound:
        """Column sums (a bias gradient), emulated as ``out``: both sides sum in float32."""
        n = self.value.shape[0]
        r = self.radius.sum(0) + (n + 1) * EPS32 * self.abs_max.sum(0)
        return self.like(out, r)


def gemm(a: Bound, b: Bound, out, bias=None) -> Bound:
    """``a @ b (+ bias)`` as an FP8 GEMM on tensor cores, emulated as ``out`` (a float32 dot of
    the emulated operands): the operands' radii carried through the product, plus the
    accumulation bound of the module docstring for the layer's GEMM and for the emulation's."""
    k = a.value.shape[-1]
    r = a.radius @ np.abs(b.value) + np.abs(a.value) @ b.radius + a.radius @ b.radius
    p = a.abs_max @ b.abs_max + (0.0 if bias is None else np.abs(_f64(bias)))
    return Bound(_f64(out), r + (k + 2) * (TENSOR_CORE_EPS + EPS32) * p)


def _round_fp8(v: np.ndarray, fp8) -> np.ndarray:
    """The float32 product ``v`` (float64 here) rounded to ``fp8`` as the casts round it:
    to nearest even, saturating. Monotone, like every step of a cast."""
    m = float(ml_dtypes.finfo(fp8).max)
    v32 = np.clip(v, -m, m).astype(np.float32)
    return v32.astype(fp8).astype(np.float64)


def cast(t: Bound, fp8, out, scale: float | None = None) -> Bound:
    """The FP8 quantize-dequantize of ``t``, emulated as ``out``, with the delayed ``scale``
    (a power of two, as in the tests: exact inverse) or, without one, current scaling (scale
    ``max(fp8) / amax(t)``). A cast is monotone in its input and, for a fixed-sign input, in its
    scale, so the layer's result lies between the casts of the interval's ends at the extreme
    scales that the layer's amax allows; that is exact, an element whose interval holds no
    rounding midpoint keeps its FP8 value."""
    lo, hi = t.value - t.radius, t.value + t.radius
    if scale is None:
        fmax = float(ml_dtypes.finfo(fp8).max)
        tiny = float(np.finfo(np.float32).tiny)
        amax_lo = max(float(np.max(np.maximum(np.abs(t.value) - t.radius, 0.0))), tiny)
        amax_hi = float(np.max(t.abs_max))
        # the float32 division of fmax by the amax, then the float32 inverse of the scale
        s_lo, s_hi = fmax / amax_hi * (1 - EPS32), fmax / amax_lo * (1 + EPS32)
    else:
        s_lo = s_hi = float(scale)
    inv_lo, inv_hi = 1 / s_hi * (1 - EPS32), 1 / s_lo * (1 + EPS32)
    # the float32 product x * scale: between the real products' extremes, widened by a rounding
    p_lo = np.minimum(lo * s_lo, lo * s_hi)
    p_hi = np.maximum(hi * s_lo, hi * s_hi)
    q_lo = _round_fp8(p_lo - np.abs(p_lo) * EPS32, fp8)
    q_hi = _round_fp8(p_hi + np.abs(p_hi) * EPS32, fp8)
    d_lo = np.minimum(q_lo * inv_lo, q_lo * inv_hi)
    d_hi = np.maximum(q_hi * inv_lo, q_hi * inv_hi)
    out = _f64(out)
    r = np.maximum(d_hi - out, out - d_lo) + SLACK * np.abs(out)
    return Bound(out, np.maximum(r, 0.0))


def assert_within(got, want: Bound, rtol: float, atol: float, what: str = "") -> None:
    """``|got - want.value| <= atol + rtol * |want.value| + want.radius`` elementwise: the
    tolerance of a float32 comparison plus what the tensor cores may have moved."""
    got = _f64(got).reshape(want.value.shape)
    err = np.abs(got - want.value)
    tol = atol + rtol * np.abs(want.value) + want.radius
    bad = ~(err <= tol)
    if bad.any():
        i = tuple(np.argwhere(bad)[0])
        raise AssertionError(
            f"{what}: {bad.sum()} of {bad.size} elements off, first at {i}: got {got[i]}, want "
            f"{want.value[i]} +- {want.radius[i]} (+ {atol} + {rtol} * |want|); "
            f"largest radius {want.radius.max():.3g}, largest error {err.max():.3g}"
        )
