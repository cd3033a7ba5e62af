"""tools/maxtext_check.sh without running MaxText (that needs its own venv and minutes): it
parses, documents itself, refuses unknown arguments, and its pinned set matches the jax that
fp8jax's compiled extension is built against here."""

from __future__ import annotations

import subprocess
from pathlib import Path

import jax

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "tools" / "maxtext_check.sh"
REQUIREMENTS = ROOT / "tools" / "maxtext_requirements.txt"


def _bash(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", *args], capture_output=True, text=True, timeout=60)


def test_script_parses_and_helps():
    assert _bash("-n", str(SCRIPT)).returncode == 0
    help_ = _bash(str(SCRIPT), "--help")
    assert help_.returncode == 0
    assert "te_fp8_delayedscaling" in help_.stdout
    assert "TODO" not in help_.stdout  # cudnn_flash_te is run (issue 50 landed)
    assert "--attention dot_product|cudnn_flash_te" in help_.stdout and "TEATTN" in help_.stdout
    assert "set -euo" not in help_.stdout  # the header only


def test_unknown_argument_is_refused():
    bad = _bash(str(SCRIPT), "--steps-typo", "3")
    assert bad.returncode == 2
    assert "--steps-typo" in bad.stderr


def test_requirements_are_pinned_to_this_jax():
    pins = {}
    for line in REQUIREMENTS.read_text().splitlines():
        if line and not line.startswith("#"):
            name, sep, version = line.partition("==")
            assert sep, f"not pinned: {line!r}"
            pins[name.lower()] = version
    assert "transformer-engine-jax" not in pins and "transformer_engine" not in pins
    assert pins["jax"] == pins["jaxlib"] == jax.__version__
