"""Loading a script of examples/ as a module, for the tests of this folder."""

from __future__ import annotations

import contextlib
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


@contextlib.contextmanager
def example(name: str) -> Iterator[ModuleType]:
    """``examples/<name>.py`` imported as module ``name`` (registered in ``sys.modules`` while in
    use: its dataclasses resolve their annotations through it)."""
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(name, None)
