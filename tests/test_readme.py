"""Every ```python block of README.md (and of the guides in DOCS) runs as written.

How blocks relate: they don't. Each block is a complete program (its own imports, inputs and
recipe) and runs on its own, in a fresh interpreter with the working directory set to a temporary
folder; nothing carries over from an earlier block. That is what a reader who copies one block
gets, so a block that leans on another's names fails here. Blocks should check what their comments
claim (an ``assert`` or a printed value a reader can compare), and stay small: a few seconds each.

A block that needs several devices says so on its first line, ``# needs 8 devices``; it then runs
with ``XLA_FLAGS=--xla_force_host_platform_device_count=8`` and ``JAX_PLATFORMS=cpu`` (8 emulated
CPU devices, whatever accelerator the machine has), as ``tests/distributed`` does. Other blocks run
in this process's environment, so on a GPU machine they run on the GPU.

Only fences whose info string is ``python`` (or ``py``/``python3``) are run; ``bash`` blocks are
commands, not examples. A Python block must not hide behind another info string: the test of the
fences below fails on any language it does not know.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
#: Markdown files whose Python blocks run here: the README and every page of docs/.
DOCS = (README, *sorted((README.parent / "docs").glob("*.md")))
#: Of those, the guides written as programs: each must have Python blocks.
GUIDES = (
    README,
    *(README.parent / "docs" / f"{name}.md" for name in (
        "porting-from-te", "ops", "training", "layers", "nnx", "parallelism", "recipes",
    )),
)  # fmt: skip
PYTHON_LANGS = ("python", "py", "python3")
OTHER_LANGS = ("bash", "sh", "console", "text", "")  # known, not run
DEVICES_MARKER = re.compile(r"#\s*needs\s+(\d+)\s+devices?\b")
BLOCK_TIMEOUT_S = 300
_FENCE = re.compile(r"^(```+|~~~+)\s*([\w+-]*)[^\n]*$")


class Block(NamedTuple):
    line: int  # 1-based line of the opening fence in its file
    lang: str
    section: str  # the heading it sits under
    code: str
    doc: str = "README.md"  # the file, relative to the repository root

    @property
    def devices(self) -> int:
        """Devices the block asks for with a ``# needs N devices`` first line (1 otherwise)."""
        first = self.code.lstrip("\n").split("\n", 1)[0]
        m = DEVICES_MARKER.fullmatch(first.strip())
        return int(m.group(1)) if m else 1


def fenced_blocks(text: str, doc: str = "README.md") -> list[Block]:
    """Every fenced code block of a Markdown text, in order (unclosed fence: ValueError)."""
    blocks: list[Block] = []
    section = "(top)"
    lines = text.split("\n")
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#") and not line.startswith("#!"):
            section = line.lstrip("#").strip()
        m = _FENCE.match(line)
        if not m:
            i += 1
            continue
        fence, lang = m.group(1), m.group(2).lower()
        end = i + 1
        while end < len(lines) and not lines[end].startswith(fence[0] * len(fence)):
            end += 1
        if end == len(lines):
            raise ValueError(f"{doc}:{i + 1}: code fence {fence}{lang} is never closed")
        blocks.append(Block(i + 1, lang, section, "\n".join(lines[i + 1 : end]) + "\n", doc))
        i = end + 1
    return blocks


def python_blocks() -> list[Block]:
    return [
        b
        for md in DOCS
        for b in fenced_blocks(md.read_text(), str(md.relative_to(README.parent)))
        if b.lang in PYTHON_LANGS
    ]


def _block_id(block: Block) -> str:
    words = re.sub(r"[^a-z0-9]+", "-", block.section.lower()).strip("-")
    prefix = "" if block.doc == "README.md" else f"{Path(block.doc).stem}-"
    return f"{prefix}L{block.line}-{words}"


def _env(devices: int) -> dict[str, str]:
    env = dict(os.environ)
    if devices > 1:
        flags = re.sub(r"--xla_force_host_platform_device_count=\S*", "", env.get("XLA_FLAGS", ""))
        env["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={devices}".strip()
        env["JAX_PLATFORMS"] = "cpu"
    return env


@pytest.mark.parametrize("block", python_blocks(), ids=_block_id)
def test_readme_block_runs_as_written(block: Block, tmp_path: Path):
    script = tmp_path / f"{Path(block.doc).stem}_line_{block.line}.py"
    script.write_text(block.code)
    proc = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=_env(block.devices),
        capture_output=True,
        text=True,
        timeout=BLOCK_TIMEOUT_S,
    )
    if proc.returncode != 0:
        pytest.fail(
            f"{block.doc} block at line {block.line} (section {block.section!r}, "
            f"{block.devices} device(s)) exited with {proc.returncode}; line N of the traceback "
            f"is {block.doc} line {block.line} + N.\n--- stdout\n{proc.stdout}\n--- stderr\n"
            f"{proc.stderr}",
            pytrace=False,
        )


@pytest.mark.parametrize("md", DOCS, ids=lambda p: p.name)
def test_docs_have_python_blocks_and_only_known_fences(md: Path):
    blocks = fenced_blocks(md.read_text(), md.name)
    unknown = [(b.line, b.lang) for b in blocks if b.lang not in PYTHON_LANGS + OTHER_LANGS]
    assert not unknown, f"{md.name} fences with an unknown language (run or not?): {unknown}"
    if md in GUIDES:
        assert any(b.lang in PYTHON_LANGS for b in blocks), f"{md.name} has no ```python block"


def test_fence_parser():
    text = (
        "# Title\n```bash\necho hi\n```\n## Use\n"
        "```python\n# needs 8 devices\nimport jax\n```\n"
        "````python\nx = '```'\n````\n"
    )
    blocks = fenced_blocks(text)
    assert [(b.line, b.lang, b.section) for b in blocks] == [
        (2, "bash", "Title"),
        (6, "python", "Use"),
        (10, "python", "Use"),
    ]
    assert blocks[1].code == "# needs 8 devices\nimport jax\n"
    assert blocks[1].devices == 8
    assert blocks[2].code == "x = '```'\n" and blocks[2].devices == 1
    with pytest.raises(ValueError, match="never closed"):
        fenced_blocks("```python\nx = 1\n")
