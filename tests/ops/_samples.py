"""The conformance suite's shared machinery (tests/ops/test_conformance.py and
tests/distributed/test_ops_conformance.py): :class:`Sample`, the tolerances, small generators,
and :func:`samples`, the table of every op's samples.

Each op's sample lives in its own test file (tests/ops/test_<op>.py), in a module-level dict
``SAMPLES`` that maps the op (every name in :func:`fp8jax.ops.base.opdef.registered_ops`, plus the
GEMM, which is not an OpDef) to a builder ``(key) -> {variant: Sample}``: representative
arguments of the op's public function, one variant per option combination that changes the
kernel's path (FP8 format, input dtype, gated or not, zero-centred gamma, rank, recipe). ``key``
is a seed; a builder gives the same shapes for every key (vmap stacks two). The leading dim of
the first operand is a multiple of 8 (the distributed suite splits it over 8 devices).
:func:`samples` merges those dicts (an op declared in two files is an error), on first use, so
importing this module imports no test file.

A new op touches one file: its sample goes in its own test file's ``SAMPLES``
(``test_every_op_has_a_sample`` fails until it has one), next to the tests that are specific
to it.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from _implementations import DIV_ULPS
from _shared import normal

E4M3, E5M2 = jnp.float8_e4m3fn, jnp.float8_e5m2
F32, BF16, F16 = jnp.float32, jnp.bfloat16, jnp.float16
M, N = 16, 24  # rows (a multiple of 8) and columns of the samples

# Kernel vs reference on CPU where the two are not the same bits: the norms sum a row in another
# order (tests/ops/test_norm.py's tolerance), the activations' tanh/erfc/exp are the C library's
# (tests/ops/test_activation.py's); an FP8 code may then be its neighbour.
NORM_CLOSE = {"ulps": 1, "rtol": 2.0**-7, "atol": 64 * 2.0**-23 * 16}
ACT_CLOSE = {"ulps": 1, "rtol": 2.0**-7, "atol": 16 * 2.0**-23 * 64}
# cuBLASLt's and XLA's FP8 GEMMs on a GPU: the accumulation orders differ, so two float32 sums a
# hair apart can round to neighbouring bfloat16 values (one step: up to 2**-7 of the value, more
# than a relative bound of 2**-8 allows; an H100 showed 10 of 384 such pairs).
# Block casts with float32 (not power-of-two) scales, "xla" on a GPU: its scale and inverse are two
# divisions (each within DIV_ULPS), and a code may then be its neighbour.
F32_SCALE_GPU_CLOSE = {"ulps": 2 * DIV_ULPS}
GEMM_GPU_CLOSE = {"ulps": 1, "rtol": 2 * (2.0**-9 + 2.0**-23), "atol": 1e-3}


@dataclasses.dataclass(frozen=True)
class Sample:
    """One call of an op's public function: ``fn(*args, **kwargs)``.

    ``close``: ``assert_matches`` tolerance of kernel vs reference on CPU (``None``: the same
    bits). ``gpu_close``: added on a GPU, where ``"xla"`` is not the reference's bits.
    ``gpu_xla``: why no tolerance relates ``"xla"`` on a GPU to the kernel (a power-of-two block
    scale that XLA:GPU's own transcendentals can move a step, halving a whole block's codes); the
    conformance suite then checks only each implementation's determinism there, and the kernel's
    bits are tests/ops/test_host_cuda.py's. ``sums``: outputs summed over the rows (dbias,
    dgamma), which a mesh adds in another order. ``integer``: operands that are integer arrays
    by design (a grouped GEMM's ``group_sizes``): the bad-argument check gives them floats.
    """

    fn: Callable[..., Any]
    args: tuple[Any, ...]
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    close: Mapping[str, float] | None = None
    gpu_close: Mapping[str, float] | None = None
    gpu_xla: str | None = None
    sums: tuple[int, ...] = ()
    integer: tuple[str, ...] = ()

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


Builder = Callable[[int], dict[str, Sample]]
"""A sample builder: ``(key) -> {variant: Sample}``."""


def dyadic(rng, shape, dtype):
    """Multiples of 1/8 in [-8, 8): their float32 sums are exact in any order (dbias)."""
    return jnp.asarray(rng.integers(-64, 64, shape).astype(np.float32) / 8, dtype)


def scale_of(value, shape=()):
    """A float32 scale: ``value`` of ``shape`` (``()`` or ``(1,)``)."""
    return jnp.full(shape, value, jnp.float32)


def fp8_codes(rng, shape, dtype):
    """FP8 codes of ``dtype``: normal values times 8, rounded to the format."""
    return normal(rng, shape, dtype, 8.0)


NOT_OPDEFS = {
    "gemm": ("gemm", "fp8jax_gemm"),
    "grouped_gemm": ("gemm", "fp8jax_grouped_gemm"),
}
"""Ops outside the OpDef registry (their split is decided from several operands): (family, FFI
target)."""

CUDA_ONLY = {"gemm"}
"""Ops whose FFI target is CUDA only (on CPU their kernel path is XLA's compilation of the
reference)."""

KERNEL_PENDING: set[str] = set()
"""Ops with no kernel on any platform yet: their kernel path runs the reference everywhere, so
no program calls their target (none today; the ragged grouped GEMM was, until its kernels)."""


def family_and_target(op: str) -> tuple[str, str]:
    """The op's implementation family and FFI target."""
    if op in NOT_OPDEFS:
        return NOT_OPDEFS[op]
    from fp8jax.ops.base.opdef import registered_ops

    d = registered_ops()[op]
    return d.family, d.target


@functools.cache
def samples() -> dict[str, Builder]:
    """Every op's sample builder: the ``SAMPLES`` of every tests/ops/test_*.py that has one.

    Each file with a top-level ``SAMPLES`` is imported by its bare name (tests/ops is on
    ``sys.path``, see tests/conftest.py), the name pytest imports it under, so these are the same
    module objects pytest collects; the other test files are not imported. Cached: built on the
    first call, not when this module is imported. Ordered as
    :func:`fp8jax.ops.base.opdef.registered_ops`, then :data:`NOT_OPDEFS`, then any other name.
    """
    found: dict[str, tuple[str, Builder]] = {}
    for path in sorted(Path(__file__).parent.glob("test_*.py")):
        if not re.search(r"^SAMPLES\b", path.read_text(encoding="utf-8"), re.MULTILINE):
            continue
        builders = getattr(importlib.import_module(path.stem), "SAMPLES", None)
        if not isinstance(builders, Mapping):
            raise TypeError(f"{path.name}: SAMPLES must be a dict, op -> sample builder")
        for op, build in builders.items():
            if op in found:
                raise RuntimeError(
                    f"op {op!r} has a sample in both {found[op][0]}.py and {path.name}; "
                    "an op's sample lives in exactly one test file"
                )
            found[op] = (path.stem, build)
    from fp8jax.ops.base.opdef import registered_ops

    rank = {op: i for i, op in enumerate([*registered_ops(), *NOT_OPDEFS])}
    return {op: found[op][1] for op in sorted(found, key=lambda op: rank.get(op, len(rank)))}


@functools.cache
def _built(op: str, key: int) -> dict[str, Sample]:
    return samples()[op](key)


def cases() -> list[tuple[str, str]]:
    """Every ``(op, variant)``, for ``pytest.mark.parametrize``.

    ``FP8JAX_TEST_VARIANTS=first`` keeps each op's first variant only: CI's oldest-JAX leg, where
    what moves with the JAX version (the FFI binding, the batching and partitioning rules) is the
    op's, and the variants' dtypes and shapes are the newest leg's to cover."""
    chosen = os.environ.get("FP8JAX_TEST_VARIANTS", "all")
    if chosen not in ("all", "first"):
        raise ValueError(f"FP8JAX_TEST_VARIANTS: {chosen!r}; choose 'all' (default) or 'first'")
    keep = 1 if chosen == "first" else None
    return [(op, v) for op in samples() for v in list(_built(op, 0))[:keep]]


def sample(op: str, variant: str, key: int = 0) -> Sample:
    """The variant's sample built from ``key`` (cached)."""
    return _built(op, key)[variant]
