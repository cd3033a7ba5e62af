#!/usr/bin/env bash
# The main fp8jax demo: bash tools/demo.sh [ARGS...]
#
# Sets itself up like tools/test.sh (creates ./.venv when missing and installs fp8jax into it,
# building its extensions; FP8JAX_CUDA=AUTO|ON|OFF, default AUTO), then runs
# examples/quickstart.py with the given arguments.

set -euo pipefail

# shellcheck source=tools/_venv.sh
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"

exec "$FP8JAX_PY" examples/quickstart.py "$@"
