"""One conformance suite for every op: what each op promises, checked on its samples (each
op's ``SAMPLES`` in its own test file, collected by _samples.py).

Per op: its FFI target is registered; jit's cache key includes the implementation switch and
only ``"kernel"`` (by context or argument) calls the custom call; a bad ``implementation=``
names the op and a bad argument names the argument. Per variant of its sample: the kernel equals
the reference (``"xla"``) bit for bit on CPU (or within the sample's stated tolerance), two runs
give the same bits, and vmap equals a Python loop. The per-op test files hold what is specific
to each op (special values, edge shapes, its own options); tests/distributed/
test_ops_conformance.py runs the samples on a mesh.
"""

from __future__ import annotations

import functools
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _implementations import reference_bits_promised
from _samples import (
    CUDA_ONLY,
    KERNEL_PENDING,
    NOT_OPDEFS,
    cases,
    family_and_target,
    sample,
    samples,
)
from _values import assert_matches
from conftest import has_cuda

from fp8jax import _ffi, ops
from fp8jax.ops.base.opdef import registered_ops

CASES = cases()
OPS = list(samples())
IMPLS = ("kernel", "xla")


def _first(op: str) -> str:
    return next(v for o, v in CASES if o == op)


def _id(case) -> str:
    return "-".join(case)


def _bits(a) -> bytes:
    return np.asarray(a).tobytes()


def _assert_same_bits(got, want) -> None:
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want, strict=True)):
        assert g.dtype == w.dtype and g.shape == w.shape, (i, g.dtype, w.dtype, g.shape, w.shape)
        assert _bits(g) == _bits(w), f"output {i} differs"


def _cuda_module(fn, args, target) -> str:
    """The StableHLO ``fn`` lowers to for CUDA (lowering needs no GPU)."""
    exported = jax.export.export(
        jax.jit(fn),
        platforms=("cuda",),
        disabled_checks=[jax.export.DisabledSafetyCheck.custom_call(target)],
    )(*args)
    return exported.mlir_module()


# ------------------------------------------------------------------ the registry


def test_every_op_has_a_sample():
    """A new op fails here until its test file (tests/ops/test_<op>.py) has an entry for it in
    its ``SAMPLES``."""
    want = set(registered_ops()) | set(NOT_OPDEFS)
    have = set(samples())
    assert have == want, (
        f"no SAMPLES entry in any tests/ops/test_*.py: {sorted(want - have)}; "
        f"not ops: {sorted(have - want)}"
    )


@pytest.mark.parametrize("op", OPS)
def test_ffi_target_is_registered(op):
    _, target = family_and_target(op)
    cpu = set(_ffi.cpu_extension().registrations())
    assert (target in cpu) == (op not in CUDA_ONLY)  # the GEMMs have no CPU kernel
    cuda = _ffi.cuda_extension()
    if cuda is not None:  # built with nvcc: every op's target, the GEMM's too
        assert (target in cuda.registrations()) == (op not in KERNEL_PENDING)


# ------------------------------------------------------------------ the handlers' checks

# Ops that write one scale_inv and one amax per scale (outputs amax - 1 and amax).
SCALED = [op for op, d in registered_ops().items() if d.max_over]


@pytest.mark.parametrize("op", SCALED)
def test_handler_refuses_scale_outputs_of_another_size(op, monkeypatch):
    """A direct FFI call whose scale_inv or amax result is not one value per scale is an error
    naming them, not a write out of bounds (each op's check is in its family header, cpp/ops/,
    the one handler body of every platform)."""
    _, target = family_and_target(op)
    (amax_at,) = registered_ops()[op].max_over
    real = jax.ffi.ffi_call

    def one_more(name, results, *a, **k):
        if name == target:
            results = list(results)
            for i in (amax_at - 1, amax_at):
                results[i] = jax.ShapeDtypeStruct((results[i].size + 1,), results[i].dtype)
        return real(name, results, *a, **k)

    s = sample(op, _first(op))
    jax.clear_caches()  # traces made with the right result types
    try:
        with monkeypatch.context() as m:
            m.setattr(jax.ffi, "ffi_call", one_more)
            with pytest.raises(
                jax.errors.JaxRuntimeError, match="scale_inv and amax must have one value per scale"
            ):
                jax.block_until_ready(s.call(implementation="kernel"))
    finally:
        jax.clear_caches()  # and none with the wrong ones outlives this test


