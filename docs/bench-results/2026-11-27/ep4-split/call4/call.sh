#!/usr/bin/env bash
# Call 4 (sixteenth session, 4 GPUs): call 3's build, the shared expert queued after the
# dispatch (default) against before it on the SMs the transfer leaves
# (EP_BENCH_SHARED_FIRST=1), alternating five times at EP4 and EP2.
set -uo pipefail
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo
B=.gpu/d3
R=/tmp/d4
rm -rf $R; mkdir -p $R
for f in "$B"/bench_moe_layer.xz; do xz -d -f "$f"; done
chmod +x "$B"/*
{ date -u +%FT%TZ; nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm --format=csv; } >"$R/machine.txt" 2>&1
head -n 3 "$R/machine.txt"
layer() {
    local tag=$1 bin=$2 ranks=$3 tokens=$4 s=$SECONDS; shift 4
    env "$@" CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((ranks - 1))) EP_BENCH_RANKS=$ranks EP_BENCH_TOKENS=$tokens \
        EP_BENCH_ITERS=20 EP_BENCH_OUT=$R/layer-$tag.json timeout 150 $B/$bin >"$R/layer-$tag.txt" 2>&1
    echo "layer $tag rc=$? ($((SECONDS - s)) s)"; grep -E '^ *[0-9]+ +normal' "$R/layer-$tag.txt" | cut -c1-150
}
for i in 1 2 3 4 5; do
    layer ep4-default-$i bench_moe_layer 4 2048,4096,8192
    layer ep4-sharedfirst-$i bench_moe_layer 4 2048,4096,8192 EP_BENCH_SHARED_FIRST=1
    layer ep2-default-$i bench_moe_layer 2 2048,4096,8192
    layer ep2-sharedfirst-$i bench_moe_layer 2 2048,4096,8192 EP_BENCH_SHARED_FIRST=1
done
tar -C $R -czf $OUT/call4.tgz .
echo "total ${SECONDS}s"
