#!/usr/bin/env bash
# The fp8jax test command: bash tools/test.sh [PYTEST ARGS...]
#
# Sets itself up: creates ./.venv (with the python3 on PATH) when missing and installs fp8jax into
# it, editable, building the CPU extension and, when nvcc is found, the CUDA one (FP8JAX_CUDA=
# AUTO|ON|OFF, default AUTO). Then: ruff lint, ruff format check, clang-format check of cpp/,
# the test suite, and the multi-device tests (tests/distributed, if present) on 8 emulated CPU
# devices.
# Extra arguments go to both pytest runs (e.g. -k quantize, -x). Exits non-zero on any failure.
# Both runs spread the tests over FP8JAX_TEST_JOBS pytest-xdist workers (default: one per CPU
# core, at most 4; 1 runs them in one process). FP8JAX_TEST_MARKS, when set, selects tests by
# marker for both runs (pytest -m, e.g. "not slow"). FP8JAX_TEST_IMPLEMENTATIONS=kernel runs the
# op tests under the kernels only (default: kernel and xla; tests/ops/_implementations.py).
# FP8JAX_TEST_PATHS, when set, names what the main run collects (default: tests);
# FP8JAX_TEST_DISTRIBUTED, when set, names the files of tests/distributed to run (default: all).
# Both runs share one JAX compilation cache on disk (JAX_COMPILATION_CACHE_DIR, default a fresh
# temporary directory removed at exit).

set -euo pipefail

# shellcheck source=tools/_venv.sh
source "$(dirname "${BASH_SOURCE[0]}")/_venv.sh"

lint_paths=()
for p in fp8jax tests examples benchmarks tools; do
  if [[ -e "$p" ]]; then
    lint_paths+=("$p")
  fi
done

echo "== ruff check"
"$FP8JAX_PY" -m ruff check "${lint_paths[@]}"
echo "== ruff format --check"
"$FP8JAX_PY" -m ruff format --check "${lint_paths[@]}"

# The C++/CUDA sources against .clang-format (clang-format comes with the test extras).
clang_format="$(dirname "$FP8JAX_PY")/clang-format"
if [[ -d cpp && -x "$clang_format" ]]; then
  echo "== clang-format --dry-run --Werror (cpp/)"
  find cpp -name '*.cc' -o -name '*.cu' -o -name '*.h' -o -name '*.cuh' | sort |
    xargs "$clang_format" --dry-run --Werror
fi

# One JAX compilation cache on disk for this run's pytest processes (the xdist workers, the main
# and the multi-device runs): the suite compiles many programs more than once (the same reference,
# layer or train step from several tests, in both workers), and a program compiled once is then
# read back instead of compiled again (tests/flax/test_flax_transformer.py: 89 s instead of 131 s
# on 2 cores). A fresh temporary directory per run, removed at exit, unless
# JAX_COMPILATION_CACHE_DIR is set (CI sets it so that its later pytest runs share it).
if [[ -z "${JAX_COMPILATION_CACHE_DIR:-}" ]]; then
  jax_cache="$(mktemp -d)"
  trap 'rm -rf "$jax_cache"' EXIT
  export JAX_COMPILATION_CACHE_DIR="$jax_cache"
fi
export JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="${JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS:-0}"
export JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="${JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES:-0}"

# The multi-device tests need XLA_FLAGS set before JAX starts, so they run in their own process
# (and are left out of the main run, which could not give them 8 devices).
jobs="${FP8JAX_TEST_JOBS:-}"
if [[ -z "$jobs" ]]; then
  jobs="$(nproc 2>/dev/null || echo 1)"
  jobs=$((jobs > 4 ? 4 : jobs))
fi
xdist=()
if [[ "$jobs" -gt 1 ]]; then
  xdist=(-n "$jobs")
  # On a GPU, each worker would otherwise reserve most of its memory up front.
  export XLA_PYTHON_CLIENT_PREALLOCATE="${XLA_PYTHON_CLIENT_PREALLOCATE:-false}"
fi
marks=()
if [[ -n "${FP8JAX_TEST_MARKS:-}" ]]; then
  marks=(-m "$FP8JAX_TEST_MARKS")
fi
read -ra test_paths <<<"${FP8JAX_TEST_PATHS:-tests}"
main_args=(-q --durations=25 "${xdist[@]}" "${marks[@]}" "${test_paths[@]}")
if [[ -d tests/distributed ]]; then
  main_args+=(--ignore=tests/distributed)
fi

echo "== pytest tests"
"$FP8JAX_PY" -m pytest "${main_args[@]}" "$@"

if [[ -d tests/distributed ]]; then
  read -ra distributed <<<"${FP8JAX_TEST_DISTRIBUTED:-tests/distributed}"
  echo "== pytest ${distributed[*]} (8 CPU devices)"
  rc=0
  XLA_FLAGS="${XLA_FLAGS:+$XLA_FLAGS }--xla_force_host_platform_device_count=8" \
    JAX_PLATFORMS=cpu \
    "$FP8JAX_PY" -m pytest -q "${xdist[@]}" "${marks[@]}" "${distributed[@]}" "$@" || rc=$?
  if [[ $rc -eq 5 ]]; then
    echo "tests/distributed holds no tests yet (pytest exit 5); not a failure"
  elif [[ $rc -ne 0 ]]; then
    exit "$rc"
  fi
fi

echo "== all checks passed"
