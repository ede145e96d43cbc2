#!/usr/bin/env bash
# Call 2 (fifteenth session, 4 GPUs): gpu_grouped_gemm after rounding grids to whole clusters;
# gpu_layer (1 GPU); bench_moe_layer at EP4 over 2048 / 4096 / 8192 tokens, bf16 and fp8,
# without and with the pipeline over 2 expert groups; at EP2 (GPUs 0, 1: copy-engine path at
# 4096) without and with it, per-tile / persistent / 108-SM grids.
set -uo pipefail
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo
B=.gpu/d2
R=/tmp/d2
mkdir -p $R
for f in "$B"/*.xz; do xz -d -f "$f" & done; wait
chmod +x "$B"/*
{ date -u +%FT%TZ; nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm --format=csv; } >"$R/machine.txt" 2>&1
head -n 3 "$R/machine.txt"
left() { (( SECONDS < ${1} )); }
for t in gpu_grouped_gemm gpu_layer; do
    s=$SECONDS
    CUDA_VISIBLE_DEVICES=0 timeout 200 $B/$t >"$R/$t.txt" 2>&1
    echo "$t rc=$? ($((SECONDS - s)) s): $(grep -E '^[0-9]+ passed' $R/$t.txt | tail -n 1)"
    grep -E '^(FAILED|FAIL )' $R/$t.txt | head -n 5
done
layer() {
    local tag=$1 ranks=$2 groups=$3 grid=$4 fp8=$5 s=$SECONDS
    local g=(); [ "$grid" != default ] && g=(EP_BENCH_GEMM_GRID=$grid)
    env "${g[@]}" CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((ranks - 1))) EP_BENCH_RANKS=$ranks EP_BENCH_TOKENS=$TOKENS \
        EP_BENCH_ITERS=20 EP_BENCH_EXPERT_GROUPS=$groups EP_BENCH_FP8=$fp8 \
        EP_BENCH_OUT=$R/layer-$tag.json timeout 150 $B/bench_moe_layer >"$R/layer-$tag.txt" 2>&1
    echo "layer $tag rc=$? ($((SECONDS - s)) s)"; grep -E '^ *[0-9]+ +normal' "$R/layer-$tag.txt" | cut -c1-170
}
TOKENS=2048,4096,8192
for i in 1 2; do
    left 300 || break
    layer ep4-base-$i 4 1 default 0
    layer ep4-g2-$i 4 2 default 0
    layer ep4-fp8-$i 4 1 default 1
    layer ep4-g2-fp8-$i 4 2 default 1
done
TOKENS=4096,8192
for i in 1 2; do
    left 480 || break
    layer ep2-base-$i 2 1 default 0
    layer ep2-g2-$i 2 2 default 0
    layer ep2-g2-persistent-$i 2 2 persistent 0
    layer ep2-g2-108-$i 2 2 108 0
    layer ep2-g1-pertile-$i 2 1 per-tile 0
done
tar -C $R -czf $OUT/call2.tgz .
echo "total ${SECONDS}s"
