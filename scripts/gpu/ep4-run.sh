#!/usr/bin/env bash
# One batch on a 4-GPU machine (nvidia-h200-x4): the GPU tests that change with the normal-mode
# rings and the layer (gpu_intranode at 2 and 4 GPUs, gpu_runtime and gpu_layer_ep at 4
# processes / ranks, gpu_layer on the last GPU), the ring sweep over sending / receiving block
# splits beside NCCL, the layer at EP4 (bf16, fp8, fp8 + two-batch overlap) and the low-latency
# ops at EP4. Logs and JSON go to $OUT/ep4.tgz; summaries are printed.
#
# Usage (GPU machine, repo root, binaries carried in $EP_GPU_BIN, maybe .xz):
#   bash scripts/gpu/ep4-run.sh [tests|rings|layer|ll]...   (default: all four)
# Env: EP_RING_CHANNELS (sending blocks at 24 SMs, default 12,14,16,18), EP_LAYER_VARIANTS
#      (default "bf16 fp8 fp8-tbo"), EP_LAYER_TOKENS (default 128,2048,4096,8192).
set -uo pipefail
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
OUT="${OUT:-$PWD/gpu-out}"
B="${EP_GPU_BIN:-.gpu/bin}"
R=/tmp/ep4-run
rm -rf "$R" && mkdir -p "$R" "$OUT"
for f in "$B"/*.xz; do [[ -e "$f" ]] && xz -d -f "$f"; done
chmod +x "$B"/* 2>/dev/null
steps=("$@")
[[ ${#steps[@]} -eq 0 ]] && steps=(tests rings layer ll)
want() { [[ " ${steps[*]} " == *" $1 "* ]]; }
ngpu=$(nvidia-smi -L | wc -l)
{ date -u +%FT%TZ; nvidia-smi --query-gpu=index,name,driver_version,power.limit --format=csv; } >"$R/machine.txt" 2>&1
head -n 3 "$R/machine.txt"

run_test() {
    local t=$1 s
    [[ -x "$B/$t" ]] || { echo "$t: missing"; return; }
    s=$(date +%s)
    timeout "${EP_GPU_TIMEOUT:-240}" "$B/$t" >"$R/test-$t.txt" 2>&1
    echo "$t rc=$? ($(( $(date +%s) - s )) s): $(grep -E '^[0-9]+ passed, [0-9]+ failed' "$R/test-$t.txt" | tail -n 1)"
    grep -E '^(FAILED|FAIL )' "$R/test-$t.txt" | head -n 5
}
if want tests; then
    (CUDA_VISIBLE_DEVICES=$((ngpu - 1)) run_test gpu_layer) &
    for t in ${EP_TEST_BINS:-gpu_intranode gpu_runtime gpu_layer_ep}; do
        run_test "$t"
    done
    wait
fi
if want rings; then
    EP_BENCH_RANKS=$ngpu EP_BENCH_QUICK=1 EP_BENCH_PATH=ring EP_BENCH_RING_CHANNELS="${EP_RING_CHANNELS:-12,14,16,18}" \
        EP_BENCH_OUT="$R/intranode-ep$ngpu.json" timeout 300 "$B/bench_intranode" >"$R/intranode-ep$ngpu.txt" 2>&1
    echo "bench_intranode rc=$?"
    grep -E '^(dispatch|combine|nccl)' "$R/intranode-ep$ngpu.txt" | grep -v summary | head -n 40
fi
if want layer; then
    for v in ${EP_LAYER_VARIANTS:-bf16 fp8 fp8-tbo}; do
        fp8=0; tbo=0
        [[ $v == fp8* ]] && fp8=1
        [[ $v == *tbo ]] && tbo=1
        EP_BENCH_RANKS=$ngpu EP_BENCH_FP8=$fp8 EP_BENCH_TBO=$tbo EP_BENCH_TOKENS="${EP_LAYER_TOKENS:-128,2048,4096,8192}" \
            EP_BENCH_OUT="$R/moe-layer-ep$ngpu-$v.json" timeout 240 "$B/bench_moe_layer" >"$R/moe-layer-ep$ngpu-$v.txt" 2>&1
        echo "bench_moe_layer $v rc=$?"
        grep -A 8 '^tokens' "$R/moe-layer-ep$ngpu-$v.txt"
    done
fi
if want ll; then
    EP_BENCH_RANKS=$ngpu EP_BENCH_OUT="$R/low-latency-ep$ngpu.json" timeout 200 "$B/bench_low_latency" \
        >"$R/low-latency-ep$ngpu.txt" 2>&1
    echo "bench_low_latency rc=$?"
    grep -E '(x16 graph)|combine per rank  |dispatch per rank  |combine   ' "$R/low-latency-ep$ngpu.txt"
fi
tar -C "$R" -czf "$OUT/ep4.tgz" .
