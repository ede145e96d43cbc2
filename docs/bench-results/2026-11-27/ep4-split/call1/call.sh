#!/usr/bin/env bash
# Call 1 (sixteenth session): where the layer's dispatch part goes at EP4 and EP2. bench_moe_layer
# now splits it: with its layout, the layout computed beforehand, and cached (the first
# dispatch's handle: no notify, no host read of the count), each with the GB/s it moves.
set -uo pipefail
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo
B=.gpu/d1
R=/tmp/d1
rm -rf $R; mkdir -p $R
for f in "$B"/*.xz; do xz -d -f "$f" & done; wait
chmod +x "$B"/*
{ date -u +%FT%TZ; nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm --format=csv; } >"$R/machine.txt" 2>&1
head -n 3 "$R/machine.txt"
layer() {
    local tag=$1 ranks=$2 tokens=$3 s=$SECONDS; shift 3
    env "$@" CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((ranks - 1))) EP_BENCH_RANKS=$ranks EP_BENCH_TOKENS=$tokens \
        EP_BENCH_ITERS=20 EP_BENCH_OUT=$R/layer-$tag.json timeout 150 $B/bench_moe_layer >"$R/layer-$tag.txt" 2>&1
    echo "layer $tag rc=$? ($((SECONDS - s)) s)"; grep -E '^ *[0-9]+ +(normal|dispatch)' "$R/layer-$tag.txt" | cut -c1-230
}
for i in 1 2; do
    layer ep4-$i 4 2048,4096,8192
    layer ep4-fp8-$i 4 4096 EP_BENCH_FP8=1
    layer ep2-$i 2 4096,8192
done
tar -C $R -czf $OUT/call1.tgz .
echo "total ${SECONDS}s"
