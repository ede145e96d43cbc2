#!/usr/bin/env bash
# Call 6 (fifteenth session, 4 GPUs; call 5 again after the permute launcher accepts fewer rows than rows_bound): the normal-mode grouped GEMMs sized by the dispatch's
# per-expert counts (not every slot's rows): gpu_layer_ep, gpu_layer; bench_moe_layer at EP4
# (2048 / 4096 / 8192 tokens) and EP2 (4096 / 8192): the previous build (old) and this one
# with 1 group (persistent and per-tile) and 2 / 4 expert groups, alternating, twice.
set -uo pipefail
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo
B=.gpu/d6
R=/tmp/d6
rm -rf $R; mkdir -p $R
for f in "$B"/*.xz; do xz -d -f "$f" & done; wait
chmod +x "$B"/*
{ date -u +%FT%TZ; nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm --format=csv; } >"$R/machine.txt" 2>&1
head -n 3 "$R/machine.txt"
left() { (( SECONDS < ${1} )); }
s=$SECONDS
timeout 240 $B/gpu_layer_ep >"$R/gpu_layer_ep.txt" 2>&1
echo "gpu_layer_ep rc=$? ($((SECONDS - s)) s): $(grep -E '^[0-9]+ passed' $R/gpu_layer_ep.txt | tail -n 1)"
grep -E '^(FAILED|FAIL )' $R/gpu_layer_ep.txt | head -n 8
( CUDA_VISIBLE_DEVICES=0 timeout 200 $B/gpu_layer >"$R/gpu_layer.txt" 2>&1; echo "rc=$?" >>"$R/gpu_layer.txt" ) &
( CUDA_VISIBLE_DEVICES=1 timeout 200 $B/gpu_expert_path >"$R/gpu_expert_path.txt" 2>&1; echo "rc=$?" >>"$R/gpu_expert_path.txt" ) &
( CUDA_VISIBLE_DEVICES=2 timeout 200 $B/gpu_grouped_gemm >"$R/gpu_grouped_gemm.txt" 2>&1; echo "rc=$?" >>"$R/gpu_grouped_gemm.txt" ) &
wait
for t in gpu_layer gpu_expert_path gpu_grouped_gemm; do
    echo "$t: $(grep -E '^[0-9]+ passed|^rc=' $R/$t.txt | tr '\n' ' ')"; grep -E '^(FAILED|FAIL )' $R/$t.txt | head -n 5
done
layer() {
    local tag=$1 bin=$2 ranks=$3 groups=$4 grid=$5 s=$SECONDS
    local g=(); [ "$grid" != default ] && g=(EP_BENCH_GEMM_GRID=$grid)
    env "${g[@]}" CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((ranks - 1))) EP_BENCH_RANKS=$ranks EP_BENCH_TOKENS=$TOKENS \
        EP_BENCH_ITERS=20 EP_BENCH_EXPERT_GROUPS=$groups \
        EP_BENCH_OUT=$R/layer-$tag.json timeout 150 $B/$bin >"$R/layer-$tag.txt" 2>&1
    echo "layer $tag rc=$? ($((SECONDS - s)) s)"; grep -E '^ *[0-9]+ +normal' "$R/layer-$tag.txt" | cut -c1-170
}
TOKENS=2048,4096,8192
for i in 1 2; do
    left 330 || break
    layer ep4-old-$i bench_moe_layer_old 4 1 default
    layer ep4-base-$i bench_moe_layer 4 1 default
    layer ep4-pertile-$i bench_moe_layer 4 1 per-tile
    layer ep4-g2-$i bench_moe_layer 4 2 default
    layer ep4-g4-$i bench_moe_layer 4 4 default
done
TOKENS=4096,8192
for i in 1 2; do
    left 500 || break
    layer ep2-old-$i bench_moe_layer_old 2 1 default
    layer ep2-base-$i bench_moe_layer 2 1 default
    layer ep2-pertile-$i bench_moe_layer 2 1 per-tile
    layer ep2-g2-$i bench_moe_layer 2 2 default
done
tar -C $R -czf $OUT/call6.tgz .
echo "total ${SECONDS}s"
