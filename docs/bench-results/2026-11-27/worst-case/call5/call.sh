#!/usr/bin/env bash
# Call 5 (seventeenth session, 4 GPUs): the final tree's changed GPU tests (gpu_runtime,
# gpu_layer_ep after their helpers were shared); bench_intranode at EP4 on the rings, this
# build (the dispatch kernel with its worst-case parameters) beside the sixteenth session's
# (bench_intranode_old), twice each; bench_grouped_gemm on GPU 0 at the layer's EP2 and EP4
# shapes (every tile configuration), and the EP2 4096-token layer step, exact and worst-case.
set -uo pipefail
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo
B=.gpu/w5
R=/tmp/w5
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
t gpu_runtime 200
t gpu_layer_ep 200
ring() {
    local tag=$1 bin=$2 s=$SECONDS
    CUDA_VISIBLE_DEVICES=0,1,2,3 EP_BENCH_RANKS=4 EP_BENCH_QUICK=1 EP_BENCH_PATH=ring \
        EP_BENCH_OUT=$R/intranode-$tag.json timeout 90 $B/$bin >"$R/intranode-$tag.txt" 2>&1
    echo "intranode $tag rc=$? ($((SECONDS - s)) s)"
    grep -E 'best at <= 24|nccl-rows' "$R/intranode-$tag.txt"
}
for i in 1 2; do
    ring ep4-ring-old-$i bench_intranode_old
    ring ep4-ring-new-$i bench_intranode
done
s=$SECONDS
CUDA_VISIBLE_DEVICES=0 EP_BENCH_CASES="128 uniform,64 uniform,256 uniform" EP_BENCH_OUT=$R/grouped.json \
    timeout 150 $B/bench_grouped_gemm >"$R/grouped.txt" 2>&1
echo "grouped rc=$? ($((SECONDS - s)) s)"; grep -vE '^\s*$' "$R/grouped.txt" | tail -n 30
layer() {
    local tag=$1 ranks=$2 tokens=$3 s=$SECONDS; shift 3
    env "$@" CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((ranks - 1))) EP_BENCH_RANKS=$ranks EP_BENCH_TOKENS=$tokens \
        EP_BENCH_ITERS=20 EP_BENCH_OUT=$R/layer-$tag.json timeout 100 $B/bench_moe_layer >"$R/layer-$tag.txt" 2>&1
    echo "$tag rc=$? $(grep -E '^ *[0-9]+ +normal' "$R/layer-$tag.txt" | cut -c1-150)"
}
for i in 1 2; do
    layer ep2-exact-4096-$i 2 4096
    layer ep2-worst-4096-$i 2 4096 EP_BENCH_WORST=4096
done
tar -C $R -czf $OUT/call5.tgz .
echo "total ${SECONDS}s"
