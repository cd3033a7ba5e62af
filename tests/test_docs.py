"""The docs that code and Markdown point to exist, and relative Markdown links resolve."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCE_DIRS = ("fp8jax", "cpp", "tests", "tools", "benchmarks", "examples", "docs")
SUFFIXES = {".py", ".h", ".cc", ".cu", ".sh", ".md"}
# The planning page that the repository never had; code points to docs/design.md instead.
_OLD_DESIGN = "DESIGN" + ".md"
# Still pointing to it, being fixed in another change (remove entries as they are fixed).
_OLD_DESIGN_PENDING: set[str] = set()
_DOC_PATH = re.compile(r"\bdocs/[\w.-]+\.md\b")
_MD_LINK = re.compile(r"\]\(([^)\s#]+)(?:#[^)]*)?\)")


def _files() -> list[Path]:
    out = [ROOT / "README.md", ROOT / "CHANGELOG.md"]
    for d in SOURCE_DIRS:
        out += [p for p in sorted((ROOT / d).rglob("*")) if p.suffix in SUFFIXES and p.is_file()]
    return out


def test_design_and_numerics_docs_exist():
    assert (ROOT / "docs" / "design.md").is_file()
    assert (ROOT / "docs" / "numerics.md").is_file()


def test_every_docs_path_mentioned_exists():
    missing = [
        f"{p.relative_to(ROOT)}: {m}"
        for p in _files()
        for m in _DOC_PATH.findall(p.read_text(errors="replace"))
        if not (ROOT / m).is_file()
    ]
    assert not missing, missing


def test_nothing_points_to_the_old_design_page():
    stale = [
        str(p.relative_to(ROOT))
        for p in _files()
        if _OLD_DESIGN in p.read_text(errors="replace")
        and str(p.relative_to(ROOT)) not in _OLD_DESIGN_PENDING
    ]
    assert not stale, f"{stale} point to {_OLD_DESIGN}; point them to docs/design.md"


def test_relative_markdown_links_resolve():
    broken = []
    for md in [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]:
        for target in _MD_LINK.findall(md.read_text()):
            if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
                continue
            if not (md.parent / target).exists():
                broken.append(f"{md.relative_to(ROOT)}: {target}")
    assert not broken, broken
