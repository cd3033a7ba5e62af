#!/usr/bin/env bash
# The GPU check: bash tools/gpu_check.sh [OUT [PYTEST_ARGS...]]   (OUT defaults to ./out,
# PYTEST_ARGS to "tests -x")
#
# The tests of GPU_CHECK_FIRST (default: the block-scaled tests; "" for none) run before the
# others. For a short device lease: GPU_CHECK_PYTEST_TIMEOUT (seconds) stops pytest and goes on to the
# benchmarks; GPU_CHECK_BENCHES ("gemm norm implementations") runs only those benchmarks/NAME.py
# (cast_bandwidth always runs); BENCH_TIMEOUT (default 300) bounds each benchmark;
# GPU_CHECK_DEADLINE (epoch seconds) sizes pytest's timeout to the time the build left;
# GPU_CHECK_PACK=1 leaves OUT with summary.md, pytest.log and gpu_check.tgz (everything) alone, for
# a device tool that returns few files.
#
# GPU_CHECK_PROFILE=perf measures first, for one device call of 600 s build included (the command
# is in docs/performance.md): it builds for this GPU's arch only, runs benchmarks/e2e.py (the
# whole train step, four variants), then benchmarks/gemm.py over PERF_GEMM_SHAPES, then the grouped
# GEMM (benchmarks/grouped_gemm.py: tensor cores against the CUDA-core kernel, ragged_dot and the
# dense FP8 GEMM; benchmarks/moe.py: the MoE layer, FP8 against BF16), then only the
# GPU tests of the kernels changed since the last GPU run (tools/changed_tests.py, which compares
# the sources with tools/gpu_run_manifest.txt; GPU_CHECK_TESTS overrides, "" for none), each stage
# bounded by what GPU_CHECK_DEADLINE (default: start + GPU_CHECK_BUDGET, 540 s) leaves after the
# reserves of the stages after it (GPU_CHECK_GEMM_RESERVE 75 s, GPU_CHECK_GROUPED_RESERVE 90 s,
# GPU_CHECK_TEST_RESERVE 90 s).
# PYTEST_ARGS are ignored there; GPU_CHECK_E2E_ARGS go to e2e.py (e.g. "--workloads gpt-medium").
# GPU_CHECK_DRY_RUN=1 prints its plan (plan.txt) and runs nothing.
#
# Run from the repo root on a CUDA machine whose python already has JAX with its CUDA plugin,
# pytest, scikit-build-core, nanobind and cmake (no network is needed or used). It builds fp8jax
# in place with the CUDA extension forced on (cuBLASLt from FP8JAX_CUBLAS_ROOT, the CUDA toolkit, or
# the nvidia-cublas wheel JAX's CUDA plugin installed in this python), runs the whole test suite on
# the GPU (tests/ops/test_gemm.py included; every op test runs under both implementations, the
# fp8jax kernel and XLA's compilation of the jnp reference, ids [kernel] and [xla]), runs the
# benchmarks (benchmarks/gemm.py included, as bench/gemm.json; benchmarks/norm.py, the norms with
# the fused FP8 cast against XLA, as bench/norm.json; benchmarks/implementations.py
# compares the two implementations' outputs bit for bit and times both, as
# bench/implementations.json, and fails on a mismatch). The build also makes the host run of the
# CUDA sources (FP8JAX_TESTING=ON: cpp/cuda/ compiled by the host compiler on
# cpp/testing/host_cuda.h), so tests/ops/test_host_cuda.py compares every kernel sample run on the
# GPU from nvcc's output with the same source run on the host (test_gpu_kernels_equal_their_host_run)
# besides its host-only checks. It writes into OUT (at most 8 files,
# one folder level):
#
#   env.txt             nvidia-smi, python/jax versions, JAX devices, git commit
#   build.log           the editable build (FP8JAX_CUDA=ON)
#   pytest.log          pytest output;  pytest.xml  its JUnit report
#   cast_bandwidth.json benchmarks/cast_bandwidth.py
#   bench.log           the output of every benchmark
#   bench/NAME.json     every other benchmarks/NAME.py that takes --json PATH
#   summary.md          device, versions, build and test results, key benchmark numbers
#
# Exits with pytest's exit code (or the build's, if the build fails).

