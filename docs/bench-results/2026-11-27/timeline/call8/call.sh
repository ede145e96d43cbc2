#!/usr/bin/env bash
# Call 8, the final tree's bench_moe_layer: EP4 4096 tokens per rank, worst-case outputs with
# the shared experts first three times and the default twice, alternating, with JSON; a
# timeline of the first configuration.
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo
nvidia-smi -L | head -1
B=/tmp/b; mkdir -p $B
xz -dc .gpu/w11/bench_moe_layer.xz > $B/bench_moe_layer; chmod +x $B/bench_moe_layer
mkdir -p $OUT/r
TL=$PWD/.gpu/timeline
layer() { # name tokens env...
    local name=$1 tok=$2; shift 2
    env "$@" EP_BENCH_RANKS=4 EP_BENCH_TOKENS=$tok EP_BENCH_ITERS=20 EP_BENCH_OUT=$OUT/r/$name.json \
        timeout 150 $B/bench_moe_layer > $OUT/r/$name.txt 2>&1
    echo "$name rc=$?"; grep -E "^ +$tok (normal|back|exposed)" $OUT/r/$name.txt
}
for i in 1 2; do
    layer ep4-4096-worst-shared1-$i 4096 EP_BENCH_WORST=4096 EP_BENCH_SHARED_FIRST=1
    layer ep4-4096-default-$i 4096
done
layer ep4-4096-worst-shared1-3 4096 EP_BENCH_WORST=4096 EP_BENCH_SHARED_FIRST=1
env EP_BENCH_WORST=4096 EP_BENCH_SHARED_FIRST=1 EP_BENCH_RANKS=4 EP_BENCH_TOKENS=4096 EP_BENCH_ITERS=8 \
    LD_LIBRARY_PATH=$TL:${LD_LIBRARY_PATH:-} CUDA_INJECTION64_PATH=$TL/libep_timeline.so \
    EP_TIMELINE_OUT=$OUT/r/tl-worst-shared1 timeout 150 $B/bench_moe_layer > $OUT/r/tl-worst-shared1.txt 2>&1
echo "timeline rc=$?"
cd $OUT && tar cJf r.tar.xz r && rm -rf r
