#!/usr/bin/env bash
# Timeline call 1: bench_moe_layer (the seventeenth session's build, .gpu/w5) at EP4, 4096
# tokens per rank, under the CUPTI timeline library, in four configurations; one run of each
# without it to see what recording costs.
set -x
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo
nvidia-smi -L
mkdir -p /tmp/b && xz -dc .gpu/w5/bench_moe_layer.xz > /tmp/b/bml && chmod +x /tmp/b/bml
TL=$PWD/.gpu/timeline
mkdir -p $OUT/r
run() { # name, env...
    local name=$1; shift
    env "$@" EP_BENCH_RANKS=4 EP_BENCH_TOKENS=4096 EP_BENCH_ITERS=8 \
        LD_LIBRARY_PATH=$TL:${LD_LIBRARY_PATH:-} CUDA_INJECTION64_PATH=$TL/libep_timeline.so \
        EP_TIMELINE_OUT=$OUT/r/tl-$name timeout 120 /tmp/b/bml > $OUT/r/$name.txt 2>&1
    echo "$name rc=$?"; tail -4 $OUT/r/$name.txt
}
run default
run shared1 EP_BENCH_SHARED_FIRST=1
run worst EP_BENCH_WORST=4096
run worst-shared1 EP_BENCH_WORST=4096 EP_BENCH_SHARED_FIRST=1
for name in default worst; do
    env EP_BENCH_RANKS=4 EP_BENCH_TOKENS=4096 EP_BENCH_ITERS=8 $( [ $name = worst ] && echo EP_BENCH_WORST=4096 ) \
        timeout 120 /tmp/b/bml > $OUT/r/plain-$name.txt 2>&1; echo "plain $name rc=$?"; tail -3 $OUT/r/plain-$name.txt
done
ls -la $OUT/r
cd $OUT && tar cJf r.tar.xz r && rm -rf r
