#!/usr/bin/env bash
# Call 3 (sixteenth session, 4 GPUs): the final tree's GPU tests (the count-independent dispatch
# outputs now allocated before the notify), then bench_moe_layer: old (call 1's build) / new /
# new with the shared expert first, alternating, at EP4 and EP2; last, the new build without
# cudarc's per-slice event tracking (what those host calls cost the layer).
set -uo pipefail
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo
B=.gpu/d3
R=/tmp/d3
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
t gpu_layout_fp8 60 CUDA_VISIBLE_DEVICES=0
t gpu_intranode 200
t gpu_runtime 200
t gpu_layer_ep 200
t gpu_layer 150 CUDA_VISIBLE_DEVICES=0
layer() {
    local tag=$1 bin=$2 ranks=$3 tokens=$4 s=$SECONDS; shift 4
    env "$@" CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((ranks - 1))) EP_BENCH_RANKS=$ranks EP_BENCH_TOKENS=$tokens \
        EP_BENCH_ITERS=20 EP_BENCH_OUT=$R/layer-$tag.json timeout 150 $B/$bin >"$R/layer-$tag.txt" 2>&1
    echo "layer $tag rc=$? ($((SECONDS - s)) s)"; grep -E '^ *[0-9]+ +normal' "$R/layer-$tag.txt" | cut -c1-150
}
for i in 1 2 3; do
    layer ep4-old-$i bench_moe_layer_old 4 2048,4096,8192
    layer ep4-new-$i bench_moe_layer 4 2048,4096,8192
    layer ep4-sharedfirst-$i bench_moe_layer 4 2048,4096,8192 EP_BENCH_SHARED_FIRST=1
done
for i in 1 2; do
    layer ep2-old-$i bench_moe_layer_old 2 4096,8192
    layer ep2-new-$i bench_moe_layer 2 4096,8192
done
for i in 1 2; do
    layer ep4-new-b$i bench_moe_layer 4 2048,4096,8192
    layer ep4-notracking-$i bench_moe_layer 4 2048,4096,8192 EP_BENCH_NO_EVENT_TRACKING=1
done
tar -C $R -czf $OUT/call3.tgz .
echo "total ${SECONDS}s"
