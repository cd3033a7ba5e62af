"""``import fp8jax``: what it loads, and ``fp8jax.flax`` reached as an attribute (on first use).

Each check runs in a fresh interpreter: this test process has imported Flax long ago.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

import fp8jax


def _run(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300
    )


def _ok(code: str) -> str:
    proc = _run(code)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def test_import_fp8jax_does_not_import_flax_and_fp8jax_flax_works_after():
    out = _ok(
        """
        import sys
        import fp8jax
        before = sorted(m for m in sys.modules if m.split(".")[0] in ("flax", "optax"))
        print("before", before)
        from fp8jax.flax.dense import DenseGeneral
        assert fp8jax.flax.DenseGeneral is DenseGeneral
        assert fp8jax.flax is sys.modules["fp8jax.flax"]
        print("after", "flax" in sys.modules)
        """
    )
    assert "before []" in out
    assert "after True" in out


def test_fp8jax_flax_attribute_first_then_import_statement_agree():
    _ok(
        """
        import fp8jax
        m = fp8jax.flax  # first access imports the submodule
        import fp8jax.flax
        assert fp8jax.flax is m
        x = fp8jax.flax.DenseGeneral(features=4)
        """
    )


def test_star_import_does_not_import_flax():
    out = _ok(
        """
        import sys
        from fp8jax import *
        print(sorted(m for m in sys.modules if m.split(".")[0] == "flax"))
        """
    )
    assert out.strip() == "[]"


def test_missing_flax_says_how_to_install_it():
    out = _ok(
        """
        import sys
        sys.modules["flax"] = None  # as if Flax were not installed
        import fp8jax
        try:
            fp8jax.flax
        except ModuleNotFoundError as e:
            print("error:", e)
        """
    )
    assert "fp8jax.flax needs the 'flax' package" in out
    assert "pip install 'fp8jax[flax]'" in out


def test_fp8jax_nnx_is_lazy_too_and_names_the_extra():
    out = _ok(
        """
        import sys
        import fp8jax
        assert "flax" not in sys.modules
        layer = fp8jax.nnx.DenseGeneral  # first access imports fp8jax.nnx (and Flax)
        import fp8jax.nnx
        assert fp8jax.nnx.DenseGeneral is layer and "nnx" in dir(fp8jax)
        """
    )
    out = _ok(
        """
        import sys
        sys.modules["flax"] = None  # as if Flax were not installed
        import fp8jax
        try:
            fp8jax.nnx
        except ModuleNotFoundError as e:
            print("error:", e)
        """
    )
    assert "fp8jax.nnx needs the 'flax' package: pip install 'fp8jax[flax]'" in out


def test_dir_lists_flax_but_all_does_not():
    assert "flax" in dir(fp8jax)
    assert "flax" not in fp8jax.__all__  # `from fp8jax import *` must not need Flax
    for name in fp8jax.__all__:
        assert hasattr(fp8jax, name), name


def test_unknown_attribute_is_an_attribute_error():
    assert not hasattr(fp8jax, "no_such_thing")
    with pytest.raises(AttributeError, match="no_such_thing"):
        fp8jax.no_such_thing  # noqa: B018
