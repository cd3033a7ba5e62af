"""Tests of what a recipe says about itself (the protocol of :class:`fp8jax.recipe.Recipe`:
``scaling``, ``keeps_state``, ``per_tensor``, ``block_scaled``, ``block``, ``qparams``,
``fp8_gemm``), of
:func:`fp8jax.recipe.check_recipe`, and that no module of fp8jax but ``fp8jax/recipe.py`` tests
a recipe's type (it asks the recipe instead; docs/design.md, "Adding a recipe")."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path
from typing import ClassVar

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import fp8jax
from fp8jax.flax import DenseGeneral
from fp8jax.recipe import (
    DelayedScaling,
    Float8BlockScaling,
    Float8CurrentScaling,
    Float8RowwiseScaling,
    Format,
    MXFP8BlockScaling,
    QParams,
    Recipe,
    Scaling,
    check_recipe,
)

ROOT = Path(__file__).resolve().parents[1] / "fp8jax"
RECIPE_CLASSES = (
    DelayedScaling,
    Float8CurrentScaling,
    Float8BlockScaling,
    MXFP8BlockScaling,
    Float8RowwiseScaling,
)
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
    (Float8RowwiseScaling(), Scaling.ROWWISE, False, False, (None,) * 3, (POW2,) * 3),
    (Float8RowwiseScaling(power_2_scale=False, wgrad_high_precision=True),
     Scaling.ROWWISE, False, False, (None,) * 3, (F32,) * 3),
]  # fmt: skip


@pytest.mark.parametrize("recipe, scaling, keeps_state, block_scaled, blocks, qparams", CASES)
def test_each_recipe_describes_itself(recipe, scaling, keeps_state, block_scaled, blocks, qparams):
    assert recipe.scaling is scaling and type(recipe).scaling is scaling
    assert recipe.keeps_state is keeps_state
    assert recipe.block_scaled is block_scaled
    assert tuple(recipe.block(r) for r in ROLES) == blocks
    assert tuple(recipe.qparams(r) for r in ROLES) == qparams
    assert recipe.per_tensor is (scaling in (Scaling.DELAYED, Scaling.CURRENT))
    hp_wgrad = getattr(recipe, "wgrad_high_precision", False)
    assert (recipe.fp8_gemm("fprop"), recipe.fp8_gemm("dgrad")) == (True, True)
    assert recipe.fp8_gemm("wgrad") is not hp_wgrad


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
    assert Scaling("rowwise") is Scaling.ROWWISE
    assert repr(Scaling.BLOCK) == "Scaling.BLOCK"
    with pytest.raises(ValueError):
        Scaling("columnwise")


# --- a recipe the package has never seen ------------------------------------------------------


@dataclasses.dataclass(frozen=True, kw_only=True)
class OutsideCurrent(Recipe):
    """A recipe defined outside fp8jax, of an existing kind: current scaling, E4M3 forward."""

    scaling: ClassVar[Scaling] = Scaling.CURRENT
    fp8_format: Format = Format.HYBRID
    margin: int = 1


@dataclasses.dataclass(frozen=True, kw_only=True)
class OutsideMXFP8(Recipe):
    """A block-scaled one: MXFP8's 1 x 32 blocks, 32 x 32 for the weights."""

    scaling: ClassVar[Scaling] = Scaling.MXFP8
    fp8_format: Format = Format.E4M3

    def block(self, role: str) -> tuple[int, int]:
        super().block(role)
        return (32, 32) if role == "w" else (1, 32)

    def qparams(self, role: str) -> QParams:
        super().qparams(role)
        return QParams(power_2_scale=True)


@dataclasses.dataclass(frozen=True, kw_only=True)
class OutsideRowwise(Recipe):
    """A row-wise one: float32 scales with an epsilon, E5M2 gradients, the wgrad in high
    precision."""

    scaling: ClassVar[Scaling] = Scaling.ROWWISE
    fp8_format: Format = Format.HYBRID

    def qparams(self, role: str) -> QParams:
        super().qparams(role)
        return QParams(power_2_scale=False, amax_epsilon=0.5)

    def fp8_gemm(self, gemm: str) -> bool:
        return super().fp8_gemm(gemm) and gemm != "wgrad"


