"""The package's import layering (docs/design.md, Layers): no import cycle between fp8jax's
modules, each module imports only from its own layer or the layers below it, and none uses
private Flax or JAX API.

Every module of ``fp8jax`` is parsed with ``ast`` (nothing is imported); an edge is an import
of another fp8jax module, at module level or inside a function: an import deferred into a
function is how a cycle is usually papered over (``dense`` and ``_fp8_gemm`` imported each
other that way), so it counts, except the few in :data:`DEFERRED` (each with its reason). An
import of a package (``from fp8jax import ops``) is an edge to its ``__init__``; the implicit
import of a module's parent packages is not an edge. ``fp8jax/__init__.py`` loads ``fp8jax.flax``
and ``fp8jax.nnx`` on first attribute access with ``importlib`` (so ``import fp8jax`` needs no
Flax): not an import statement, so not an edge.
"""

from __future__ import annotations

import ast
import importlib
import re
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "fp8jax"

#: The layers, lowest first; a module belongs to the layer of the longest prefix that names it
#: (a prefix is a module or a package with everything below it; ``fp8jax`` names only
#: ``fp8jax/__init__.py``).
LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    # the extensions' loader and what asks it about the device
    ("bindings", ("fp8jax._ffi", "fp8jax._support")),
    # recipes are plain data (formats, margins, fp8_max) that the ops' checks read; the formats
    # and the recipe protocol (Recipe, Scaling, QParams, the field checks) have modules of their
    # own, exported by fp8jax.recipe
    ("recipe", ("fp8jax._formats", "fp8jax._recipe_protocol", "fp8jax.recipe")),
    # the ops, one package per family (fp8jax/ops/<family>/), lowest first: the OpDef machinery,
    # the mesh plans, the kernel/XLA switch and the shared checks; the per-tensor casts; the
    # block-scaled casts; the norms, activations and fused casts; the GEMMs; the FP8 attention
    ("ops base", ("fp8jax.ops.base",)),
    ("ops casts", ("fp8jax.ops.casts",)),
    ("ops block", ("fp8jax.ops.block",)),
    ("ops fused", ("fp8jax.ops.fused",)),
    ("ops gemms", ("fp8jax.ops.gemms",)),
    # FP8 attention on FP8 codes (cuDNN's through XLA, and its reference)
    ("ops attention", ("fp8jax.ops.attention",)),
    ("ops", ("fp8jax.ops",)),  # fp8jax/ops/__init__.py: every family's public names
    # the FP8 state and its update (ops.scaling), its update on variable trees (framework
    # neutral, for fp8jax.flax and fp8jax.nnx), the autocast context, TE's MeshResource
    (
        "state, context",
        ("fp8jax.state", "fp8jax._train_math", "fp8jax.autocast", "fp8jax.sharding"),
    ),
    # what every FP8 layer is built from: setup, casts, GEMM forward/backward, custom_vjp wiring
    (
        "layer core",
        (
            "fp8jax.functional._core",
            "fp8jax.functional._vjp",
            "fp8jax.functional.layernorm",
            "fp8jax.functional._exchange",
        ),
    ),
    # the functional layers (fp8jax/functional/, one file per layer, as in every tier) and the
    # rotary embedding
    ("functional layers", ("fp8jax.functional", "fp8jax.rotary")),
    # the framework-neutral layer spec both Flax front-ends are built on (no Flax module)
    ("layer spec", ("fp8jax.layers",)),
    # optax transforms with FP8 state (the block-scaling rules of ops; no layer, no Flax)
    ("optim", ("fp8jax.optim",)),
    ("package", ("fp8jax",)),  # fp8jax/__init__.py: the public functional API
    # the two front-ends; neither imports the other (test_the_front_ends_are_independent)
    ("flax", ("fp8jax.flax",)),
    ("nnx", ("fp8jax.nnx",)),
    # TransformerEngine's JAX API at its module paths, adapters over the layers and fp8jax.flax
    ("te", ("fp8jax.te",)),
)

#: Imports inside a function that are allowed although they go against the rules, and why.
DEFERRED: dict[tuple[str, str], str] = {
    ("fp8jax.ops.base.opdef", "fp8jax.ops"): (
        "registered_ops() (read by tests) imports the ops package so that every op module has "
        "declared its OpDef; called after all modules are loaded"
    ),
}


