#!/usr/bin/env bash
# Call 1 (fifteenth session, 4 GPUs): the grouped GEMM's launch grids (GemmGrid) against the
# host twin; gpu_layer_ep with the expert-group pipeline and the grids; bench_moe_layer at EP4
# with the pipeline over expert groups (1 / 2 / 4 groups, persistent / per-tile / 108-SM grids)
# alternating; bench_intranode EP4 copy engines and rings (issue 19 on this machine).
set -uo pipefail
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo
B=.gpu/d1
R=/tmp/d1
mkdir -p $R
for f in "$B"/*.xz; do xz -d -f "$f" & done; wait
chmod +x "$B"/*
{ date -u +%FT%TZ; nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm --format=csv; } >"$R/machine.txt" 2>&1
head -n 3 "$R/machine.txt"
left() { (( SECONDS < ${1} )); }
s=$SECONDS
CUDA_VISIBLE_DEVICES=0 timeout 120 $B/gpu_grouped_gemm >"$R/gpu_grouped_gemm.txt" 2>&1
echo "gpu_grouped_gemm rc=$? ($((SECONDS - s)) s): $(grep -E '^[0-9]+ passed' $R/gpu_grouped_gemm.txt | tail -n 1)"
grep -E '^(FAILED|FAIL )' $R/gpu_grouped_gemm.txt | head -n 5
s=$SECONDS
timeout 240 $B/gpu_layer_ep >"$R/gpu_layer_ep.txt" 2>&1
echo "gpu_layer_ep rc=$? ($((SECONDS - s)) s): $(grep -E '^[0-9]+ passed' $R/gpu_layer_ep.txt | tail -n 1)"
grep -E '^(FAILED|FAIL )' $R/gpu_layer_ep.txt | head -n 8
layer() {
    local tag=$1 groups=$2 grid=$3 s=$SECONDS
    local g=(); [ "$grid" != default ] && g=(EP_BENCH_GEMM_GRID=$grid)
    env "${g[@]}" EP_BENCH_RANKS=4 EP_BENCH_TOKENS=${TOKENS:-4096} EP_BENCH_ITERS=20 EP_BENCH_EXPERT_GROUPS=$groups \
        EP_BENCH_OUT=$R/layer-$tag.json timeout 150 $B/bench_moe_layer >"$R/layer-$tag.txt" 2>&1
    echo "layer $tag rc=$? ($((SECONDS - s)) s)"; grep -E '^ *[0-9]+ +normal' "$R/layer-$tag.txt" | cut -c1-170
}
for i in 1 2; do
    left 420 || break
    layer base-$i 1 default
    layer g2-$i 2 default
    layer g1-pertile-$i 1 per-tile
    layer g2-persistent-$i 2 persistent
    layer g4-$i 4 default
    layer g2-108-$i 2 108
done
ce() {
    local tag=$1 path=$2 s=$SECONDS
    EP_BENCH_RANKS=4 EP_BENCH_QUICK=1 EP_BENCH_PATH=$path EP_BENCH_OUT=$R/intranode-$tag.json timeout 90 \
        $B/bench_intranode >"$R/intranode-$tag.txt" 2>&1
    echo "intranode $tag rc=$? ($((SECONDS - s)) s)"
    grep -E 'best at <= 24|nccl-rows' "$R/intranode-$tag.txt"
}
if left 540; then ce ep4-ce ce; fi
if left 560; then ce ep4-ring ring; fi
tar -C $R -czf $OUT/call1.tgz .
echo "total ${SECONDS}s"
