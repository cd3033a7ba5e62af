"""Tests of what a recipe says about itself (the protocol of :class:`fp8jax.recipe.Recipe`:
``scaling``, ``keeps_state``, ``block_scaled``, ``block``, ``qparams``) and of
:func:`fp8jax.recipe.check_recipe`."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from fp8jax.recipe import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Format,
    MXFP8BlockScaling,
    QParams,
    Recipe,
    Scaling,
    check_recipe,
)

ROOT = Path(__file__).resolve().parents[1] / "fp8jax"
RECIPE_CLASSES = (DelayedScaling, Float8CurrentScaling, Float8BlockScaling, MXFP8BlockScaling)
RECIPE_NAMES = frozenset(c.__name__ for c in (*RECIPE_CLASSES, Recipe))
ROLES = ("x", "w", "grad")

POW2 = QParams(power_2_scale=True, amax_epsilon=0.0)
F32 = QParams(power_2_scale=False, amax_epsilon=0.0)

# recipe, scaling, keeps_state, block_scaled, blocks (x, w, grad), qparams (x, w, grad)
CASES = [
    (DelayedScaling(), Scaling.DELAYED, True, False, (None,) * 3, (None,) * 3),
    (Float8CurrentScaling(), Scaling.CURRENT, False, False, (None,) * 3, (None,) * 3),
    (Float8BlockScaling(), Scaling.BLOCK, False, True,
     ((1, 128), (128, 128), (1, 128)), (POW2,) * 3),
    (Float8BlockScaling(use_f32_scales=True, x_block_scaling_dim=2, w_block_scaling_dim=1,
                        fp8_quant_bwd_grad=QParams(amax_epsilon=0.5)),
     Scaling.BLOCK, False, True,
     ((128, 128), (1, 128), (1, 128)), (F32, F32, QParams(amax_epsilon=0.5))),
    (MXFP8BlockScaling(), Scaling.MXFP8, False, True, ((1, 32),) * 3, (POW2,) * 3),
    (MXFP8BlockScaling(enable_2d_quantization=True, fp8_format=Format.HYBRID),
     Scaling.MXFP8, False, True, ((1, 32), (32, 32), (1, 32)), (POW2,) * 3),
]  # fmt: skip


@pytest.mark.parametrize("recipe, scaling, keeps_state, block_scaled, blocks, qparams", CASES)
def test_each_recipe_describes_itself(recipe, scaling, keeps_state, block_scaled, blocks, qparams):
    assert recipe.scaling is scaling and type(recipe).scaling is scaling
    assert recipe.keeps_state is keeps_state
    assert recipe.block_scaled is block_scaled
    assert tuple(recipe.block(r) for r in ROLES) == blocks
    assert tuple(recipe.qparams(r) for r in ROLES) == qparams


def test_every_recipe_is_described():
    assert {type(case[0]) for case in CASES} == set(RECIPE_CLASSES)
    assert {case[1] for case in CASES} == set(Scaling)


@pytest.mark.parametrize("cls", RECIPE_CLASSES)
def test_the_description_is_read_only_and_not_a_field(cls):
    recipe = cls()
    assert "scaling" not in {f.name for f in dataclasses.fields(cls)}
    assert not re.search(r"\bscaling=", repr(recipe))
    for name in ("scaling", "keeps_state", "block_scaled"):
        with pytest.raises((dataclasses.FrozenInstanceError, AttributeError)):
            setattr(recipe, name, None)
    assert hash(recipe) == hash(cls()) and recipe == cls()


@pytest.mark.parametrize("cls", RECIPE_CLASSES)
@pytest.mark.parametrize("method", ["block", "qparams"])
def test_roles_are_checked(cls, method):
    with pytest.raises(ValueError, match=rf"{cls.__name__}\.{method}: role must be x, w or grad"):
        getattr(cls(), method)("input")


def test_scaling_is_a_str_enum():
    assert Scaling("mxfp8") is Scaling.MXFP8 and Scaling.DELAYED == "delayed"
    assert repr(Scaling.BLOCK) == "Scaling.BLOCK"
    with pytest.raises(ValueError):
        Scaling("rowwise")


# --- check_recipe -------------------------------------------------------------------------------


@pytest.mark.parametrize("cls", RECIPE_CLASSES)
def test_check_recipe_returns_a_recipe(cls):
    recipe = cls()
    assert check_recipe(recipe, "f: recipe") is recipe
    assert check_recipe(recipe, "f: recipe", default=DelayedScaling()) is recipe


def test_check_recipe_default_stands_for_none():
    default = DelayedScaling(amax_history_len=4)
    assert check_recipe(None, "f: recipe", default=default) is default


@pytest.mark.parametrize("bad", [None, "hybrid", Format.HYBRID, DelayedScaling, {"margin": 0}])
def test_check_recipe_names_the_argument(bad):
    with pytest.raises(TypeError, match=r"^f: my_recipe must be a fp8jax\.recipe\.Recipe .*type"):
        check_recipe(bad, "f: my_recipe")
    if bad is not None:
        with pytest.raises(TypeError, match=r"^f: my_recipe must be None or a fp8jax\.recipe"):
            check_recipe(bad, "f: my_recipe", default=DelayedScaling())


@pytest.mark.parametrize("bad", [Float8CurrentScaling(), MXFP8BlockScaling(), "delayed", None])
def test_check_recipe_keeps_state(bad):
    assert check_recipe(DelayedScaling(), "g: recipe", keeps_state=True) == DelayedScaling()
    with pytest.raises(TypeError, match=r"^g: recipe must be a DelayedScaling \(the recipe that"):
        check_recipe(bad, "g: recipe", keeps_state=True)
