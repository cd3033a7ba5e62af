"""The cuBLASLt GEMM's algorithm choice (cpp/cuda/gemm_autotune.h, used by gemm_cublaslt.cc),
checked on the host through the test-only CUDA extension: the capture rule, the ranking of timed
candidates (timings injected), the once-per-key cache under contention, and the cache key.

What needs a GPU and is not checked here: the heuristic query, the event timing itself and that
XLA runs the initialize stage outside any capture (docs/design.md, "The GEMM under CUDA graphs").
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import pytest
from conftest import load_testing_extension

from fp8jax import _ffi, ops

cuda = _ffi.cuda_extension()
pytestmark = pytest.mark.skipif(
    cuda is None, reason="the CUDA extension is not built (the cuBLASLt handler lives in it)"
)
setup = load_testing_extension(cuda=True) if cuda is not None else None

USE_CACHED, TIME, FIRST_CACHE, FIRST_ONLY = 0, 1, 2, 3


@pytest.mark.parametrize(
    ("cached", "autotune", "capturing", "can_time", "action"),
    [
        (True, True, True, True, USE_CACHED),  # a cached choice is used even in a capture
        (True, False, False, False, USE_CACHED),
        (False, False, False, True, FIRST_CACHE),  # autotuning off: heuristic #0, cached
        (False, False, True, True, FIRST_CACHE),  # a query is host-only: allowed in a capture
        (False, True, True, True, FIRST_ONLY),  # never time inside a capture, nor cache
        (False, True, False, False, FIRST_ONLY),  # no scratch memory or events: no timing
        (False, True, False, True, TIME),
    ],
)
def test_the_capture_rule(cached, autotune, capturing, can_time, action):
    assert setup._autotune_decide(cached, autotune, capturing, can_time) == action


@pytest.mark.parametrize(
    ("ms", "best"),
    [
        ([0.5, 0.3, 0.4], 1),
        ([0.3, 0.5, 0.3], 0),  # a tie goes to the heuristic's order
        ([-1.0, 0.9, 0.2], 2),  # a failed candidate (negative time) is skipped
        ([math.nan, math.inf, 0.7], 2),  # so are non-finite times
        ([-1.0, -1.0], -1),  # every candidate failed
        ([], -1),
    ],
)
def test_the_fastest_candidate(ms, best):
    assert setup._autotune_fastest(ms) == best


def test_tune_times_each_candidate_once_and_falls_back_to_the_first():
    assert setup._autotune_tune([0.4, 0.2, 0.2, 0.9]) == (1, True, [1, 1, 1, 1])
    # nothing ran: the heuristic's first answer, and the caller knows nothing was timed
    assert setup._autotune_tune([-1.0, math.nan]) == (0, False, [1, 1])


def test_the_constants():
    c = setup._cublaslt_constants()
    assert c["autotune_max_candidates"] == 8 and c["autotune_timed_runs"] >= 1


def test_the_cache_computes_each_key_once_under_contention():
    """8 threads ask for 5 keys at once (each computation takes 20 ms): each key is computed
    once, every caller gets its value, and keys do not wait for each other (the run takes about
    5 x 20 ms, not 8 x 5 x 20 ms)."""
    got = setup._autotune_cache_contention([1, 2, 3, 4, 5], 8, 20, [])
    for k in range(1, 6):
        value, computes, found = got[k]
        assert (value, computes, found) == (1000 + k, 1, True)


def test_a_failed_computation_caches_nothing():
    """A key whose tuning failed (no scratch memory, say) is tried again by the next caller and
    never found cached; other keys are unaffected."""
    got = setup._autotune_cache_contention([7, 8], 4, 1, [8])
    assert got[7] == (1007, 1, True)
    value, computes, found = got[8]
    assert value == -1 and computes == 4 and not found


# ------------------------------------------------------------------ the key

M, N, K = 48, 32, 64
BASE = dict(a="float8_e4m3fn", b="float8_e4m3fn", out="bfloat16", m=M, n=N, k=K, has_bias=0,
            fast_accum=1)  # fmt: skip
GELU = dict(out="float8_e4m3fn", bias="bfloat16", epilogue=1, aux="float16", aux_count=M * N,
            d_scale_count=1, amax_count=1)  # fmt: skip


def _key(device=0, align=256, workspace=32 << 20, autotune=True, **change):
    return setup._algo_key(device, align, workspace, autotune, **(BASE | change))


def test_the_key_is_cublaslts_view_of_the_problem():
    c = setup._cublaslt_constants()
    key = _key(b="float8_e5m2", fast_accum=0)
    # cuBLASLt's m, n are our N, M; its A is our b
    assert (key["m"], key["n"], key["k"]) == (N, M, K)
    assert key["a_type"] == c["CUDA_R_8F_E5M2"] and key["b_type"] == c["CUDA_R_8F_E4M3"]
    assert key["c_type"] == key["d_type"] == c["CUDA_R_16BF"]
    assert key["epilogue"] == 0 and not key["bias"] and not key["fast_accum"]
    assert key["autotuned"]


@pytest.mark.parametrize(
    "change",
    [
        dict(device=1),
        dict(align=16),
        dict(workspace=1 << 20),
        dict(autotune=False),  # an untuned choice never stands in for a tuned one
        dict(m=64),
        dict(n=48),
        dict(k=128),
        dict(b="float8_e5m2"),
        dict(out="float16"),
        dict(fast_accum=0),
        dict(has_bias=1, bias="bfloat16", bias_count=N),
        GELU,
        GELU | dict(epilogue=2),
        GELU | dict(bias="float16"),
    ],
    ids=str,
)
def test_every_input_of_the_choice_is_in_the_key(change):
    assert _key(**change) != _key()


def test_the_same_problem_has_the_same_key():
    assert _key() == _key()
    assert _key(**GELU) == _key(**GELU)


# ------------------------------------------------------------------ the switch


def _gemm_line(**options) -> str:
    a = jnp.ones((32, 64), jnp.float8_e4m3fn)
    b = jnp.ones((48, 64), jnp.float8_e4m3fn)
    s = jnp.float32(1.0)
    with ops.gemm_options(**options):
        lowered = jax.jit(lambda x, y: ops.gemm(x, y, s, s)).trace(a, b)
        text = lowered.lower(lowering_platforms=("cuda",)).as_text()
    (line,) = [ln for ln in text.splitlines() if "custom_call @fp8jax_gemm(" in ln]
    return line


def test_the_autotune_attribute_follows_gemm_options():
    assert "autotune = 1" in _gemm_line()
    assert "autotune = 0" in _gemm_line(autotune=False)
