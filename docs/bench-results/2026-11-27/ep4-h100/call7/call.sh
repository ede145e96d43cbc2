#!/usr/bin/env bash
# Call 7 (fifteenth session, 4 GPUs): which grid and row sizing for normal mode's grouped GEMMs
# by default: the previous build (old: rows bounded by every slot, persistent grid) against
# this one (rows from the dispatch's counts) with the persistent and the per-tile grid,
# alternating five times, at EP4 (2048 / 4096 / 8192 tokens) and EP2 (4096 / 8192).
set -uo pipefail
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo
B=.gpu/d7
R=/tmp/d7
rm -rf $R; mkdir -p $R
for f in "$B"/*.xz; do xz -d -f "$f" & done; wait
chmod +x "$B"/*
{ date -u +%FT%TZ; nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm --format=csv; } >"$R/machine.txt" 2>&1
head -n 3 "$R/machine.txt"
left() { (( SECONDS < ${1} )); }
layer() {
    local tag=$1 bin=$2 ranks=$3 grid=$4 s=$SECONDS
    local g=(); [ "$grid" != default ] && g=(EP_BENCH_GEMM_GRID=$grid)
    env "${g[@]}" CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((ranks - 1))) EP_BENCH_RANKS=$ranks EP_BENCH_TOKENS=$TOKENS \
        EP_BENCH_ITERS=20 EP_BENCH_OUT=$R/layer-$tag.json timeout 150 $B/$bin >"$R/layer-$tag.txt" 2>&1
    echo "layer $tag rc=$? ($((SECONDS - s)) s)"; grep -E '^ *[0-9]+ +normal' "$R/layer-$tag.txt" | cut -c1-170
}
for i in 1 2 3 4 5; do
    left 360 || break
    TOKENS=2048,4096,8192
    layer ep4-old-$i bench_moe_layer_old 4 default
    layer ep4-persistent-$i bench_moe_layer 4 persistent
    layer ep4-pertile-$i bench_moe_layer 4 per-tile
    TOKENS=4096,8192
    layer ep2-old-$i bench_moe_layer_old 2 default
    layer ep2-persistent-$i bench_moe_layer 2 persistent
    layer ep2-pertile-$i bench_moe_layer 2 per-tile
done
tar -C $R -czf $OUT/call7.tgz .
echo "total ${SECONDS}s"
