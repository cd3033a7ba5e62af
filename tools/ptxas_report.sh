#!/usr/bin/env bash
# ptxas report: bash tools/ptxas_report.sh
#
# Compiles every CUDA source (cpp/cuda/*.cu) with `-Xptxas -v` for each GPU the build ships
# machine code for (CMakeLists.txt: sm_89, sm_90) and, from the shipped compute_90 PTX, for the
# newest GPU this nvcc knows: what the driver makes of that PTX on a newer GPU. Prints one
# line per kernel and arch: registers, shared memory, stack frame, spill stores/loads. Exits
# non-zero when any kernel spills (a spill means local-memory traffic in a kernel whose whole
# point is streaming memory at full bandwidth) or when a compile fails.
#
# Needs nvcc and the XLA FFI headers (jax.ffi.include_dir() of the python in $FP8JAX_PY, ./.venv,
# or python3). No GPU. FP8JAX_PTXAS_ARCHS overrides the list (default "89 90 newest"; "newest" is
# the newest arch above sm_90 that nvcc knows, left out when there is none); FP8JAX_PTXAS_FLAGS
# adds nvcc flags; FP8JAX_PTXAS_SOURCES replaces the list of sources. FP8JAX_PTXAS_LOGS names a
# directory of the build's own reports (FP8JAX_PTXAS_LOG_DIR at build time, tools/ptxas_log.sh):
# an arch found in a source's report there is read from it, not compiled again; the CUTLASS
# units' (cpp/sm90/, sm_90a) are reported from there only.

set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

if ! command -v nvcc >/dev/null 2>&1; then
  echo "ptxas_report: nvcc not on PATH" >&2
  exit 2
fi
py="${FP8JAX_PY:-}"
if [[ -z "$py" ]]; then
  if [[ -x .venv/bin/python ]]; then py=.venv/bin/python; else py=python3; fi
fi
if ! ffi_inc="$("$py" -c 'import jax; print(jax.ffi.include_dir())' 2>/dev/null)"; then
  echo "ptxas_report: $py cannot import jax (needed for the XLA FFI headers)" >&2
  exit 2
fi

# "newest": the newest real arch this nvcc supports, when newer than sm_90 (the PTX JIT target).
newest="$(nvcc --list-gpu-arch 2>/dev/null | sed -n 's/^compute_\([0-9]*\)$/\1/p' | sort -n |
  tail -n 1)"
archs=""
for arch in ${FP8JAX_PTXAS_ARCHS:-89 90 newest}; do
  if [[ "$arch" == newest ]]; then
    if [[ -n "$newest" && "$newest" -gt 90 ]]; then
      archs="$archs $newest"
    fi
  else
    archs="$archs $arch"
  fi
