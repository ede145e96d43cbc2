#!/usr/bin/env bash
# Call 3 (seventeenth session, 4 GPUs): captured prefill steps (MoeLayer::capture_prefill) in
# gpu_layer_ep and gpu_layer; then bench_moe_layer, alternating: at EP2 the exact dispatch on
# the copy engines (the default) and on the SM rings (EP_BENCH_NVL=rings) against worst-case
# outputs (which take the rings); at EP4 exact against worst-case, the worst-case step also
# timed as a captured graph.
set -uo pipefail
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo
B=.gpu/w3
R=/tmp/w3
rm -rf $R; mkdir -p $R
for f in "$B"/*.xz; do xz -d -f "$f" & done; wait
chmod +x "$B"/*
{ date -u +%FT%TZ; nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm --format=csv; } >"$R/machine.txt" 2>&1
head -n 3 "$R/machine.txt"
left() { [ $((SECONDS)) -lt $1 ]; }
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
        EP_BENCH_ITERS=20 EP_BENCH_OUT=$R/layer-$tag.json timeout 100 $B/bench_moe_layer >"$R/layer-$tag.txt" 2>&1
    echo "$tag rc=$? $(grep -E '^ *[0-9]+ +normal' "$R/layer-$tag.txt" | cut -c1-150)"
}
for i in 1 2 3 4; do
    left 480 || break
    for tok in 4096 8192; do
        layer ep2-exact-$tok-$i 2 $tok
        layer ep2-rings-$tok-$i 2 $tok EP_BENCH_NVL=rings
        layer ep2-worst-$tok-$i 2 $tok EP_BENCH_WORST=$tok
    done
    for tok in 2048 4096; do
        layer ep4-exact-$tok-$i 4 $tok
        layer ep4-worst-$tok-$i 4 $tok EP_BENCH_WORST=$tok
    done
done
grep -h "graph" $R/layer-*worst*.txt | grep "^T=" | head -n 40
tar -C $R -czf $OUT/call3.tgz .
echo "total ${SECONDS}s"