set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
OUT="${1:-out}"
shift || true
PYTEST_ARGS=("$@")
[[ ${#PYTEST_ARGS[@]} -gt 0 ]] || PYTEST_ARGS=(tests -x)
# What no GPU has run yet runs first (tests/conftest.py orders by FP8JAX_TEST_FIRST), so that a
# short lease still reaches it: the block-scaled GEMM on cuBLASLt (scale modes and layouts), the
# block cast kernels and their fused forms, the layers under the block recipes.
# The host runs' comparison with the GPU (test_host_cuda.py) comes next: the newest kernels' bits.
export FP8JAX_TEST_FIRST="${GPU_CHECK_FIRST-tests/ops/test_block_gemm.py tests/ops/test_block_fused.py tests/ops/test_block_scaling.py tests/functional/test_block_layers.py tests/functional/test_block_training.py tests/ops/test_host_cuda.py}"
mkdir -p "$OUT"
OUT="$(cd "$OUT" && pwd)"
PY="${PYTHON:-python}"
BENCH_TIMEOUT="${BENCH_TIMEOUT:-300}"
PROFILE="${GPU_CHECK_PROFILE:-full}"
START=$(date +%s)
if [[ "$PROFILE" != full && "$PROFILE" != perf ]]; then
  echo "gpu_check: GPU_CHECK_PROFILE must be full or perf, got '$PROFILE'" >&2
  exit 2
fi
if [[ "${GPU_CHECK_DRY_RUN:-0}" == 1 && "$PROFILE" != perf ]]; then
  echo "gpu_check: GPU_CHECK_DRY_RUN=1 prints the perf profile's plan (GPU_CHECK_PROFILE=perf)" >&2
  exit 2
fi
# The perf profile's GEMM sweep: cubes, a projection, and LayerNormMLP's GEMMs at 16384 tokens,
# 4096 -> 16384 -> 4096 (forward and dgrad: 16384x16384x4096 and 16384x4096x16384; wgrad:
# 4096x16384x16384).
PERF_GEMM_SHAPES=(2048x2048x2048 4096x4096x4096 8192x8192x8192 16384x4096x4096
  16384x16384x4096 16384x4096x16384 4096x16384x16384)
if [[ "$PROFILE" == perf ]]; then
  GPU_CHECK_DEADLINE="${GPU_CHECK_DEADLINE:-$((START + ${GPU_CHECK_BUDGET:-540}))}"
  if [[ -n "${GPU_CHECK_TESTS+set}" ]]; then
    PERF_TESTS="$GPU_CHECK_TESTS"
  else
    PERF_TESTS="$("$PY" tools/changed_tests.py --explain 2>"$OUT/changed_tests.txt")" \
      || { echo "gpu_check: tools/changed_tests.py failed: $(cat "$OUT/changed_tests.txt")" >&2; PERF_TESTS=""; }
  fi
  read -r -a PERF_TEST_IDS <<<"$PERF_TESTS"
  GEMM_RESERVE="${GPU_CHECK_GEMM_RESERVE:-75}"
  GROUPED_RESERVE="${GPU_CHECK_GROUPED_RESERVE:-90}"
  TEST_RESERVE=0
  [[ ${#PERF_TEST_IDS[@]} -eq 0 ]] || TEST_RESERVE="${GPU_CHECK_TEST_RESERVE:-90}"
  CLOSE_RESERVE=20  # the summary and the pack
  {
    echo "profile perf: deadline $GPU_CHECK_DEADLINE ($((GPU_CHECK_DEADLINE - START)) s after the start)"
    echo "1. build (FP8JAX_CUDA=ON, this GPU's arch, FP8JAX_TESTING=$([[ ${#PERF_TEST_IDS[@]} -gt 0 ]] && echo ON || echo OFF))"
    echo "2. e2e: $PY benchmarks/e2e.py --json bench/e2e.json --deadline <deadline - $((GEMM_RESERVE + GROUPED_RESERVE + TEST_RESERVE + CLOSE_RESERVE)) s> ${GPU_CHECK_E2E_ARGS:-}"
    echo "3. gemm: $PY benchmarks/gemm.py --shapes ${PERF_GEMM_SHAPES[*]} --iters 10 --inner 5 --warmup 2 --json bench/gemm.json (until deadline - $((GROUPED_RESERVE + TEST_RESERVE + CLOSE_RESERVE)) s)"
    echo "4. grouped: $PY benchmarks/grouped_gemm.py --iters 5 --inner 3 --warmup 1 --json bench/grouped_gemm.json, then $PY benchmarks/moe.py --iters 3 --inner 1 --warmup 1 --json bench/moe.json (until deadline - $((TEST_RESERVE + CLOSE_RESERVE)) s)"
    if [[ ${#PERF_TEST_IDS[@]} -gt 0 ]]; then
      echo "5. tests (kernels changed since the last GPU run, kernel implementation only): ${PERF_TEST_IDS[*]} (until deadline - $CLOSE_RESERVE s)"
    else
      echo "5. tests: none (no kernel changed since the last GPU run)"
    fi
  } | tee "$OUT/plan.txt"
  if [[ "${GPU_CHECK_DRY_RUN:-0}" == 1 ]]; then
    exit 0
  fi
fi

# ---------------------------------------------------------------- environment
{
  echo "# date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "# git commit"
  if command -v git >/dev/null 2>&1 && git rev-parse HEAD >/dev/null 2>&1; then
    git rev-parse HEAD
  else
    echo "unknown"
  fi
  echo "# nvidia-smi"
  nvidia-smi 2>&1 || echo "nvidia-smi not available"
  echo "# nvcc"
  nvcc --version 2>&1 || echo "nvcc not available"
  echo "# python and jax"
  "$PY" - <<'EOF' 2>&1 || echo "python/jax query failed"
import sys

print("python", sys.version.replace("\n", " "))
try:
    import jax
    import jaxlib

    print("jax", jax.__version__, "jaxlib", jaxlib.__version__)
    print("backend", jax.default_backend())
    for d in jax.devices():
        print("device", d, d.device_kind, getattr(d, "compute_capability", ""))
except Exception as e:  # report, never stop the check here
    print("jax unavailable:", type(e).__name__, e)
EOF
} >"$OUT/env.txt"
echo "gpu_check: environment recorded in $OUT/env.txt"

# ---------------------------------------------------------------- build
echo "gpu_check: building (FP8JAX_CUDA=ON, no build isolation), log in $OUT/build.log"
build_rc=0
{
  # Without build isolation the build deps must already be in this python (there is no network).
  "$PY" -c "import scikit_build_core, nanobind, jaxlib" \
    || echo "gpu_check: this python lacks a build dependency: it needs scikit-build-core," \
      "nanobind and jaxlib (and a CMake >= 3.26 with nvcc on PATH)"
  command -v cmake >/dev/null 2>&1 && cmake --version | head -n 1
} >"$OUT/build.log" 2>&1
# CUTLASS's headers for the grouped GEMM's tensor-core path: FP8JAX_CUTLASS_ROOT, or
# third_party/cutlass (bash tools/fetch_cutlass.sh third_party/cutlass, carried to the device)
if [[ -z "${FP8JAX_CUTLASS_ROOT:-}" && -f third_party/cutlass/include/cutlass/cutlass.h ]]; then
  export FP8JAX_CUTLASS_ROOT="$PWD/third_party/cutlass"
fi
echo "gpu_check: CUTLASS headers: ${FP8JAX_CUTLASS_ROOT:-none (the grouped GEMM stays on the CUDA cores)}" \
  | tee -a "$OUT/build.log"
testing=ON
if [[ "$PROFILE" == perf ]]; then  # this GPU's arch only, all cores; the test-only extensions if tested
  cc="$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n 1 | tr -d '. ')"
  [[ -z "$cc" ]] || export FP8JAX_CUDA_ARCHS="${FP8JAX_CUDA_ARCHS:-${cc}-real}"
  export CMAKE_BUILD_PARALLEL_LEVEL="${CMAKE_BUILD_PARALLEL_LEVEL:-$(nproc)}"
  [[ ${#PERF_TEST_IDS[@]} -gt 0 ]] || testing=OFF
fi
FP8JAX_CUDA=ON FP8JAX_TESTING=$testing "$PY" -m pip install --no-build-isolation --no-deps -e . >>"$OUT/build.log" 2>&1 \
  || build_rc=$?
echo "gpu_check: build rc $build_rc after $(($(date +%s) - START)) s" | tee -a "$OUT/build.log"

summary_py() {
  "$PY" - "$OUT" "$build_rc" "${pytest_rc:-not run}" <<'EOF'
import json, pathlib, re, sys

out, build_rc, pytest_rc = pathlib.Path(sys.argv[1]), sys.argv[2], sys.argv[3]
lines = ["# fp8jax GPU check", ""]
env = (out / "env.txt").read_text(errors="replace") if (out / "env.txt").exists() else ""
devices = [ln[len("device "):] for ln in env.splitlines() if ln.startswith("device ")]
versions = [ln for ln in env.splitlines() if ln.startswith(("python ", "jax "))]
commit = env.split("# git commit\n", 1)[-1].split("\n", 1)[0] if "# git commit" in env else "?"
lines += [f"- device: {', '.join(devices) or 'none found'}"]
lines += [f"- {v}" for v in versions]
lines += [f"- git commit: {commit}", f"- build rc: {build_rc}", f"- pytest rc: {pytest_rc}"]
if (out / "stages.txt").exists():  # the perf profile's stages: rc and seconds
    lines += [f"- {ln}" for ln in (out / "stages.txt").read_text().splitlines()]
log = out / "pytest.log"
if log.exists():
    text = log.read_text(errors="replace")
    tail = [ln for ln in text.splitlines() if ln.strip()]
    last = tail[-1] if tail else ""
    counts = dict.fromkeys(("passed", "failed", "skipped", "errors"), 0)
    for num, word in re.findall(r"(\d+) (passed|failed|skipped|errors?|xfailed|xpassed)", last):
        word = "errors" if word.startswith("error") else word
        counts[word] = counts.get(word, 0) + int(num)
    if not any(counts.values()):  # no final line (stopped): count the -v result lines
        for word in ("passed", "failed", "skipped", "error"):
            hits = re.findall(rf" {word.upper()} (tests/\S+)", text)
            counts["errors" if word == "error" else word] = len(set(hits))
    lines += ["- pytest: " + ", ".join(f"{v} {k}" for k, v in counts.items())]
    lines += [f"- pytest last line: `{last.strip('= ')}`"]
    failed = sorted(set(re.findall(r"(?:FAILED|ERROR) (tests/\S+)", text)))
    if failed:
        lines += ["", "## Failed tests", ""] + [f"- `{t}`" for t in failed[:200]]
xml = out / "pytest.xml"
if xml.exists():  # the op tests run once per implementation: results of each
    import xml.etree.ElementTree as ET

    per = {}
    for case in ET.parse(xml).iter("testcase"):
        m = re.search(r"[\[-](kernel|xla)[\]-]", case.get("name", ""))
        if m is None:
            continue
        impl = m.group(1)
        kind = next((c.tag for c in case if c.tag in ("failure", "error", "skipped")), "passed")
        per.setdefault(impl, {}).setdefault(kind, 0)
        per[impl][kind] += 1
    for impl, kinds in sorted(per.items()):
        lines += [f"- op tests under {impl}: " + ", ".join(f"{v} {k}" for k, v in sorted(kinds.items()))]
jsons = sorted(out.glob("*.json")) + sorted((out / "bench").glob("*.json"))
if jsons:
    lines += ["", "## Benchmarks"]
for path in jsons:
    lines += ["", f"### {path.relative_to(out)}"]
    try:
        rep = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        lines += [f"unreadable: {e}"]
        continue
    if rep.get("skipped"):
        lines += [f"skipped: {rep.get('reason', '')}"]
        continue
    if "checks" in rep:
        lines += ["checks: " + ", ".join(f"{k}={v}" for k, v in rep["checks"].items())]
    rows = rep.get("results")
    if isinstance(rows, list) and rows and all(isinstance(r, dict) for r in rows):
        cols = [k for k, v in rows[0].items() if isinstance(v, (str, int, float))]
        lines += ["", "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        for r in rows:
            cells = [f"{r.get(c):.4g}" if isinstance(r.get(c), float) else str(r.get(c))
                     for c in cols]
            lines += ["| " + " | ".join(cells) + " |"]
    else:
        lines += ["keys: " + ", ".join(map(str, rep))]
(out / "summary.md").write_text("\n".join(lines) + "\n")
EOF
}

if [[ $build_rc -ne 0 ]]; then
  echo "gpu_check: BUILD FAILED (rc $build_rc); last lines of $OUT/build.log:" >&2
  tail -n 40 "$OUT/build.log" >&2
  summary_py || true
  exit "$build_rc"
fi
"$PY" -c "import importlib.util as u; print('gpu_check: CUDA extension at', u.find_spec('fp8jax._fp8jax_cuda').origin)" \
  | tee -a "$OUT/build.log" || echo "gpu_check: WARNING: no CUDA extension after an FP8JAX_CUDA=ON build" | tee -a "$OUT/build.log"
# Which libcublasLt the extension loads, and that the cuBLASLt GEMM is among its registered kernels.
"$PY" - <<'EOF' 2>&1 | tee -a "$OUT/build.log" || true
import importlib.util, subprocess

from fp8jax import _ffi

spec = importlib.util.find_spec("fp8jax._fp8jax_cuda")
if spec is not None and spec.origin:
    ldd = subprocess.run(["ldd", spec.origin], capture_output=True, text=True).stdout
    print("gpu_check:", *[ln.strip() for ln in ldd.splitlines() if "cublas" in ln] or ["no cublas"])
ext = _ffi.cuda_extension()
names = sorted(ext.registrations()) if ext is not None else []
print("gpu_check: CUDA targets:", ", ".join(names) or "none (the extension did not load)")
if "fp8jax_gemm" not in names:
    print("gpu_check: WARNING: fp8jax_gemm (cuBLASLt FP8 GEMM) is not registered")
EOF

finish() {  # the summary, the pack; exits with $1
  summary_py
  echo "gpu_check: summary in $OUT/summary.md"
  cat "$OUT/summary.md"
  if [[ "${GPU_CHECK_PACK:-0}" == 1 ]]; then
    pack="$(mktemp)"
    tar czf "$pack" -C "$OUT" . && mv "$pack" "$OUT/gpu_check.tgz" &&
      find "$OUT" -mindepth 1 ! -name gpu_check.tgz ! -name summary.md ! -name pytest.log -delete
    echo "gpu_check: everything packed in $OUT/gpu_check.tgz"
  fi
  exit "$1"
}

# ---------------------------------------------------------------- the perf profile
stage() {  # stage NAME UNTIL CMD...: runs CMD until epoch UNTIL at the latest, logs to bench.log
  local name="$1" until="$2" rc=0 t0
  shift 2
  t0=$(date +%s)
  if ((until - t0 < 15)); then
    echo "$name: not run (the deadline left $((until - t0)) s)" | tee -a "$OUT/stages.txt"
    return 0
  fi
  echo "===== $name: $*" >>"$OUT/bench.log"
  PYTHONUNBUFFERED=1 timeout -k 10 $((until - t0)) "$@" >>"$OUT/bench.log" 2>&1 || rc=$?
  echo "$name: rc $rc in $(($(date +%s) - t0)) s" | tee -a "$OUT/stages.txt"
}

if [[ "$PROFILE" == perf ]]; then
  mkdir -p "$OUT/bench"
  : >"$OUT/bench.log"
  e2e_until=$((GPU_CHECK_DEADLINE - GEMM_RESERVE - GROUPED_RESERVE - TEST_RESERVE - CLOSE_RESERVE))
  read -r -a e2e_args <<<"${GPU_CHECK_E2E_ARGS:-}"
  stage e2e "$e2e_until" "$PY" benchmarks/e2e.py --json "$OUT/bench/e2e.json" \
    --deadline "$((e2e_until - 5))" "${e2e_args[@]}"
  stage gemm "$((GPU_CHECK_DEADLINE - GROUPED_RESERVE - TEST_RESERVE - CLOSE_RESERVE))" \
    "$PY" benchmarks/gemm.py --shapes "${PERF_GEMM_SHAPES[@]}" --iters 10 --inner 5 --warmup 2 \
    --json "$OUT/bench/gemm.json"
  grouped_until=$((GPU_CHECK_DEADLINE - TEST_RESERVE - CLOSE_RESERVE))
  stage grouped_gemm "$((grouped_until - GROUPED_RESERVE / 2))" "$PY" benchmarks/grouped_gemm.py \
    --iters 5 --inner 3 --warmup 1 --json "$OUT/bench/grouped_gemm.json"
  stage moe "$grouped_until" "$PY" benchmarks/moe.py --iters 3 --inner 1 --warmup 1 \
    --json "$OUT/bench/moe.json"
  pytest_rc="not run"
  left=$((GPU_CHECK_DEADLINE - CLOSE_RESERVE - $(date +%s)))
  if [[ ${#PERF_TEST_IDS[@]} -gt 0 && $left -ge 30 ]]; then
    # the kernels only (the XLA side of each op test ran on GPUs before); processes share the GPU
    echo "gpu_check: pytest ${PERF_TEST_IDS[*]}" >"$OUT/pytest.log"
    pytest_rc=0
    FP8JAX_TEST_IMPLEMENTATIONS=kernel XLA_PYTHON_CLIENT_PREALLOCATE=false FP8JAX_TEST_FIRST="" \
      timeout -s INT -k 30 "$left" "$PY" -m pytest -v -rfE -n "${GPU_CHECK_TEST_JOBS:-4}" \
      "${PERF_TEST_IDS[@]}" --junitxml="$OUT/pytest.xml" >>"$OUT/pytest.log" 2>&1 || pytest_rc=$?
    echo "tests: rc $pytest_rc in at most $left s" | tee -a "$OUT/stages.txt"
  elif [[ ${#PERF_TEST_IDS[@]} -gt 0 ]]; then
    echo "tests: not run (the deadline left $left s)" | tee -a "$OUT/stages.txt"
  fi
  echo "gpu_check: perf profile done after $(($(date +%s) - START)) s" | tee -a "$OUT/stages.txt"
  finish "$([[ "$pytest_rc" == "not run" ]] && echo 0 || echo "$pytest_rc")"
fi

# ---------------------------------------------------------------- tests
echo "gpu_check: pytest, log in $OUT/pytest.log"
pytest_rc=0
# -v -rfE: every test's result is in the log as it finishes (a run stopped by the timeout, or
# one whose xdist workers hang at exit, as one GPU run's did, still says what passed and failed).
pytest_cmd=("$PY" -m pytest -v -rfE "${PYTEST_ARGS[@]}" --junitxml="$OUT/pytest.xml")
# GPU_CHECK_DEADLINE (epoch seconds): pytest gets what is left after the build, less
# GPU_CHECK_BENCH_RESERVE seconds (default 120) for the benchmarks; it overrides the fixed timeout.
if [[ -n "${GPU_CHECK_DEADLINE:-}" ]]; then
  GPU_CHECK_PYTEST_TIMEOUT=$((GPU_CHECK_DEADLINE - $(date +%s) - ${GPU_CHECK_BENCH_RESERVE:-120}))
  ((GPU_CHECK_PYTEST_TIMEOUT >= 30)) || GPU_CHECK_PYTEST_TIMEOUT=30
  echo "gpu_check: ${GPU_CHECK_PYTEST_TIMEOUT} s left for pytest before the deadline"
fi
if [[ -n "${GPU_CHECK_PYTEST_TIMEOUT:-}" ]]; then
  pytest_cmd=(timeout -s INT -k 60 "$GPU_CHECK_PYTEST_TIMEOUT" "${pytest_cmd[@]}")
fi
echo "gpu_check: ${pytest_cmd[*]}" >"$OUT/pytest.log"
"${pytest_cmd[@]}" >>"$OUT/pytest.log" 2>&1 || pytest_rc=$?
tail -n 5 "$OUT/pytest.log"
echo "gpu_check: pytest rc $pytest_rc"

# ---------------------------------------------------------------- benchmarks
run_bench() {  # run_bench SCRIPT JSON
  local rc=0
  echo "===== $1 --json $2" >>"$OUT/bench.log"
  if command -v timeout >/dev/null 2>&1; then
    timeout "$BENCH_TIMEOUT" "$PY" "$1" --json "$2" >>"$OUT/bench.log" 2>&1 || rc=$?
  else
    "$PY" "$1" --json "$2" >>"$OUT/bench.log" 2>&1 || rc=$?
  fi
  echo "===== $1: rc $rc" >>"$OUT/bench.log"
  echo "gpu_check: $1 rc $rc"
}

: >"$OUT/bench.log"
if [[ -f benchmarks/cast_bandwidth.py ]]; then
  run_bench benchmarks/cast_bandwidth.py "$OUT/cast_bandwidth.json"
fi
for script in benchmarks/*.py; do
  [[ -f "$script" ]] || continue
  name="$(basename "$script" .py)"
  # run.py is the suite runner (it runs these same scripts), not a benchmark
  if [[ "$name" == "cast_bandwidth" || "$name" == "run" || "$name" == _* ]] \
    || ! grep -q -- '--json' "$script"; then
    continue
  fi
  if [[ -n "${GPU_CHECK_BENCHES:-}" && " $GPU_CHECK_BENCHES " != *" $name "* ]]; then
    continue
  fi
  mkdir -p "$OUT/bench"
  run_bench "$script" "$OUT/bench/$name.json"
done

# ---------------------------------------------------------------- summary
finish "$pytest_rc"
