#!/usr/bin/env bash
# Call 5: bench_moe_layer (exposure also beyond the busiest rank's compute) at EP4 2048 /
# 4096 / 8192 in three configurations, alternating: the default; worst-case outputs; worst-case
# outputs with the shared experts first; EP2 4096 the same; a timeline of the third at 4096.
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo
nvidia-smi -L | head -1
B=/tmp/b; mkdir -p $B
xz -dc .gpu/w9/bench_moe_layer.xz > $B/bench_moe_layer; chmod +x $B/bench_moe_layer
mkdir -p $OUT/r
TL=$PWD/.gpu/timeline
layer() { # name tokens ranks env...
    local name=$1 tok=$2 ranks=$3; shift 3
    env "$@" EP_BENCH_RANKS=$ranks EP_BENCH_TOKENS=$tok EP_BENCH_ITERS=20 timeout 150 $B/bench_moe_layer > $OUT/r/$name.txt 2>&1
    echo "$name rc=$?"; grep -E "^ +$tok (normal|back|exposed)" $OUT/r/$name.txt
}
for i in 1 2; do for tok in 4096 2048 8192; do
    layer ep4-$tok-default-$i $tok 4
    layer ep4-$tok-worst-$i $tok 4 EP_BENCH_WORST=$tok
    layer ep4-$tok-worst-shared1-$i $tok 4 EP_BENCH_WORST=$tok EP_BENCH_SHARED_FIRST=1
done; done
for i in 1 2; do
    CUDA_VISIBLE_DEVICES=0,1 layer ep2-4096-default-$i 4096 2
    CUDA_VISIBLE_DEVICES=0,1 layer ep2-4096-worst-shared1-$i 4096 2 EP_BENCH_WORST=4096 EP_BENCH_SHARED_FIRST=1
done
env EP_BENCH_WORST=4096 EP_BENCH_SHARED_FIRST=1 EP_BENCH_RANKS=4 EP_BENCH_TOKENS=4096 EP_BENCH_ITERS=8 \
    LD_LIBRARY_PATH=$TL:${LD_LIBRARY_PATH:-} CUDA_INJECTION64_PATH=$TL/libep_timeline.so \
    EP_TIMELINE_OUT=$OUT/r/tl-worst-shared1 timeout 150 $B/bench_moe_layer > $OUT/r/tl-worst-shared1.txt 2>&1
echo "timeline rc=$?"
cd $OUT && tar cJf r.tar.xz r && rm -rf r
