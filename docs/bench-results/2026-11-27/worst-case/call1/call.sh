#!/usr/bin/env bash
# Call 1 (seventeenth session, 4 GPUs): worst-case dispatch outputs (num_worst_tokens /
# MoeLayerOptions::normal_max_tokens_per_rank). GPU tests (gpu_intranode, gpu_runtime with the
# worst-case and overflow cases, gpu_layer_ep with three worst-case setups, gpu_layer), then
# bench_moe_layer at EP4 (and EP2) per token count, exact outputs against worst-case outputs
# (EP_BENCH_WORST = the tokens per rank), alternating; last compute-sanitizer memcheck on the
# ring launch of gpu_runtime.
set -uo pipefail
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo
B=.gpu/w1
R=/tmp/w1
rm -rf $R; mkdir -p $R
for f in "$B"/*.xz; do xz -d -f "$f" & done; wait
chmod +x "$B"/*
{ date -u +%FT%TZ; nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm --format=csv; } >"$R/machine.txt" 2>&1
head -n 3 "$R/machine.txt"
left() { [ $((SECONDS)) -lt $1 ]; }
t() {
    local name=$1 lim=$2 s=$SECONDS; shift 2
    env "$@" timeout $lim $B/$name >"$R/$name.txt" 2>&1
    echo "$name rc=$? ($((SECONDS - s)) s): $(grep -E '^[0-9]+ passed' $R/$name.txt | tail -n 1)"
    grep -E '^(FAILED|FAIL )' $R/$name.txt | head -n 8
}
t gpu_runtime 200
t gpu_layer_ep 200
t gpu_intranode 200
t gpu_layer 150 CUDA_VISIBLE_DEVICES=0
layer() {
    local tag=$1 ranks=$2 tokens=$3 s=$SECONDS; shift 3
    env "$@" CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((ranks - 1))) EP_BENCH_RANKS=$ranks EP_BENCH_TOKENS=$tokens \
        EP_BENCH_ITERS=20 EP_BENCH_OUT=$R/layer-$tag.json timeout 100 $B/bench_moe_layer >"$R/layer-$tag.txt" 2>&1
    echo "layer $tag rc=$? ($((SECONDS - s)) s)"
    grep -E '^ *[0-9]+ +normal' "$R/layer-$tag.txt" | cut -c1-150
    grep -E 'dispatch of' "$R/layer-$tag.txt" | sed -E 's/.*with its layout/   with its layout/' | cut -c1-260
}
for i in 1 2 3 4; do
    for tok in 4096 2048 8192; do
        left 470 || break 2
        layer ep4-exact-$tok-$i 4 $tok
        layer ep4-worst-$tok-$i 4 $tok EP_BENCH_WORST=$tok
    done
done
for i in 1 2; do
    left 520 || break
    layer ep2-exact-4096-$i 2 4096
    layer ep2-worst-4096-$i 2 4096 EP_BENCH_WORST=4096
done
if left 540; then
    s=$SECONDS
    EP_GPU_RUNTIME_ONLY=equal-rings timeout 50 compute-sanitizer --target-processes all --report-api-errors no \
        --tool memcheck $B/gpu_runtime >"$R/sanitize-memcheck.txt" 2>&1
    echo "sanitize memcheck rc=$? ($((SECONDS - s)) s): $(grep -E 'ERROR SUMMARY|passed, ' "$R/sanitize-memcheck.txt" | sort | uniq -c | tr '\n' ' ')"
fi
tar -C $R -czf $OUT/call1.tgz .
echo "total ${SECONDS}s"