# ------------------------------------------------------------------ values


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_kernel_matches_reference_and_is_deterministic(case):
    """Kernel vs ``"xla"``: the same bits on CPU, or within the sample's tolerance. Each
    implementation gives the same bits twice, and after a fresh compilation."""
    s = sample(*case)
    args = tuple(s.operands().values())
    outs = {}
    for impl in IMPLS:
        f = functools.partial(s.call, implementation=impl)
        outs[impl] = jax.jit(f)(*args)
        _assert_same_bits(jax.jit(f)(*args), outs[impl])
        _assert_same_bits(jax.jit(lambda *a, f=f: f(*a))(*args), outs[impl])  # a new trace
    tol = dict(s.close or {})
    if jax.default_backend() != "cpu":
        if s.gpu_xla:  # no tolerance holds (the sample says why): determinism only
            return
        tol.update(s.gpu_close or {})
    exact = reference_bits_promised("xla") and not tol
    assert len(outs["kernel"]) == len(outs["xla"])
    for k, x in zip(outs["kernel"], outs["xla"], strict=True):
        assert_matches(k, x, exact, **tol)


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_vmap_equals_a_loop(case):
    """Each element of a vmapped call is its own call (own scale, amax, sums), under both
    implementations: every operand batched, and the first one only (the others shared)."""
    samples = [sample(*case, key=k) for k in (0, 1)]
    per_key = [tuple(s.operands().values()) for s in samples]
    stacked = [jnp.stack(xs) for xs in zip(*per_key, strict=True)]
    first_only = (0,) + (None,) * (len(stacked) - 1)
    for impl in IMPLS:
        f = functools.partial(samples[0].call, implementation=impl)
        exact = reference_bits_promised(impl)
        tol = {} if exact else dict(samples[0].gpu_close or samples[0].close or {})
        got = jax.jit(jax.vmap(f))(*stacked)
        got_first = jax.jit(jax.vmap(f, in_axes=first_only))(stacked[0], *per_key[0][1:])
        for i in range(2):
            want = jax.jit(f)(*per_key[i])
            want_first = jax.jit(f)(per_key[i][0], *per_key[0][1:])
            for g, w, gf, wf in zip(got, want, got_first, want_first, strict=True):
                assert_matches(g[i], w, not tol, **tol)
                assert_matches(gf[i], wf, not tol, **tol)


@pytest.mark.parametrize("op", OPS)
def test_jit_cache_key_includes_the_implementation(op):
    """One jitted function: traced again when the switch changes, cached when it does not."""
    s = sample(op, _first(op))
    family, _ = family_and_target(op)
    traces = []

    @jax.jit
    def f(*args):
        traces.append(ops.get_implementation(family))
        return s.call(*args)

    args = tuple(s.operands().values())
    want = f(*args)
    with ops.implementation(**{family: "xla"}):
        f(*args)
        f(*args)
    _assert_same_bits(f(*args), want)
    assert traces == ["kernel", "xla"]


@pytest.mark.parametrize("op", OPS)
def test_only_kernel_calls_the_custom_call(op):
    """The custom call is in the program under ``"kernel"`` only, chosen by the context or by
    the ``implementation=`` argument, which wins."""
    s = sample(op, _first(op))
    family, target = family_and_target(op)
    args = tuple(s.operands().values())
    on_cuda = jax.default_backend() == "gpu" and has_cuda()
    if op in KERNEL_PENDING:  # no kernel yet: the reference on every platform, no custom call
        for impl in IMPLS:
            with ops.implementation(**{family: impl}):
                cuda = _cuda_module(s.call, args, target)
                compiled = jax.jit(s.call).lower(*args).compile().as_text()
            assert "@fp8jax_" not in cuda and 'custom_call_target="fp8jax_' not in compiled
        return
    for impl in IMPLS:
        with ops.implementation(**{family: impl}):
            cuda = _cuda_module(s.call, args, target)
            compiled = jax.jit(s.call).lower(*args).compile().as_text()
        assert (f"@{target}(" in cuda) == (impl == "kernel")
        # Every op calls its kernel; the GEMMs only on CUDA, elsewhere XLA's dot.
        in_hlo = f'custom_call_target="{target}"' in compiled
        assert in_hlo == (impl == "kernel" and (op not in CUDA_ONLY or on_cuda))
        if impl == "xla":
            assert "@fp8jax_" not in cuda and 'custom_call_target="fp8jax_' not in compiled
    kernel = functools.partial(s.call, implementation="kernel")
    xla = functools.partial(s.call, implementation="xla")
    with ops.implementation("kernel"):
        assert f"@{target}(" not in _cuda_module(xla, args, target)
    with ops.implementation("xla"):
        assert f"@{target}(" in _cuda_module(kernel, args, target)


# ------------------------------------------------------------------ bad arguments


@pytest.mark.parametrize("op", OPS)
def test_bad_implementation_names_the_op(op):
    s = sample(op, _first(op))
    for bad in ("fast", "XLA", 1):
        with pytest.raises(ValueError, match=f"{op}: implementation must be 'kernel' or 'xla'"):
            s.call(implementation=bad)


# A bad value of each non-array argument the ops share (its error must name it).
BAD_STATIC = {
    "fp8_dtype": jnp.int8,
    "out_dtype": jnp.int32,
    "activations": ("tanh",),
    "norm_type": "batchnorm",
    "epsilon": -1.0,
    "amax_reduction": "tensor",
    "accumulate": "slow",
    "recipe": "delayed",
    "backward": "yes",
}


@pytest.mark.parametrize("op", OPS)
def test_bad_arguments_name_the_argument(op):
    """An integer array for any operand, and a bad value for any other argument, raise
    TypeError or ValueError naming that argument, before anything runs."""
    for variant in (v for o, v in CASES if o == op):
        s = sample(op, variant)
        operands = s.operands()
        for name in operands:
            wrong = jnp.float32 if name in s.integer else jnp.int32
            bad = [jnp.zeros(v.shape, wrong) if n == name else v for n, v in operands.items()]
            with pytest.raises((TypeError, ValueError), match=rf"\b{name}\b"):
                s.call(*bad)
        for name in inspect.signature(s.fn).parameters.keys() & BAD_STATIC.keys():
            with pytest.raises((TypeError, ValueError), match=rf"\b{name}\b"):
                s.fn(**{**s.static(), **operands, name: BAD_STATIC[name]})
