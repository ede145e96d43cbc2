#!/usr/bin/env bash
# Runs, on the GPU machine, every packaged GPU test binary (see scripts/gpu/package.sh), keeps
# each one's full log under $OUT/logs/, and prints a summary table and a final
# `N passed, N failed` line (the sum over binaries; a binary that crashes or prints no such
# line counts as one failure). Exit code 1 if anything failed.
#
# Usage: bash scripts/gpu/run-all.sh [filter]     (filter: substring of the binary names)
# Env:   EP_GPU_BIN (default .gpu/bin), OUT (default ./gpu-out),
#        EP_GPU_TIMEOUT (seconds per binary, default 600),
#        EP_RUN_BENCHES=1 to also run bench* binaries (with no arguments).
set -uo pipefail

# NVLink SHARP / multicast is not used on these machines (see GPU-WORKFLOW.md).
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." 2>/dev/null && pwd)"
BIN_DIR="${EP_GPU_BIN:-$REPO_ROOT/.gpu/bin}"
[[ -d "$BIN_DIR" ]] || BIN_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/bin"
OUT="${OUT:-$PWD/gpu-out}"
TIMEOUT="${EP_GPU_TIMEOUT:-600}"
FILTER="${1:-}"
mkdir -p "$OUT/logs"

if [[ ! -d "$BIN_DIR" ]]; then
    echo "no binaries: $BIN_DIR does not exist (run scripts/gpu/package.sh first)"
    echo "0 passed, 1 failed"
    exit 1
fi

# A GPU test binary that runs no case fails (gpu-test-suite) unless skipping is allowed: on a
# machine of one GPU the multi-GPU suites (gpu_layer_ep, ...) have nothing to run there.
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
if [[ $gpus -eq 1 ]]; then
    export EP_GPU_ALLOW_SKIP="${EP_GPU_ALLOW_SKIP:-1}"
fi

{
    echo "== $(date -u +%FT%TZ) on $(hostname)"
    nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv 2>&1 || true
    nvidia-smi topo -m 2>&1 || true
} >"$OUT/logs/machine.txt"

rows=()
total_passed=0
total_failed=0
for exe in "$BIN_DIR"/*; do
    [[ -f "$exe" && -x "$exe" ]] || continue
    name="$(basename "$exe")"
    [[ -n "$FILTER" && "$name" != *"$FILTER"* ]] && continue
    case "$name" in
    gpu_*) ;;
    bench*) [[ "${EP_RUN_BENCHES:-0}" == 1 ]] || continue ;;
    *) continue ;;
    esac
    logf="$OUT/logs/$name.log"
    echo ">> $name" >&2
    start=$(date +%s.%N)
    timeout --kill-after=10 "$TIMEOUT" "$exe" >"$logf" 2>&1
    rc=$?
    secs=$(awk -v s="$start" -v e="$(date +%s.%N)" 'BEGIN { printf "%.1f", e - s }')
    # The binary's own closing line.
    line="$(grep -E '^[0-9]+ passed, [0-9]+ failed' "$logf" | tail -n 1)"
    if [[ -n "$line" ]]; then
        p="$(echo "$line" | sed -E 's/^([0-9]+) passed.*/\1/')"
        f="$(echo "$line" | sed -E 's/^[0-9]+ passed, ([0-9]+) failed.*/\1/')"
    else
        p=0
        f=0
    fi
    if [[ $rc -ne 0 && $f -eq 0 ]]; then
        f=1 # crashed, timed out, or failed without saying so
    fi
    case $rc in
    0) status="ok" ;;
    124 | 137) status="TIMEOUT" ;;
    *) status="FAIL(rc=$rc)" ;;
    esac
    total_passed=$((total_passed + p))
    total_failed=$((total_failed + f))
    rows+=("$(printf '%-32s %-12s %8s %8s %9s' "$name" "$status" "$p" "$f" "$secs")")
    # Show failing cases right away.
    grep -E '^(FAILED|thread .* panicked)' "$logf" | head -n 20 >&2 || true
done

echo
printf '%-32s %-12s %8s %8s %9s\n' "binary" "status" "passed" "failed" "seconds"
printf '%s\n' "${rows[@]:-}"
echo "logs: $OUT/logs"
if [[ ${#rows[@]} -eq 0 ]]; then
    echo "no GPU test binary matched in $BIN_DIR"
    total_failed=$((total_failed + 1))
fi
echo "$total_passed passed, $total_failed failed"
[[ $total_failed -eq 0 ]]
