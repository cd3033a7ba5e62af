"""The C++ op registry: FP8JAX_OPS (cpp/common/op_table.h) takes every op family's list
(cpp/ops/*.h), and each op's family header names the handler symbols its entry generates,
Fp8jax<Stem>Cpu and Fp8jax<Stem>Cuda, which a macro defines (so that grep finds where they come
from). Reads the sources only."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OPS = ROOT / "cpp" / "ops"
ENTRY = re.compile(r'X\((\w+), "(fp8jax_\w+)"\)')
FAMILY = re.compile(r"#define (FP8JAX_\w+_OPS)\(X\)")


def _family_headers() -> dict[str, str]:
    """Each family list's macro name -> the text of the header that defines it."""
    found = {}
    for path in sorted(OPS.glob("*.h")):
        text = path.read_text(encoding="utf-8")
        for name in FAMILY.findall(text):
            found[name] = text
    return found


def test_the_registry_takes_every_family_list_once():
    families = _family_headers()
    assert len(families) >= 5
    table = (ROOT / "cpp" / "common" / "op_table.h").read_text(encoding="utf-8")
    registry = table[table.index("#define FP8JAX_OPS(X)") :]
    for name in families:
        assert registry.count(f"{name}(X)") == 1, name


def test_every_op_names_its_generated_handler_symbols():
    entries = []
    for text in _family_headers().values():
        for stem, target in ENTRY.findall(text):
            entries.append(target)
            for symbol in (f"Fp8jax{stem}Cpu", f"Fp8jax{stem}Cuda"):
                assert re.search(rf"\b{symbol}\b", text), f"{target}: {symbol} is not named"
    assert len(entries) == len(set(entries)) >= 20
