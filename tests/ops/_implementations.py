"""One parametrisation for every op test: each test runs once per implementation.

A test module opts in with::

    from _implementations import implementation_fixture, pytest_generate_tests  # noqa: F401

Then every test in it runs under ``fp8jax.ops.implementation("kernel")`` and again under
``"xla"`` (ids ``[kernel]`` / ``[xla]``); a test that takes an ``implementation`` argument gets
the name. A test of the kernel path's own machinery (its batching rule, the emulated CUDA
branch) pins one with ``@only("kernel")``. ``FP8JAX_TEST_IMPLEMENTATIONS=kernel`` runs the
unpinned tests under the kernels only.
"""

from __future__ import annotations

import os

import jax
import pytest

from fp8jax import ops

ALL_IMPLEMENTATIONS = ("kernel", "xla")


def _selected() -> tuple[str, ...]:
    """``FP8JAX_TEST_IMPLEMENTATIONS`` (comma-separated, e.g. ``kernel``) narrows the set: CI's
    newest-JAX leg runs the kernels only (the kernel tests run the references as their oracle)."""
    raw = os.environ.get("FP8JAX_TEST_IMPLEMENTATIONS", "")
    chosen = tuple(name.strip() for name in raw.split(",") if name.strip()) or ALL_IMPLEMENTATIONS
    unknown = sorted(set(chosen) - set(ALL_IMPLEMENTATIONS))
    if unknown:
        raise ValueError(
            f"FP8JAX_TEST_IMPLEMENTATIONS: unknown implementation(s) {unknown}; "
            f"choose from {list(ALL_IMPLEMENTATIONS)}"
        )
    return chosen


IMPLEMENTATIONS = _selected()


def only(*implementations: str):
    """Runs the decorated test under these implementations only."""
    return pytest.mark.parametrize("implementation", implementations, indirect=True)


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "implementation" not in metafunc.fixturenames:
        return
    for mark in metafunc.definition.iter_markers("parametrize"):
        if mark.args and mark.args[0] == "implementation":
            return  # pinned with only(...)
    metafunc.parametrize("implementation", IMPLEMENTATIONS, indirect=True)


@pytest.fixture(name="implementation", autouse=True)
def implementation_fixture(request: pytest.FixtureRequest):
    """The implementation this test runs under (entered around the whole test)."""
    impl = getattr(request, "param", "kernel")
    with ops.implementation(impl):
        yield impl


def reference_bits_promised(implementation: str) -> bool:
    """Whether ``implementation`` on this backend must equal the CPU reference bit for bit.

    The kernels must, on every platform. ``"xla"`` is the reference itself on CPU, but on a GPU XLA
    compiles it with the GPU's own transcendental functions, divisions (``DIV_ULPS``) and reduction
    orders, may keep a value in float32 across a rounding to bf16/f16 that the reference spells out
    (excess precision, so an FP8 code can differ by one), and gives NaN results its canonical NaN
    (0x7fffffff; an FP8 NaN code loses its sign). Tests pass the answer to
    ``_values.assert_matches``, with the tolerance that covers those differences.
    """
    return implementation == "kernel" or jax.default_backend() == "cpu"


# XLA:GPU compiles a float32 division to PTX ``div.full``, within 2 ulps of the correctly rounded
# quotient the reference and the kernels give (benchmarks/implementations.py allows the same).
DIV_ULPS = 2