def _modules() -> dict[str, Path]:
    mods = {}
    for path in sorted(ROOT.rglob("*.py")):
        parts = ("fp8jax", *path.relative_to(ROOT).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    return mods


MODULES = _modules()


def _target(name: str) -> str | None:
    """The fp8jax module ``name`` is (or is in: ``fp8jax.functional.dense.dense`` ->
    ``fp8jax.functional.dense``)."""
    while name not in MODULES and "." in name:
        name = name.rsplit(".", 1)[0]
    return name if name in MODULES else None


def _imports(module: str) -> list[tuple[str, int, bool]]:
    """``(imported fp8jax module, line, inside a function)`` for each import in ``module``."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(), str(path))
    in_function: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            in_function.update(id(n) for n in ast.walk(node) if n is not node)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, up level - 1
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*up, base] if base else up)
            names = [f"{base}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            target = _target(name) if name.split(".")[0] == "fp8jax" else None
            edge = (target, node.lineno, id(node) in in_function)
            if target is not None and target != module and edge not in found:
                found.append(edge)
    return found


def _layer(module: str) -> int:
    best, best_len = None, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            inside = module.startswith(p + ".") and p != "fp8jax"
            if (module == p or inside) and len(p) > best_len:
                best, best_len = i, len(p)
    assert best is not None, f"{module} is in no layer: add it to LAYERS in {__file__}"
    return best


def _edges() -> dict[str, list[tuple[str, int, bool]]]:
    return {m: [e for e in _imports(m) if not (e[2] and (m, e[0]) in DEFERRED)] for m in MODULES}


def _where(module: str, line: int) -> str:
    return f"{MODULES[module].relative_to(ROOT.parent)}:{line}"


def _cycle(graph: dict[str, list[tuple[str, int, bool]]]) -> str | None:
    """One import cycle of ``graph``, each import with its file and line; ``None`` if none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[tuple[str, int]] = []

    def visit(m: str) -> str | None:
        state[m] = 1
        for target, line, _ in graph.get(m, ()):
            path.append((m, line))
            if state.get(target) == 1:
                start = next(i for i, (n, _) in enumerate(path) if n == target)
                return " -> ".join(f"{n} ({_where(n, ln)})" for n, ln in path[start:]) + (
                    f" -> {target}"
                )
            if target not in state and (found := visit(target)):
                return found
            path.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def _upward(graph: dict[str, list[tuple[str, int, bool]]]) -> list[str]:
    """Each import of a module from a layer above its own, as a message naming both."""
    names = [name for name, _ in LAYERS]
    bad = []
    for m, edges in sorted(graph.items()):
        for target, line, deferred in edges:
            if _layer(target) > _layer(m):
                bad.append(
                    f"{_where(m, line)}: {m} (layer {names[_layer(m)]!r}) imports {target} "
                    f"(layer {names[_layer(target)]!r}, above it) "
                    + ("inside a function" if deferred else "at module level")
                )
    return bad


def test_every_module_has_a_layer():
    for m in MODULES:
        _layer(m)


def test_no_import_cycle():
    cycle = _cycle(_edges())
    assert cycle is None, f"import cycle: {cycle}"


def test_each_module_imports_only_its_layer_or_below():
    bad = _upward(_edges())
    order = " < ".join(name for name, _ in LAYERS)
    assert not bad, f"imports against the layer order {order}:\n" + "\n".join(bad)


def test_the_front_ends_are_independent():
    """NNX is built on the layer spec, not on the Linen modules: no fp8jax.nnx module imports
    an fp8jax.flax one (and Linen none of NNX's, which the layer order already forbids)."""
    bad = [
        f"{_where(m, line)}: {m} imports {target}"
        for m, edges in sorted(_edges().items())
        if m.startswith("fp8jax.nnx")
        for target, line, _ in edges
        if target.startswith("fp8jax.flax")
    ]
    assert not bad, "\n".join(bad)


def test_deferred_allowances_name_modules():
    """Each :data:`DEFERRED` entry names two fp8jax modules (an entry whose import is gone is
    harmless; drop it when you see one)."""
    for m, target in DEFERRED:
        assert m in MODULES and target in MODULES, (m, target)


def test_the_checks_catch_a_deferred_cycle_and_an_upward_import(tmp_path, monkeypatch):
    """What the old ``dense`` <-> ``_fp8_gemm`` pair did (a cycle through an import inside a
    function) and a layer importing a layer above it are both reported, naming the lines."""
    assert _upward({"fp8jax.ops.casts.quantize": [("fp8jax.functional.dense", 7, True)]}) == [
        "fp8jax/ops/casts/quantize.py:7: fp8jax.ops.casts.quantize (layer 'ops casts') imports "
        "fp8jax.functional.dense (layer 'functional layers', above it) inside a function"
    ]
    assert (
        _layer("fp8jax.flax.dense")
        > _layer("fp8jax.functional.dense")
        > _layer("fp8jax.functional._core")
    )
    (tmp_path / "fp8jax").mkdir()
    (tmp_path / "fp8jax" / "a.py").write_text("from fp8jax import b\n")
    (tmp_path / "fp8jax" / "b.py").write_text("def f():\n    from fp8jax.a import x\n")
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path / "fp8jax")
    for m in ("a", "b"):
        monkeypatch.setitem(MODULES, f"fp8jax.{m}", tmp_path / "fp8jax" / f"{m}.py")
    assert _imports("fp8jax.a") == [("fp8jax.b", 1, False)]
    assert _imports("fp8jax.b") == [("fp8jax.a", 2, True)]
    graph = {m: _imports(m) for m in ("fp8jax.a", "fp8jax.b")}
    assert _cycle(graph) == "fp8jax.a (fp8jax/a.py:1) -> fp8jax.b (fp8jax/b.py:2) -> fp8jax.a"


