"""fp8jax.te.install / uninstall: ``import transformer_engine...`` resolves to fp8jax.te's
modules, only where TransformerEngine is absent; idempotent; undone by uninstall."""

from __future__ import annotations

import importlib
import importlib.machinery
import sys
import types

import pytest

import fp8jax.te


@pytest.fixture
def installed():
    fp8jax.te.install()
    yield
    fp8jax.te.uninstall()


@pytest.mark.parametrize(
    "path",
    [
        "transformer_engine",
        "transformer_engine.common.recipe",
        "transformer_engine.jax",
        "transformer_engine.jax.dense",
        "transformer_engine.jax.layernorm_dense",
        "transformer_engine.jax.layernorm_mlp",
        "transformer_engine.jax.quantize",
        "transformer_engine.jax.cpp_extensions",
        "transformer_engine.jax.sharding",
        "transformer_engine.jax.attention",
        "transformer_engine.jax.flax",
        "transformer_engine.jax.flax.module",
        "transformer_engine.jax.flax.transformer",
    ],
)
def test_te_paths_are_fp8jax_te_modules(installed, path):
    mirrored = "fp8jax.te" + path[len("transformer_engine") :]
    assert importlib.import_module(path) is importlib.import_module(mirrored)


def test_maxtext_imports(installed):
    import transformer_engine.jax
    import transformer_engine.jax.cpp_extensions as tex
    from transformer_engine.common import recipe
    from transformer_engine.jax.attention import SequenceDescriptor
    from transformer_engine.jax.flax.transformer import DotProductAttention
    from transformer_engine.jax.sharding import MeshResource, global_shard_guard

    assert transformer_engine.jax.flax.module.TransformerEngineBase
    assert tex.noop_collective_op_set.is_noop and recipe.NVFP4BlockScaling
    assert SequenceDescriptor and DotProductAttention and MeshResource and global_shard_guard


def test_idempotent_and_undone():
    fp8jax.te.install()
    finders = len(sys.meta_path)
    fp8jax.te.install()
    try:
        assert len(sys.meta_path) == finders and fp8jax.te.is_installed()
        importlib.import_module("transformer_engine.jax.dense")
    finally:
        fp8jax.te.uninstall()
    assert not fp8jax.te.is_installed()
    assert not [n for n in sys.modules if n.split(".")[0] == "transformer_engine"]
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("transformer_engine")
    fp8jax.te.uninstall()  # a second uninstall does nothing


def test_unmirrored_path_is_not_found(installed):
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("transformer_engine.pytorch")


def test_refuses_when_transformer_engine_is_installed(monkeypatch):
    fake = types.ModuleType("transformer_engine")
    fake.__file__ = "/site-packages/transformer_engine/__init__.py"
    monkeypatch.setitem(sys.modules, "transformer_engine", fake)
    with pytest.raises(RuntimeError, match=r"already installed .*site-packages"):
        fp8jax.te.install()
    assert not fp8jax.te.is_installed()


def test_refuses_when_findable(monkeypatch):
    spec = importlib.machinery.ModuleSpec("transformer_engine", None, origin="/te/__init__.py")
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda n, *a: spec if n == "transformer_engine" else real(n, *a),
    )
    with pytest.raises(RuntimeError, match="pip uninstall transformer-engine"):
        fp8jax.te.install()
