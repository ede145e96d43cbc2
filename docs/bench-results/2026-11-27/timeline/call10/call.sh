#!/usr/bin/env bash
# Call 10, the final tree's bench_moe_layer (the timings' helpers shared): EP4 4096 tokens per
# rank, worst-case outputs with the shared experts first twice and the default once.
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo
nvidia-smi -L | head -1
B=/tmp/b; mkdir -p $B $OUT/r
xz -dc .gpu/w12/bench_moe_layer.xz > $B/bench_moe_layer; chmod +x $B/bench_moe_layer
layer() { # name env...
    local name=$1; shift
    env "$@" EP_BENCH_RANKS=4 EP_BENCH_TOKENS=4096 EP_BENCH_ITERS=20 EP_BENCH_OUT=$OUT/r/$name.json \
        timeout 150 $B/bench_moe_layer > $OUT/r/$name.txt 2>&1
    echo "$name rc=$?"; grep -E "^ +4096 (normal|back|exposed)" $OUT/r/$name.txt
}
layer ep4-4096-worst-shared1-1 EP_BENCH_WORST=4096 EP_BENCH_SHARED_FIRST=1
layer ep4-4096-default-1
layer ep4-4096-worst-shared1-2 EP_BENCH_WORST=4096 EP_BENCH_SHARED_FIRST=1
cd $OUT && tar cJf r.tar.xz r && rm -rf r
