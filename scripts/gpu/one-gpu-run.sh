#!/usr/bin/env bash
# One batch on a one-GPU machine (H100 or H200): every GPU test at one rank, compute-sanitizer
# on small cases of the expert path and the layer, and the one-GPU benchmarks with the PyTorch
# anchor, in one device command so that every figure comes from the same GPU and run.
#
# Usage (GPU machine, repo root, binaries carried in $EP_GPU_BIN, optionally .xz-compressed):
#   bash scripts/gpu/one-gpu-run.sh [tests|sanitize|layer|gemm]...   (default: all)
# (gemm = bench_grouped_gemm and the PyTorch anchor; layer = bench_moe_layer)
set -uo pipefail
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
OUT="${OUT:-$PWD/gpu-out}"
B="${EP_GPU_BIN:-.gpu/bin}"
mkdir -p "$OUT"
for f in "$B"/*.xz; do [[ -e "$f" ]] && xz -d -f "$f"; done
chmod +x "$B"/* 2>/dev/null
steps=("$@")
[[ ${#steps[@]} -eq 0 ]] && steps=(tests sanitize layer gemm)
want() { [[ " ${steps[*]} " == *" $1 "* ]]; }
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,power.limit --format=csv; } | tee "$OUT/machine.txt"
if want tests; then
    EP_GPU_BIN="$B" OUT="$OUT" EP_GPU_TIMEOUT="${EP_GPU_TIMEOUT:-300}" bash scripts/gpu/run-all.sh >"$OUT/tests.txt" 2>&1
    tail -n 14 "$OUT/tests.txt"
fi
if want sanitize; then
    for tool in memcheck racecheck; do
        for spec in "gpu_grouped_gemm small-odd" "gpu_grouped_gemm swiglu/contiguous/one-group" "gpu_expert_path expert-order/aligned" "gpu_layer hot-expert/low-latency/T=7"; do
            set -- $spec
            timeout 240 compute-sanitizer --tool "$tool" --error-exitcode 9 "$B/$1" "$2" >"$OUT/sanitize-$tool-$1.txt" 2>&1
            echo "sanitize $tool $1 $2: rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|passed, ' "$OUT/sanitize-$tool-$1.txt" | tr '\n' ' ')"
        done
    done
fi
if want layer; then
    EP_BENCH_OUT="$OUT/bench_moe_layer.json" timeout 500 "$B/bench_moe_layer" >"$OUT/bench_moe_layer.txt" 2>&1
    echo "bench_moe_layer rc=$?"; tail -n 13 "$OUT/bench_moe_layer.txt"
fi
if want gemm; then
    EP_BENCH_OUT="$OUT/bench_grouped_gemm.json" timeout 500 "$B/bench_grouped_gemm" >"$OUT/bench_grouped_gemm.txt" 2>&1
    echo "bench_grouped_gemm rc=$?"; grep -E "^(case|contiguous|masked|bf16)" "$OUT/bench_grouped_gemm.txt" | grep -v " done$" | grep -E "auto|torch|dense|moe_gemm|case|bf16"
    PYTHONUNBUFFERED=1 timeout 500 python3 scripts/gpu/anchors/torch_grouped_mm.py >"$OUT/torch_grouped_mm.txt" 2>&1
    echo "torch anchor rc=$?"; grep -v '^JSON ' "$OUT/torch_grouped_mm.txt" | tail -n 20
fi