@pytest.mark.parametrize(
    "outside, twin",
    [
        (OutsideCurrent(), Float8CurrentScaling(margin=1)),
        (OutsideMXFP8(), MXFP8BlockScaling(enable_2d_quantization=True)),
        (OutsideRowwise(), Float8RowwiseScaling(
            fp8_format=Format.HYBRID, power_2_scale=False, amax_epsilon=0.5,
            wgrad_high_precision=True)),
    ],
)  # fmt: skip
def test_a_recipe_defined_outside_the_package_runs_as_its_twin(outside, twin):
    """The protocol is all the package reads: a new recipe of an existing kind needs no change
    outside fp8jax/recipe.py (docs/design.md, "Adding a recipe")."""
    kx, kk = jax.random.split(jax.random.key(0))
    x = jax.random.normal(kx, (32, 64), jnp.float32) * 3
    kernel = jax.random.normal(kk, (64, 64), jnp.float32) * 0.1

    def loss_and_grads(recipe):
        f = lambda x, kernel: jnp.sum(fp8jax.dense(x, kernel, recipe=recipe) ** 2)
        return jax.value_and_grad(f, argnums=(0, 1))(x, kernel)

    got, want = loss_and_grads(outside), loss_and_grads(twin)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    def linen(recipe):
        with fp8jax.autocast(enabled=True, recipe=recipe):
            variables = DenseGeneral(features=64).init(jax.random.key(1), x)
            return set(variables), DenseGeneral(features=64).apply(variables, x)

    (got_collections, got), (want_collections, want) = linen(outside), linen(twin)
    assert got_collections == want_collections == {"params"}  # no FP8 state
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


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


@pytest.mark.parametrize(
    "bad", [Float8CurrentScaling(), MXFP8BlockScaling(), Float8RowwiseScaling(), "delayed", None]
)
def test_check_recipe_keeps_state(bad):
    assert check_recipe(DelayedScaling(), "g: recipe", keeps_state=True) == DelayedScaling()
    with pytest.raises(TypeError, match=r"^g: recipe must be a DelayedScaling \(the recipe that"):
        check_recipe(bad, "g: recipe", keeps_state=True)


# --- nothing outside fp8jax/recipe.py tests a recipe's type -------------------------------------


def _names(node: ast.AST) -> set[str]:
    """The names (plain or the last part of a dotted one) anywhere in ``node``."""
    found = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            found.add(n.id)
        elif isinstance(n, ast.Attribute):
            found.add(n.attr)
    return found


def recipe_type_tests(source: str) -> list[int]:
    """Lines of ``source`` that test a value against a recipe class: ``isinstance`` or
    ``issubclass`` with one as the second argument, or ``type(v)`` compared with one."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id in ("isinstance", "issubclass")
            and len(node.args) == 2
            and _names(node.args[1]) & RECIPE_NAMES
        ):
            lines.append(node.lineno)
        elif isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            calls_type = any(
                isinstance(s, ast.Call) and isinstance(s.func, ast.Name) and s.func.id == "type"
                for s in sides
            )
            if calls_type and any(_names(s) & RECIPE_NAMES for s in sides):
                lines.append(node.lineno)
    return lines


def test_the_scan_finds_type_tests():
    source = (
        "from fp8jax import recipe\n"
        "a = isinstance(r, DelayedScaling)\n"
        "b = isinstance(r, (Float8BlockScaling, recipe.MXFP8BlockScaling))\n"
        "c = type(r) is Float8CurrentScaling\n"
        "d = issubclass(type(r), Recipe)\n"
        "e = isinstance(r.amax_compute_algo, str) or isinstance(r, Format)\n"
    )
    assert recipe_type_tests(source) == [2, 3, 4, 5]


def test_no_module_but_recipe_tests_a_recipe_type():
    found = {
        f"{path.relative_to(ROOT.parent)}:{line}"
        for path in sorted(ROOT.rglob("*.py"))
        if path != ROOT / "recipe.py"
        for line in recipe_type_tests(path.read_text())
    }
    assert len(found) == 0, (
        f"{len(found)} type tests of recipes outside fp8jax/recipe.py: {sorted(found)}; ask the "
        "recipe (Recipe.scaling, keeps_state, block_scaled, block, qparams) or validate an "
        "argument with fp8jax.recipe.check_recipe"
    )


def test_only_a_row_wise_wgrad_may_leave_fp8():
    """``fp8_gemm`` False is honoured for the wgrad under row-wise scaling only; anything else
    is refused when the layer resolves the recipe, never silently run in FP8."""

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class HighPrecisionDgrad(Recipe):
        scaling: ClassVar[Scaling] = Scaling.CURRENT
        fp8_format: Format = Format.HYBRID

        def fp8_gemm(self, gemm: str) -> bool:
            return gemm != "dgrad"

    x, w = jnp.ones((32, 64)), jnp.ones((64, 64))
    with pytest.raises(ValueError, match=r"HighPrecisionDgrad runs the dgrad GEMM\(s\) in high"):
        fp8jax.dense(x, w, recipe=HighPrecisionDgrad())
