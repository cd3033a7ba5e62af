"""The kernel/XLA switch: its API, that it is part of jit's cache key, and what it compiles to.

The numerics of both implementations are checked by the other op test files, which run every
test under each (tests/ops/_implementations.py); per op (lowering, the ``implementation=``
argument, bad values, kernel vs reference) by test_conformance.py; here: the switch itself.
"""

from __future__ import annotations

import threading

import _implementations
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from _implementations import reference_bits_promised
from _shared import normal
from _values import assert_matches

import fp8jax
from fp8jax import DelayedScaling, ops

E4M3 = jnp.float8_e4m3fn
RECIPE = DelayedScaling(amax_history_len=4)
X = jnp.linspace(-600, 600, 16 * 24, dtype=jnp.bfloat16).reshape(16, 24)
S = jnp.float32(0.5)
# cuBLASLt's and XLA's FP8 GEMMs on a GPU: tests/ops/test_gemm.py's whole-matrix allowance for
# each of the two (their accumulation orders differ).
GEMM_REL = 2 * (2.0**-9 + float(np.finfo(np.float32).eps))


def _in_hlo(target: str, hlo: str) -> bool:
    """Whether compiled HLO text calls ``target``."""
    return f'custom_call_target="{target}"' in hlo


# ------------------------------------------------------------------ the context manager


def test_default_is_kernel_and_blocks_nest():
    assert [ops.get_implementation(f) for f in ("cast", "scaling", "gemm")] == ["kernel"] * 3
    with ops.implementation("xla"):
        assert ops.get_implementation("cast") == ops.get_implementation("gemm") == "xla"
        with ops.implementation(gemm="kernel"):  # only gemm changes
            assert ops.get_implementation("cast") == "xla"
            assert ops.get_implementation("gemm") == "kernel"
            with ops.implementation("kernel", scaling="xla"):  # a default resets all others
                assert ops.get_implementation("cast") == "kernel"
                assert ops.get_implementation("scaling") == "xla"
        assert ops.get_implementation("gemm") == "xla"
    assert ops.get_implementation("cast") == "kernel"


def test_the_defaults_are_one_table(monkeypatch):
    """Outside any block each family runs its entry of ``DEFAULTS`` (every family is in it);
    a block's default overrides the table, and naming a family at its table value is the same
    jit key as not naming it."""
    from fp8jax.ops.base import switch as impl

    assert set(impl.FAMILIES) <= set(impl.DEFAULTS)
    assert set(impl.DEFAULTS.values()) <= set(impl.IMPLEMENTATIONS)
    monkeypatch.setitem(impl.DEFAULTS, "cast", "xla")
    assert ops.get_implementation("cast") == "xla" and ops.get_implementation("gemm") == "kernel"
    with ops.implementation("kernel"):
        assert ops.get_implementation("cast") == "kernel"
    with ops.implementation(gemm="xla"):
        assert ops.get_implementation("cast") == "xla"
    with ops.implementation(cast="xla"):
        named = impl._CONTEXT.value
    assert named == impl._CONTEXT.value  # the table's value: not listed, the same key


def test_reusable_decorator_and_restored_after_an_error():
    xla = ops.implementation(cast="xla")

    @xla
    def inside():
        return ops.get_implementation("cast")

    assert inside() == inside() == "xla"
    with pytest.raises(RuntimeError), xla:
        raise RuntimeError("boom")
    assert ops.get_implementation("cast") == "kernel"
    assert repr(xla) == "implementation(cast='xla')"


def test_thread_local():
    seen = []
    with ops.implementation("xla"):
        t = threading.Thread(target=lambda: seen.append(ops.get_implementation("cast")))
        t.start()
        t.join()
    assert seen == ["kernel"]


