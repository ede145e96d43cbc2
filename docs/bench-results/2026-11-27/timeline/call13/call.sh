#!/usr/bin/env bash
# Call 13, served by 4 x H200 (the same machine as call 12): a second round at EP4 4096.
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo
nvidia-smi -L
B=/tmp/b; mkdir -p $B $OUT/r
xz -dc .gpu/w12/bench_moe_layer.xz > $B/bench_moe_layer; chmod +x $B/bench_moe_layer
layer() { # name tokens env...
    local name=$1 tok=$2; shift 2
    env "$@" EP_BENCH_RANKS=4 EP_BENCH_TOKENS=$tok EP_BENCH_ITERS=20 EP_BENCH_OUT=$OUT/r/$name.json \
        timeout 100 $B/bench_moe_layer > $OUT/r/$name.txt 2>&1
    echo "$name rc=$?"; grep -E "^ +$tok (normal|low-latency|back|exposed)" $OUT/r/$name.txt
}
layer ep4-4096-worst-shared1-1 4096 EP_BENCH_WORST=4096 EP_BENCH_SHARED_FIRST=1
layer ep4-4096-default-1 4096
layer ep4-4096-worst-shared1-2 4096 EP_BENCH_WORST=4096 EP_BENCH_SHARED_FIRST=1
cd $OUT && tar cJf r.tar.xz r && rm -rf r
