"""Tests of fp8jax.autocast: the FP8 switch, recipe nesting, threads, and jit retracing."""

import doctest
import importlib
import threading

import jax
import jax.numpy as jnp
import pytest

from fp8jax.autocast import autocast, fp8_autocast, get_recipe, is_fp8_enabled
from fp8jax.recipe import DelayedScaling, Float8CurrentScaling, Format

# fp8jax.autocast (the function) shadows the submodule as a package attribute.
autocast_mod = importlib.import_module("fp8jax.autocast")


def test_default_state():
    assert is_fp8_enabled() is False
    assert get_recipe() is None
    assert autocast_mod.current_state() == autocast_mod.AutocastState(False, None)


def test_enabled_with_default_recipe():
    with autocast():
        assert is_fp8_enabled() is True
        assert get_recipe() == DelayedScaling()
    assert is_fp8_enabled() is False
    assert get_recipe() is None


def test_disabled_still_records_recipe():
    r = Float8CurrentScaling(fp8_format=Format.E4M3)
    with autocast(enabled=False, recipe=r):
        assert is_fp8_enabled() is False
        assert get_recipe() is r


def test_nesting_restores_outer_state():
    a = DelayedScaling(margin=1)
    b = DelayedScaling(margin=2)
    with autocast(recipe=a):
        assert get_recipe() is a
        with autocast(enabled=False, recipe=b):
            assert (is_fp8_enabled(), get_recipe()) == (False, b)
            with autocast(recipe=a):
                assert (is_fp8_enabled(), get_recipe()) == (True, a)
            assert (is_fp8_enabled(), get_recipe()) == (False, b)
        assert (is_fp8_enabled(), get_recipe()) == (True, a)
    assert (is_fp8_enabled(), get_recipe()) == (False, None)


def test_exception_restores_outer_state():
    a = DelayedScaling(margin=1)
    b = DelayedScaling(margin=2)
    with autocast(recipe=a):
        with pytest.raises(RuntimeError, match="boom"):
            with autocast(enabled=False, recipe=b):
                raise RuntimeError("boom")
        assert (is_fp8_enabled(), get_recipe()) == (True, a)
    assert (is_fp8_enabled(), get_recipe()) == (False, None)


def test_context_manager_reusable_and_decorator():
    r = DelayedScaling(margin=3)
    cm = autocast(recipe=r)
    with cm:
        with cm:
            assert get_recipe() is r
        assert get_recipe() is r
    assert get_recipe() is None
    with cm:
        assert is_fp8_enabled()

    @autocast(recipe=r)
    def inside():
        return is_fp8_enabled(), get_recipe()

    assert inside() == (True, r)
    assert get_recipe() is None


def test_fp8_autocast_te_names():
    r = DelayedScaling(amax_history_len=16)
    with fp8_autocast(enabled=True, fp8_recipe=r):
        assert (is_fp8_enabled(), get_recipe()) == (True, r)
    with fp8_autocast():  # TE's defaults: disabled, default recipe
        assert is_fp8_enabled() is False
        assert get_recipe() == DelayedScaling()
    assert get_recipe() is None


@pytest.mark.parametrize("factory", [autocast, fp8_autocast])
@pytest.mark.parametrize("enabled", [1, "yes", None, jnp.array(True)])
def test_bad_enabled(factory, enabled):
    with pytest.raises(TypeError, match="enabled must be a bool"):
        factory(enabled=enabled)


@pytest.mark.parametrize(
    "bad_recipe", [Format.HYBRID, "DelayedScaling", {"margin": 0}, DelayedScaling]
)
def test_bad_recipe(bad_recipe):
    with pytest.raises(TypeError, match=r"recipe must be None or .*Recipe.*of type"):
        autocast(recipe=bad_recipe)
    with pytest.raises(TypeError, match=r"fp8_recipe must be None or"):
        fp8_autocast(enabled=True, fp8_recipe=bad_recipe)
    assert get_recipe() is None


def test_errors_raised_at_call_not_at_enter():
    with pytest.raises(TypeError):
        autocast(enabled="no")  # never entered


def test_thread_isolation():
    r = DelayedScaling(margin=5)
    entered = threading.Event()
    release = threading.Event()
    seen_in_thread = []

    def worker():
        with autocast(recipe=r):
            seen_in_thread.append((is_fp8_enabled(), get_recipe()))
            entered.set()
            release.wait(timeout=30)
        seen_in_thread.append((is_fp8_enabled(), get_recipe()))

    main_recipe = Float8CurrentScaling()
    with autocast(enabled=False, recipe=main_recipe):
        t = threading.Thread(target=worker)
        t.start()
        try:
            assert entered.wait(timeout=30)
            # The other thread is inside its autocast now; this thread is unaffected.
            assert (is_fp8_enabled(), get_recipe()) == (False, main_recipe)
        finally:
            release.set()
            t.join(timeout=30)
    assert not t.is_alive()
    assert seen_in_thread == [(True, r), (False, None)]
    assert (is_fp8_enabled(), get_recipe()) == (False, None)


def test_no_stale_traces():
    """A jitted function reading the autocast state retraces when the state changes."""
    n_traces = 0

    @jax.jit
    def f(x):
        nonlocal n_traces
        n_traces += 1
        if is_fp8_enabled():
            return x * (2.0 ** get_recipe().margin)
        return x

    x = jnp.float32(3.0)
    a = DelayedScaling(margin=1)
    b = DelayedScaling(margin=3)

    with autocast(recipe=a):
        assert float(f(x)) == 6.0
    assert n_traces == 1
    with autocast(recipe=b):
        assert float(f(x)) == 24.0
    assert n_traces == 2
    with autocast(enabled=False, recipe=a):
        assert float(f(x)) == 3.0
    assert n_traces == 3
    with autocast(recipe=DelayedScaling(margin=1)):  # equal to a: cache hit
        assert float(f(x)) == 6.0
    assert n_traces == 3
    assert float(f(x)) == 3.0  # outside any autocast: a new state
    assert n_traces == 4
    assert float(f(x)) == 3.0
    assert n_traces == 4


def test_autocast_inside_jit():
    """Entered inside a jitted function, the state is seen by code traced inside the block."""

    @jax.jit
    def inner(x):
        return x * (2.0 ** get_recipe().margin) if is_fp8_enabled() else x

    @jax.jit
    def outer(x):
        with autocast(recipe=DelayedScaling(margin=2)):
            y = inner(x)
        return y + inner(x)

    assert float(outer(jnp.float32(1.0))) == 5.0
    assert get_recipe() is None


def test_docstring_examples():
    result = doctest.testmod(autocast_mod, verbose=False)
    assert result.attempted > 0
    assert result.failed == 0


# ---------------------------------------------------------------- mesh_resource (TE porting)


def test_empty_mesh_resource_is_accepted_by_both_spellings():
    from fp8jax.sharding import MeshResource

    with autocast(enabled=True, recipe=DelayedScaling(), mesh_resource=MeshResource()):
        assert is_fp8_enabled()
    with fp8_autocast(enabled=True, fp8_recipe=None, mesh_resource=None):
        assert get_recipe() == DelayedScaling()


@pytest.mark.parametrize("fn", [autocast, fp8_autocast])
def test_mesh_resource_with_axes_points_at_axis_rules(fn):
    from fp8jax.sharding import MeshResource

    with pytest.raises(ValueError, match=r"mesh_resource=.*axis_rules\(\)"):
        fn(True, None, MeshResource(dp_resource="data", tp_resource="model"))
    with pytest.raises(TypeError, match="mesh_resource must be None or a"):
        fn(True, None, {"dp_resource": "data"})
