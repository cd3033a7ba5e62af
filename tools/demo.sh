#!/usr/bin/env bash
# The main fp8jax demo: bash tools/demo.sh [ARGS...]
#
# Sets itself up like tools/test.sh (creates ./.venv when missing and installs fp8jax into it,
# building its extensions; FP8JAX_CUDA=AUTO|ON|OFF, default AUTO), installs the demo extra's
# plotting dependency (matplotlib, see pyproject.toml) when missing, then runs
# examples/train_gpt.py with the given arguments: a byte-level GPT trained in FP8 and in BF16 on
# the Python standard library's sources, reports in ./gpt_runs (3-7 minutes on 2 CPU cores).
# The one-layer quickstart is examples/quickstart.py.

set -euo pipefail

# --help: the demo's usage, before (and without) building anything. train_gpt.py parses --help
# ahead of its imports, so any python3 prints it.
for arg in "$@"; do
  if [[ "$arg" == "-h" || "$arg" == "--help" ]]; then
    cd "$(dirname "${BASH_SOURCE[0]}")/.."
    echo "usage: bash tools/demo.sh [ARGS...]   (sets up ./.venv, then runs examples/train_gpt.py)"
    exec python3 examples/train_gpt.py --help
  fi
done

# shellcheck source=tools/_venv.sh
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"

if ! "$FP8JAX_PY" -c "import matplotlib" >/dev/null 2>&1; then
  echo "fp8jax: installing the demo extra (matplotlib) into the venv"
  "$FP8JAX_PY" -m pip install --quiet "matplotlib>=3.7"
fi

exec "$FP8JAX_PY" examples/train_gpt.py "$@"