@pytest.mark.parametrize(
    ("args", "kwargs", "match"),
    [
        (("cuda",), {}, "implementation: default must be 'kernel' or 'xla', got 'cuda'"),
        ((), {"cast": "XLA"}, "implementation: cast must be 'kernel' or 'xla', got 'XLA'"),
        ((), {"gemm": None}, "implementation: gemm must be 'kernel' or 'xla', got None"),
        ((), {"normz": "xla"}, "unknown op family 'normz'; the families are .*cast"),
    ],
)
def test_bad_arguments(args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        ops.implementation(*args, **kwargs)
    with pytest.raises(ValueError, match="get_implementation: unknown op family 'casts'"):
        ops.get_implementation("casts")


def test_update_fp8_state_validates_its_own_implementation_argument():
    one = jnp.float32(1)
    with pytest.raises(ValueError, match="update_fp8_state: implementation must be"):
        ops.update_fp8_state(jnp.zeros(4), one, one, RECIPE, implementation="cuda")


# ------------------------------------------------------------------ what it compiles to


def test_switching_retraces_and_the_same_choice_hits_the_cache():
    traces = []

    @jax.jit
    def f(x, s):
        traces.append(ops.get_implementation("cast"))
        return ops.quantize(x, s, E4M3)

    want = f(X, S)
    with ops.implementation("xla"):
        got = f(X, S)
    f(X, S)  # cached
    with ops.implementation(gemm="kernel"):  # the state outside any block: cached
        f(X, S)
    with ops.implementation(cast="xla"):  # another state (cast only): traced once more
        f(X, S)
        f(X, S)
    assert traces == ["kernel", "xla", "xla"]
    for g, w in zip(got, want, strict=True):
        assert np.asarray(g).tobytes() == np.asarray(w).tobytes()


def test_dense_layer_follows_the_switch_forward_and_backward():
    rng = np.random.default_rng(0)
    x, w, ct = (normal(rng, shape) for shape in ((8, 32), (32, 16), (8, 16)))
    meta = fp8jax.init_fp8_meta(RECIPE)

    @jax.jit
    def step(x, w, probe):
        y, vjp = jax.vjp(
            lambda x, w, p: fp8jax.dense(x, w, None, meta, RECIPE, probe=p), x, w, probe
        )
        return y, vjp(ct)  # output, dx, dw and the observations (the probe's cotangent)

    probe = jnp.zeros(3, jnp.float32)
    results, hlo = {}, {}
    for impl in ("kernel", "xla"):
        with ops.implementation(impl):
            results[impl] = jax.tree.leaves(step(x, w, probe))
            hlo[impl] = step.lower(x, w, probe).compile().as_text()
    assert _in_hlo("fp8jax_cast_transpose", hlo["kernel"])
    assert 'custom_call_target="fp8jax_' not in hlo["xla"]
    # The ops give the same bits; so does the layer, whose only arithmetic outside them is the
    # GEMMs' (a reduction of the caller's, e.g. a loss, may be fused differently around them).
    # On a GPU the GEMMs are cuBLASLt's and XLA's: y, dx and dw are each one GEMM's result.
    *gemms, observed = (np.asarray(a) for a in results["kernel"])
    *xla_gemms, xla_observed = (np.asarray(a) for a in results["xla"])
    exact = reference_bits_promised("xla")
    assert_matches(observed, xla_observed, exact)  # the amaxes of x, w and the gradient
    for k, v in zip(gemms, xla_gemms, strict=True):
        if exact:
            assert_matches(k, v, exact)
        else:
            assert k.shape == v.shape and np.linalg.norm(k - v) <= GEMM_REL * np.linalg.norm(v)


def test_dense_backward_runs_what_the_forward_chose():
    """The layer reads the switch when it is called: a backward traced later, outside the
    block (jax.vjp's function called elsewhere), still runs the same implementation."""
    rng = np.random.default_rng(1)
    x, w, ct = (normal(rng, shape) for shape in ((8, 32), (32, 16), (8, 16)))
    meta = fp8jax.init_fp8_meta(RECIPE)
    with ops.implementation("xla"):
        _, vjp = jax.vjp(
            lambda x, w, p: fp8jax.dense(x, w, None, meta, RECIPE, probe=p),
            x, w, jnp.zeros(3, jnp.float32),
        )  # fmt: skip
    hlo = jax.jit(vjp).lower(ct).compile().as_text()  # traced outside the block
    assert 'custom_call_target="fp8jax_' not in hlo


def test_test_implementations_env_narrows_and_validates(monkeypatch):
    monkeypatch.setenv("FP8JAX_TEST_IMPLEMENTATIONS", "kernel")
    assert _implementations._selected() == ("kernel",)
    monkeypatch.setenv("FP8JAX_TEST_IMPLEMENTATIONS", " xla , kernel ")
    assert _implementations._selected() == ("xla", "kernel")
    monkeypatch.delenv("FP8JAX_TEST_IMPLEMENTATIONS")
    assert _implementations._selected() == ("kernel", "xla")
    monkeypatch.setenv("FP8JAX_TEST_IMPLEMENTATIONS", "kernal")
    with pytest.raises(ValueError, match=r"FP8JAX_TEST_IMPLEMENTATIONS.*kernal"):
        _implementations._selected()


def test_test_variants_env_keeps_each_ops_first_variant_and_validates(monkeypatch):
    import _samples

    monkeypatch.delenv("FP8JAX_TEST_VARIANTS", raising=False)
    every = _samples.cases()
    monkeypatch.setenv("FP8JAX_TEST_VARIANTS", "first")
    first = _samples.cases()
    assert [op for op, _ in first] == list(dict.fromkeys(op for op, _ in every))
    assert set(first) <= set(every) and len(first) < len(every)
    monkeypatch.setenv("FP8JAX_TEST_VARIANTS", "some")
    with pytest.raises(ValueError, match=r"FP8JAX_TEST_VARIANTS.*'some'"):
        _samples.cases()