done

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
# One nvcc call per source for the archs its build report lacks (the front end runs once),
# sources in parallel.
sources=(${FP8JAX_PTXAS_SOURCES:-cpp/cuda/*.cu})
max_jobs="$(nproc 2>/dev/null || echo 2)"
from_logs=()
for src in "${sources[@]}"; do
  base="$tmp/$(basename "$src")"
  built="${FP8JAX_PTXAS_LOGS:+$FP8JAX_PTXAS_LOGS/$(basename "$src").log}"
  gencodes=()
  for arch in $archs; do
    if [[ -n "$built" && -f "$built" ]] && grep -q "for 'sm_$arch'" "$built"; then
      from_logs+=("$(basename "$src") sm_$arch")
    elif ((arch > 90)); then  # the shipped compute_90 PTX, assembled as the driver would
      gencodes+=(-gencode "arch=compute_90,code=sm_$arch")
    else
      gencodes+=(-gencode "arch=compute_$arch,code=sm_$arch")
    fi
  done
  if [[ -n "$built" && -f "$built" ]]; then
    cp "$built" "$base.built.log"
  else
    : >"$base.built.log"
  fi
  (
    rc=0
    if ((${#gencodes[@]})); then
      # shellcheck disable=SC2086 # FP8JAX_PTXAS_FLAGS is a list of flags
      nvcc -std=c++20 -O3 "${gencodes[@]}" -Icpp -isystem "$ffi_inc" -Xptxas -v \
        ${FP8JAX_PTXAS_FLAGS:-} -c "$src" -o "$base.o" >"$base.log" 2>&1 || rc=$?
    else
      : >"$base.log"
    fi
    cat "$base.built.log" >>"$base.log"
    echo "$rc" >"$base.rc"
  ) &
  while (($(jobs -rp | wc -l) >= max_jobs)); do
    wait -n || true
  done
done
wait
if ((${#from_logs[@]})); then
  echo "ptxas_report: read from the build's reports ($FP8JAX_PTXAS_LOGS): ${from_logs[*]}"
fi
# report LOG ARCH: one line per kernel of ARCH in ptxas's LOG; fails on a spill.
report() {
  "$py" - "$1" "$2" <<'PY'
import re
import subprocess
import sys

entry = re.compile(r"Compiling entry function '([^']+)' for 'sm_(\w+)'")
frame = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")
used = re.compile(r"Used (\d+) registers")
smem_re = re.compile(r"(\d+) bytes smem")
rows, name, stack = [], None, None
for line in open(sys.argv[1]):
    if m := entry.search(line):
        name, stack = (m.group(1) if m.group(2) == sys.argv[2] else None), None
    elif name and (m := frame.search(line)):
        stack = tuple(int(v) for v in m.groups())
    elif name and (m := used.search(line)):
        regs, sm = int(m.group(1)), smem_re.search(line)
        smem = int(sm.group(1)) if sm else 0
        rows.append((name, regs, smem, *(stack or (0, 0, 0))))
        name = None
if not rows:
    sys.exit(f"ptxas_report: no sm_{sys.argv[2]} kernels found in the ptxas output")
filt = next((t for t in ("cu++filt", "c++filt") if subprocess.run(
    ["which", t], capture_output=True).returncode == 0), None)
names = [r[0] for r in rows]
if filt:
    out = subprocess.run([filt], input="\n".join(names), capture_output=True, text=True).stdout
    names = out.splitlines() if out.count("\n") + 1 >= len(names) else names
spills = 0
print(f"{'regs':>5} {'smem':>6} {'stack':>6} {'spill_st':>8} {'spill_ld':>8}  kernel")
for (_, regs, smem, stk, st, ld), nm in zip(rows, names):
    nm = re.sub(r"fp8jax::(plan::)?(\(anonymous namespace\)::)?", "", nm).removeprefix("void ")
    nm = nm.split(">(")[0] + ">" if ">(" in nm else nm.split("(")[0]  # drop the parameters
    for i, kind in enumerate(("f32", "bf16", "f16")):
        nm = nm.replace(f"(WideKind){i}", kind)
    flag = "  <-- SPILL" if st or ld else ""
    spills += bool(st or ld)
    print(f"{regs:>5} {smem:>6} {stk:>6} {st:>8} {ld:>8}  {nm}{flag}")
if spills:
    sys.exit(f"ptxas_report: FAIL: {spills} kernel(s) spill registers to local memory")
PY
}

status=0
for src in "${sources[@]}"; do
  base="$tmp/$(basename "$src")"
  if [[ "$(cat "$base.rc")" != 0 ]]; then
    cat "$base.log" >&2
    echo "ptxas_report: FAIL: $src does not compile for sm_{${archs// /,}}" >&2
    status=1
    continue
  fi
  for arch in $archs; do
    echo "== $src sm_$arch"
    log="$base.log"
    report "$log" "$arch" || status=1
  done
done
# The grouped GEMM's CUTLASS instantiations (cpp/sm90/, sm_90a only; CMake generates one translation
# unit per instantiation): from the build's reports only, when it built them.
sm90_logs=()
for log in "${FP8JAX_PTXAS_LOGS:-/nonexistent}"/grouped_gemm_instance_*.cu.log; do
  [[ -f "$log" ]] && sm90_logs+=("$log")
done
for log in "${sm90_logs[@]}"; do
  echo "== cpp/sm90/$(basename "$log" .log) sm_90a (the build's report)"
  report "$log" 90a || status=1
done
if [[ $status -ne 0 ]]; then
  echo "ptxas_report: FAIL" >&2
  exit "$status"
fi
echo "ptxas_report: ok, no spills (archs: $archs${sm90_logs:+; ${#sm90_logs[@]} CUTLASS units, sm_90a})"
