#!/usr/bin/env bash
# Call 6: why eager steps of 8192 tokens per rank with the shared experts first take 21-23 ms
# in the synchronised loop (13.5 back to back and as a graph): timelines with driver calls.
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo
nvidia-smi -L | head -1
B=/tmp/b; mkdir -p $B
xz -dc .gpu/w9/bench_moe_layer.xz > $B/bench_moe_layer; chmod +x $B/bench_moe_layer
mkdir -p $OUT/r
TL=$PWD/.gpu/timeline
for cfg in worst-shared1 worst; do
    extra="EP_BENCH_WORST=8192"; [ $cfg = worst-shared1 ] && extra="$extra EP_BENCH_SHARED_FIRST=1"
    env $extra EP_BENCH_RANKS=4 EP_BENCH_TOKENS=8192 EP_BENCH_ITERS=6 EP_TIMELINE_DRIVER=1 \
        LD_LIBRARY_PATH=$TL:${LD_LIBRARY_PATH:-} CUDA_INJECTION64_PATH=$TL/libep_timeline.so \
        EP_TIMELINE_OUT=$OUT/r/tl-$cfg timeout 150 $B/bench_moe_layer > $OUT/r/tl-$cfg.txt 2>&1
    echo "timeline $cfg rc=$?"; grep -E "^ +8192 (normal|back)" $OUT/r/tl-$cfg.txt
done
cd $OUT && tar cJf r.tar.xz r && rm -rf r