#: What private Flax or JAX API looks like in source (flax.linen.module internals, the module
#: stack, underscored names imported from flax or jax, jax._src).
_PRIVATE = [
    re.compile(r"flax\.linen\.module\b"),
    re.compile(r"from\s+flax\.linen\s+import\s+module\b"),
    re.compile(r"\._context\b"),
    re.compile(r"module_stack"),
    re.compile(r"jax\._src"),
    re.compile(r"from\s+(flax|jax)\b[\w.]*\s+import\s+\(?[^)\n]*\b_\w+"),
    re.compile(r"(?<![\w.])(flax|nnx|nn|jax)(\.\w+)*\._[A-Za-z]\w*"),
]


#: Private JAX/Flax API used anyway, by file and the exact source line, with the reason.
PRIVATE_API_ALLOWED: dict[tuple[str, str], str] = {
    ("fp8_attention.py", "from jax._src.cudnn import fused_attention_stablehlo"): (
        "cuDNN's FP8 attention (fp8_dpa) exists in JAX only in this private module (0.10.2 to "
        "0.12.0.1, the newest on PyPI); jax.nn.dot_product_attention is BF16/FP16 only. One "
        "lazy import, in fp8jax/ops/attention/fp8_attention.py; its reference runs without it"
    ),
}


def _private_api(path: Path) -> list[str]:
    hits = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        code = line.split("#", 1)[0]
        if (path.name, line.strip()) in PRIVATE_API_ALLOWED:
            continue
        hits += [f"{path.name}:{n}: {line.strip()}" for p in _PRIVATE if p.search(code)]
    return hits


def test_each_private_api_allowance_is_used():
    """An allowance names a line that exists (a stale one would hide nothing)."""
    lines = {(p.name, line.strip()) for p in _modules().values()
             for line in p.read_text().splitlines()}  # fmt: skip
    assert set(PRIVATE_API_ALLOWED) <= lines


def test_no_private_flax_or_jax_api():
    hits = [hit for path in sorted(_modules().values()) for hit in _private_api(path)]
    assert not hits, "\n".join(hits)


def test_the_private_api_check_catches_the_module_stack(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "from flax.linen import module as m\nstack = m._context.module_stack\n"
        "from jax._src import core\nx = nn.module._context\n"
    )
    assert len(_private_api(bad)) >= 4


#: Private names (``_name``) one fp8jax module takes from another, allowed, with the reason.
#: What two modules share has a plain name in its home module; this list should stay empty.
PRIVATE_ALLOWED: dict[tuple[str, str, str], str] = {}


def _private_uses(module: str) -> list[tuple[str, str, int]]:
    """``(home module, private name, line)`` for each private name ``module`` takes from another
    fp8jax module: ``from home import _name`` (not a submodule) or ``alias._name`` where
    ``alias`` is an imported fp8jax module."""
    path = MODULES[module]
    tree = ast.parse(path.read_text(), str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    aliases: dict[str, str] = {}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*up, base] if base else up)
            if base.split(".")[0] != "fp8jax":
                continue
            for a in node.names:
                full = f"{base}.{a.name}"
                if full in MODULES:  # a submodule
                    aliases[a.asname or a.name] = full
                elif a.name.startswith("_") and base in MODULES and base != module:
                    found.append((base, a.name, node.lineno))
        elif isinstance(node, ast.Import):
            for a in node.names:
                if a.name in MODULES and a.asname:
                    aliases[a.asname] = a.name
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id in aliases
            and node.attr.startswith("_")
            and not node.attr.startswith("__")
            and f"{aliases[node.value.id]}.{node.attr}" not in MODULES
            and aliases[node.value.id] != module
        ):
            found.append((aliases[node.value.id], node.attr, node.lineno))
    return found


