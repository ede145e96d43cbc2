#!/usr/bin/env bash
# One batch on a one-GPU machine for the experts' grouped GEMMs: the GPU tests, compute-sanitizer
# (memcheck, racecheck) on small cases, bench_grouped_gemm and the PyTorch anchor script, in one
# device command so that every figure comes from the same GPU in the same run.
#
# Usage (GPU machine, repo root, .gpu/bin carried; binaries may be .xz-compressed):
#   bash scripts/gpu/gemm-run.sh [tests|sanitize|bench|torch]...   (default: all)
set -uo pipefail
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
OUT="${OUT:-$PWD/gpu-out}"
B="${EP_GPU_BIN:-.gpu/bin}"
mkdir -p "$OUT"
for f in "$B"/*.xz; do [[ -e "$f" ]] && xz -d -f "$f"; done
chmod +x "$B"/* 2>/dev/null
steps=("$@")
[[ ${#steps[@]} -eq 0 ]] && steps=(tests sanitize bench torch)
want() { [[ " ${steps[*]} " == *" $1 "* ]]; }
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv; } | tee "$OUT/machine.txt"
if want tests; then
    timeout 600 "$B/gpu_grouped_gemm" >"$OUT/gpu_grouped_gemm.txt" 2>&1
    echo "gpu_grouped_gemm rc=$?"; grep -E "FAILED|passed, " "$OUT/gpu_grouped_gemm.txt"
fi
if want sanitize; then
    for tool in memcheck racecheck; do
        timeout 300 compute-sanitizer --tool "$tool" --error-exitcode 9 "$B/gpu_grouped_gemm" small-odd \
            >"$OUT/sanitize-$tool.txt" 2>&1
        echo "sanitize $tool: rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|passed, ' "$OUT/sanitize-$tool.txt" | tr '\n' ' ')"
    done
fi
if want bench; then
    EP_BENCH_OUT="$OUT/bench_grouped_gemm.json" timeout 900 "$B/bench_grouped_gemm" >"$OUT/bench_grouped_gemm.txt" 2>&1
    echo "bench_grouped_gemm rc=$?"; tail -n 40 "$OUT/bench_grouped_gemm.txt"
fi
if want torch; then
    PYTHONUNBUFFERED=1 timeout 900 python3 scripts/gpu/anchors/torch_grouped_mm.py >"$OUT/torch_grouped_mm.txt" 2>&1
    echo "torch anchor rc=$?"; grep -v '^JSON ' "$OUT/torch_grouped_mm.txt" | tail -n 24
fi
