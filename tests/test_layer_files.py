"""One file name per layer in every tier (docs/design.md, "Adding a layer"): a layer's Linen
module, NNX module and config live in files of the same name (``fp8jax/flax/mlp.py``,
``fp8jax/nnx/mlp.py``, ``fp8jax/layers/mlp.py``), and each functional layer's file has a
namesake in the spec, so a new layer is "that file in each tier"."""

from __future__ import annotations

import inspect
from pathlib import Path

import pytest

import fp8jax.flax
import fp8jax.layers
import fp8jax.nnx

ROOT = Path(fp8jax.layers.__file__).resolve().parents[1]

#: Functional modules that are a part of another layer rather than a layer with a spec.
PARTS = {
    "grouped_dense": "the experts' GEMM of moe.py",
    "grouped_rowwise": "grouped_dense's row-wise form",
    "load_balancing": "context parallelism's batch reorder (context_parallel.py)",
}


def _file(obj) -> str:
    return Path(inspect.getfile(obj)).stem


def _configs() -> dict[str, type]:
    """Layer name -> its config class in :mod:`fp8jax.layers` (``DenseGeneralConfig`` ->
    ``DenseGeneral``)."""
    return {
        name.removesuffix("Config"): getattr(fp8jax.layers, name)
        for name in fp8jax.layers.__all__
        if name.endswith("Config")
    }


def _front_end_layers(module) -> dict[str, type]:
    return {n: getattr(module, n) for n in module.__all__ if n in _configs()}


@pytest.mark.parametrize("front_end", [fp8jax.flax, fp8jax.nnx], ids=["linen", "nnx"])
def test_each_layer_lives_in_its_configs_file(front_end):
    layers = _front_end_layers(front_end)
    assert len(layers) >= 7, sorted(layers)
    configs = _configs()
    wrong = {
        name: (_file(cls), _file(configs[name]))
        for name, cls in layers.items()
        if _file(cls) != _file(configs[name])
    }
    assert not wrong, f"layer -> (its file, its config's file): {wrong}"


def test_every_config_has_a_linen_and_an_nnx_layer():
    assert set(_configs()) == set(_front_end_layers(fp8jax.flax))
    assert set(_configs()) == set(_front_end_layers(fp8jax.nnx))


def test_the_attention_core_module_lives_with_attention():
    assert _file(fp8jax.flax.DotProductAttention) == "attention"


def test_every_functional_layer_has_a_namesake_in_the_spec():
    functional = sorted(
        p.stem for p in (ROOT / "functional").glob("*.py") if not p.stem.startswith("_")
    )
    spec = {p.stem for p in (ROOT / "layers").glob("*.py")}
    assert {"dense", "layernorm", "mlp", "moe"} <= set(functional)
    missing = [m for m in functional if m not in spec and m not in PARTS]
    assert not missing, f"functional layers with no file of that name in fp8jax/layers: {missing}"