def test_no_private_name_crosses_modules():
    """What two modules share has a plain name in its home (docs/design.md): no fp8jax module
    takes a ``_name`` from another, but the reasoned :data:`PRIVATE_ALLOWED`. Private
    *modules* (``fp8jax.ops.gemms._gemm_partition``) are their package's internals
    (:func:`test_private_modules_stay_in_their_package`)."""
    bad = [
        f"{_where(m, line)}: {m} uses {home}.{name}"
        for m in sorted(MODULES)
        for home, name, line in _private_uses(m)
        if (m, home, name) not in PRIVATE_ALLOWED
    ]
    assert not bad, f"{len(bad)} private names cross modules:\n" + "\n".join(bad)


def _private_module_uses(module: str) -> list[tuple[str, int]]:
    """``(private module, line)`` for each ``_name`` module that ``module`` imports from outside
    the package that holds it (``fp8jax.ops.gemms._gemm_partition`` is for ``fp8jax.ops.gemms``
    and the packages below it; ``fp8jax._ffi`` for all of ``fp8jax``)."""
    found = []
    for target, line, _ in _imports(module):
        package, _, leaf = target.rpartition(".")
        if leaf.startswith("_") and not (module == package or module.startswith(package + ".")):
            found.append((target, line))
    return found


def test_private_modules_stay_in_their_package():
    """A module that another package uses has a plain name (``fp8jax.ops.base.partition``,
    read by the layers); a ``_name`` module is imported only inside its own package."""
    bad = [
        f"{_where(m, line)}: {m} imports {target}"
        for m in sorted(MODULES)
        for target, line in _private_module_uses(m)
    ]
    assert not bad, "\n".join(bad)
    assert _private_module_uses("fp8jax.ops.gemms.gemm") == []  # its _gemm_partition: inside


#: The ops' families, lowest first: each a package of fp8jax/ops/ and a layer of its own.
OPS_FAMILIES = ("base", "casts", "block", "fused", "gemms", "attention")


def test_ops_are_family_packages_in_layer_order():
    """fp8jax/ops/ holds its ``__init__`` and one package per family, nothing else; the
    families' layers are in :data:`OPS_FAMILIES`' order (a lower family never imports a higher
    one: :func:`test_each_module_imports_only_its_layer_or_below`)."""
    ops = ROOT / "ops"
    assert sorted(p.name for p in ops.glob("*.py")) == ["__init__.py"]
    packages = sorted(p.name for p in ops.iterdir() if p.is_dir() and p.name != "__pycache__")
    assert packages == sorted(OPS_FAMILIES)
    layers = [_layer(f"fp8jax.ops.{f}") for f in OPS_FAMILIES]
    assert layers == sorted(set(layers))
    assert _layer("fp8jax.recipe") < layers[0] and layers[-1] < _layer("fp8jax.ops")
    assert _layer("fp8jax.ops.gemms.gemm") == layers[-2]


def test_fp8jax_ops_exports_each_modules_all():
    """Each module of an ops family declares ``__all__``; its family package and
    :mod:`fp8jax.ops` re-export exactly those names (sorted, each once), so a name added to a
    module's ``__all__`` is public API with no other edit."""
    import fp8jax.ops

    exported: list[str] = []
    for family in OPS_FAMILIES:
        package = importlib.import_module(f"fp8jax.ops.{family}")
        names: list[str] = []
        for path in sorted((ROOT / "ops" / family).glob("*.py")):
            if path.name == "__init__.py":
                continue
            module = importlib.import_module(f"fp8jax.ops.{family}.{path.stem}")
            assert isinstance(getattr(module, "__all__", None), list), f"{path}: no __all__"
            for name in module.__all__:
                assert getattr(package, name) is getattr(module, name), (family, name)
                assert getattr(fp8jax.ops, name) is getattr(module, name), name
            names += module.__all__
        assert sorted(package.__all__) == sorted(names), family
        exported += names
    assert fp8jax.ops.__all__ == sorted(exported)
    assert len(set(exported)) == len(exported)


def test_test_file_names_are_unique():
    """tests/ has no packages, so pytest imports each test file by its base name: two files of
    one name collide (and the conformance suite would read an op's SAMPLES from the wrong one)."""
    tests = Path(__file__).resolve().parent
    names = Counter(p.name for p in tests.rglob("test_*.py"))
    assert sorted(n for n, c in names.items() if c > 1) == []
