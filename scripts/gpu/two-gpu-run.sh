#!/usr/bin/env bash
# One batch on a machine of 2 or more GPUs (nvidia-h200-x2 / -x4): the GPU tests that span GPUs
# and those of the layer, compute-sanitizer on small low-latency cases, and the benchmarks of
# the low-latency ops (both combines) and of the layer on one GPU and across all GPUs.
# Everything lands in $OUT (logs, JSON); the last lines of each step are printed.
#
# Usage (GPU machine, repo root, binaries carried in $EP_GPU_BIN, optionally .xz-compressed):
#   bash scripts/gpu/two-gpu-run.sh [tests|onegpu|ll|layer]...   (default: all four)
# tests: the multi-GPU test binaries ($EP_TEST_BINS); onegpu: compute-sanitizer on GPU 0 while
# the one-GPU layer tests ($EP_ONE_GPU_BINS) run on the last GPU.
# Env: EP_LL_RANKS / EP_LAYER_RANKS: the rank counts of the ll / layer steps (default: all GPUs
# and 2 / 1 and all GPUs).
set -uo pipefail
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
OUT="${OUT:-$PWD/gpu-out}"
B="${EP_GPU_BIN:-.gpu/bin}"
mkdir -p "$OUT"
for f in "$B"/*.xz; do [[ -e "$f" ]] && xz -d -f "$f"; done
chmod +x "$B"/* 2>/dev/null
steps=("$@")
[[ ${#steps[@]} -eq 0 ]] && steps=(tests onegpu ll layer)
want() { [[ " ${steps[*]} " == *" $1 "* ]]; }
ngpu=$(nvidia-smi -L | wc -l)
{ date -u +%FT%TZ; nvidia-smi --query-gpu=index,name,driver_version,memory.total,power.limit --format=csv; nvidia-smi topo -m; } >"$OUT/machine.txt" 2>&1
head -n 4 "$OUT/machine.txt"

# Runs test binary $1 (on the GPUs CUDA_VISIBLE_DEVICES leaves) and prints its summary.
run_test() {
    local t=$1 s rc
    [[ -x "$B/$t" ]] || { echo "$t: missing"; return; }
    s=$(date +%s)
    timeout "${EP_GPU_TIMEOUT:-240}" "$B/$t" >"$OUT/test-$t.txt" 2>&1
    rc=$?
    echo "$t rc=$rc ($(( $(date +%s) - s )) s): $(grep -E '^[0-9]+ passed, [0-9]+ failed' "$OUT/test-$t.txt" | tail -n 1)"
    grep -E '^(FAILED|FAIL )' "$OUT/test-$t.txt" | head -n 5
}
if want tests; then
    for t in ${EP_TEST_BINS:-gpu_low_latency gpu_layer_ep gpu_runtime}; do
        run_test "$t"
    done
fi
if want onegpu; then
    # Sanitizers on one GPU: they serialise kernels, so ranks spinning on each other across GPUs
    # of one process would only time out. r1 split phases run the multi-rank protocol kernels
    # (the per-rank combine included) at one rank.
    (
        for tool in memcheck racecheck; do
            for case in r1/split_phases/bf16/per_rank r1/round_trip/fp8/random/per_rank; do
                f="$OUT/sanitize-$tool-$(echo "$case" | tr / _).txt"
                CUDA_VISIBLE_DEVICES=0 timeout 150 compute-sanitizer --tool "$tool" --error-exitcode 9 \
                    "$B/gpu_low_latency" "$case" >"$f" 2>&1
                echo "sanitize $tool $case: rc=$? $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|passed, ' "$f" | tr '\n' ' ')"
            done
        done
    ) &
    (
        export CUDA_VISIBLE_DEVICES=$((ngpu - 1))
        for t in ${EP_ONE_GPU_BINS:-gpu_layer gpu_decode_graph}; do
            run_test "$t"
        done
    ) &
    wait
fi
if want ll; then
    for ranks in ${EP_LL_RANKS:-$ngpu 2}; do
        [[ $ngpu -lt $ranks ]] && continue
        vis=$(seq -s, 0 $((ranks - 1)))
        CUDA_VISIBLE_DEVICES=$vis EP_BENCH_RANKS=$ranks EP_BENCH_OUT="$OUT/low-latency-ep$ranks.json" \
            timeout 240 "$B/bench_low_latency" >"$OUT/bench-low-latency-ep$ranks.txt" 2>&1
        echo "bench_low_latency EP$ranks rc=$?"
        grep -E '^ +[0-9]+ ' "$OUT/bench-low-latency-ep$ranks.txt" | grep -E 'combine|dispatch \(x16|nccl'
        [[ -z "${EP_LL_RANKS:-}" && $ngpu -eq 2 ]] && break
    done
fi
if want layer; then
    for ranks in ${EP_LAYER_RANKS:-1 $ngpu}; do
        vis=$(seq -s, 0 $((ranks - 1)))
        CUDA_VISIBLE_DEVICES=$vis EP_BENCH_RANKS=$ranks EP_BENCH_OUT="$OUT/moe-layer-ep$ranks.json" \
            timeout "${EP_LAYER_TIMEOUT:-280}" "$B/bench_moe_layer" >"$OUT/bench-moe-layer-ep$ranks.txt" 2>&1
        echo "bench_moe_layer EP$ranks rc=$?"
        tail -n 12 "$OUT/bench-moe-layer-ep$ranks.txt"
    done
fi
