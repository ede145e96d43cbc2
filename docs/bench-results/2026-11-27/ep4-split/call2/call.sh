#!/usr/bin/env bash
# Call 2 (sixteenth session, 4 GPUs): the one-pass layout kernel and the dispatch's outputs
# without memsets. GPU tests (layout, intranode kernels, runtime, layer at 1 and 4 GPUs), then
# bench_moe_layer, old (call 1's build) and new alternating, at EP4 and EP2.
set -uo pipefail
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo
B=.gpu/d2
R=/tmp/d2
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
grep -E 'get_dispatch_layout' $R/gpu_layout_fp8.txt | head -n 12
t gpu_intranode 200
t gpu_runtime 200
t gpu_layer_ep 200
t gpu_layer 150 CUDA_VISIBLE_DEVICES=0
layer() {
    local tag=$1 bin=$2 ranks=$3 tokens=$4 s=$SECONDS; shift 4
    env "$@" CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((ranks - 1))) EP_BENCH_RANKS=$ranks EP_BENCH_TOKENS=$tokens \
        EP_BENCH_ITERS=20 EP_BENCH_OUT=$R/layer-$tag.json timeout 150 $B/$bin >"$R/layer-$tag.txt" 2>&1
    echo "layer $tag rc=$? ($((SECONDS - s)) s)"; grep -E '^ *[0-9]+ +(normal|dispatch of)' "$R/layer-$tag.txt" | cut -c1-230
}
for i in 1 2 3; do
    layer ep4-old-$i bench_moe_layer_old 4 2048,4096,8192
    layer ep4-new-$i bench_moe_layer 4 2048,4096,8192
done
for i in 1 2; do
    layer ep2-old-$i bench_moe_layer_old 2 4096,8192
    layer ep2-new-$i bench_moe_layer 2 4096,8192
    layer ep4-new-fp8-$i bench_moe_layer 4 4096 EP_BENCH_FP8=1
done
tar -C $R -czf $OUT/call2.tgz .
echo "total ${SECONDS}s"
