#!/usr/bin/env bash
# Call 5 (sixteenth session, 4 GPUs): the final tree, the shared experts first by default:
# gpu_layer_ep and gpu_layer, then bench_moe_layer with the default and with the old order
# (EP_BENCH_SHARED_FIRST=0) alternating at EP4 and EP2.
set -uo pipefail
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo
B=.gpu/d5
R=/tmp/d5
rm -rf $R; mkdir -p $R
for f in "$B"/*.xz; do xz -d -f "$f" & done; wait
chmod +x "$B"/*
{ date -u +%FT%TZ; nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm --format=csv; } >"$R/machine.txt" 2>&1
head -n 3 "$R/machine.txt"
t() {
    local name=$1 lim=$2 s=$SECONDS; shift 2
    env "$@" timeout $lim $B/$name >"$R/$name.txt" 2>&1
    echo "$name rc=$? ($((SECONDS - s)) s): $(grep -E '^[0-9]+ passed' $R/$name.txt | tail -n 1)"
    grep -E '^(FAILED|FAIL )' $R/$name.txt | head -n 8
}
t gpu_layer_ep 200
t gpu_layer 150 CUDA_VISIBLE_DEVICES=0
layer() {
    local tag=$1 ranks=$2 tokens=$3 s=$SECONDS; shift 3
    env "$@" CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((ranks - 1))) EP_BENCH_RANKS=$ranks EP_BENCH_TOKENS=$tokens \
        EP_BENCH_ITERS=20 EP_BENCH_OUT=$R/layer-$tag.json timeout 150 $B/bench_moe_layer >"$R/layer-$tag.txt" 2>&1
    echo "layer $tag rc=$? ($((SECONDS - s)) s)"; grep -E '^ *[0-9]+ +(normal|low-lat)' "$R/layer-$tag.txt" | cut -c1-150
}
for i in 1 2 3; do
    layer ep4-default-$i 4 128,2048,4096,8192
    layer ep4-sharedafter-$i 4 2048,4096,8192 EP_BENCH_SHARED_FIRST=0
done
for i in 1 2; do
    layer ep2-default-$i 2 128,2048,4096,8192
    layer ep2-sharedafter-$i 2 2048,4096,8192 EP_BENCH_SHARED_FIRST=0
done
tar -C $R -czf $OUT/call5.tgz .
echo "total ${SECONDS}s"
