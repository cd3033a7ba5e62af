#!/usr/bin/env bash
# Builds the API reference (docs/api: Sphinx autodoc of the docstrings) with warnings as errors:
# bash tools/docs.sh [OUT_DIR]   (default ./docs/api/_build)
#
# Sets itself up as tools/test.sh does (./.venv), and installs Sphinx (the "docs" extra) into the
# venv if it is missing. A fresh environment each time (-E), so every docstring is read again.

set -euo pipefail

# shellcheck source=tools/_venv.sh
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"

if ! "$FP8JAX_PY" -c "import sphinx" >/dev/null 2>&1; then
  echo "fp8jax: installing Sphinx into $(dirname "$(dirname "$FP8JAX_PY")")"
  "$FP8JAX_PY" -m pip install --quiet "sphinx>=8"
fi
out="${1:-docs/api/_build}"
echo "== sphinx -W (docs/api -> $out)"
"$FP8JAX_PY" -m sphinx -E -W --keep-going -q -b html docs/api "$out"
echo "== API reference built: $out/index.html"
