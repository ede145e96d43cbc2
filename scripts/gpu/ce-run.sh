#!/usr/bin/env bash
# Copy-engine path batch on the GPU machine: the intranode and runtime GPU tests, then the
# intranode benchmark at EP4 and EP2 (EP_BENCH_PATH selects ring|ce|both). Logs in $OUT.
set -uo pipefail
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0
OUT="${OUT:-$PWD/gpu-out}"
B="${EP_GPU_BIN:-.gpu/bin}"
ngpu=$(nvidia-smi -L | wc -l)
{ date -u +%FT%TZ; nvidia-smi -L; } >"$OUT/machine.txt" 2>&1
for t in ${EP_CE_TESTS-gpu_intranode gpu_runtime}; do
    timeout 240 "$B/$t" >"$OUT/$t.txt" 2>&1
    echo "$t rc=$? $(grep -E 'FAIL|passed, ' "$OUT/$t.txt" | tail -n 6 | tr '\n' ' ')"
done
for ranks in ${EP_CE_RANKS-4 2}; do
    [[ $ngpu -lt $ranks ]] && continue
    vis=$(seq -s, 0 $((ranks - 1)))
    CUDA_VISIBLE_DEVICES=$vis EP_BENCH_RANKS=$ranks EP_BENCH_OUT="$OUT/intranode-ep$ranks.json" \
        EP_BENCH_PATH="${EP_BENCH_PATH:-ce}" timeout "${EP_CE_BENCH_TIMEOUT:-150}" "$B/bench_intranode" \
        >"$OUT/bench-intranode-ep$ranks.txt" 2>&1
    echo "bench_intranode EP$ranks rc=$?"
    grep -E "best|nccl|vs NCCL" "$OUT/bench-intranode-ep$ranks.txt"
done
