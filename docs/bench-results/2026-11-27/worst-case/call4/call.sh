#!/usr/bin/env bash
# Call 4 (seventeenth session, 4 GPUs): call 3 again after the fix of the captured prefill step
# (the capture joins the communication stream at its end): gpu_layer_ep, then bench_moe_layer
# alternating exact against worst-case dispatch outputs (the worst-case step also timed as a
# captured graph) at EP2 and EP4.
set -uo pipefail
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo
B=.gpu/w4
R=/tmp/w4
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
t gpu_layer_ep 200
layer() {
    local tag=$1 ranks=$2 tokens=$3 s=$SECONDS; shift 3
    env "$@" CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((ranks - 1))) EP_BENCH_RANKS=$ranks EP_BENCH_TOKENS=$tokens \
        EP_BENCH_ITERS=20 EP_BENCH_OUT=$R/layer-$tag.json timeout 100 $B/bench_moe_layer >"$R/layer-$tag.txt" 2>&1
    echo "$tag rc=$? $(grep -E '^ *[0-9]+ +normal' "$R/layer-$tag.txt" | cut -c1-150)"
    grep -h "^T=" "$R/layer-$tag.txt" | grep graph
}
for i in 1 2 3 4; do
    left 330 || break
    for tok in 4096 8192; do
        layer ep2-exact-$tok-$i 2 $tok
        layer ep2-worst-$tok-$i 2 $tok EP_BENCH_WORST=$tok
    done
    for tok in 2048 4096 8192; do
        layer ep4-exact-$tok-$i 4 $tok
        layer ep4-worst-$tok-$i 4 $tok EP_BENCH_WORST=$tok
    done
done
tar -C $R -czf $OUT/call4.tgz .
echo "total ${SECONDS}s"
