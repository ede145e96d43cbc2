#!/usr/bin/env bash
# Call 4: the GPU tests after the combine's outputs moved to candle's stream; bench_moe_layer
# with the back-to-back timing at EP4 and EP2; a timeline of the default step (EP4, 4096).
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo
nvidia-smi -L
B=/tmp/b; mkdir -p $B
for f in .gpu/w8/*.xz; do n=$(basename $f .xz); xz -dc $f > $B/$n; chmod +x $B/$n; done
mkdir -p $B/tests && mv $B/gpu_* $B/tests/
EP_GPU_BIN=$B/tests OUT=$OUT/tests bash scripts/gpu/run-all.sh 2>&1 | tail -8
mkdir -p $OUT/r
TL=$PWD/.gpu/timeline
layer() { # name tokens ranks env...
    local name=$1 tok=$2 ranks=$3; shift 3
    env "$@" EP_BENCH_RANKS=$ranks EP_BENCH_TOKENS=$tok EP_BENCH_ITERS=20 timeout 150 $B/bench_moe_layer > $OUT/r/$name.txt 2>&1
    echo "$name rc=$?"; grep -E "^ +$tok (normal|back)" $OUT/r/$name.txt
}
for i in 1 2 3; do
    layer ep4-4096-default-$i 4096 4
    layer ep4-4096-worst-shared1-$i 4096 4 EP_BENCH_WORST=4096 EP_BENCH_SHARED_FIRST=1
done
layer ep4-4096-worst-1 4096 4 EP_BENCH_WORST=4096
layer ep4-4096-shared1-1 4096 4 EP_BENCH_SHARED_FIRST=1
layer ep4-2048-default-1 2048 4
layer ep4-8192-default-1 8192 4
for i in 1 2; do CUDA_VISIBLE_DEVICES=0,1 layer ep2-4096-default-$i 4096 2; done
env EP_BENCH_RANKS=4 EP_BENCH_TOKENS=4096 EP_BENCH_ITERS=8 \
    LD_LIBRARY_PATH=$TL:${LD_LIBRARY_PATH:-} CUDA_INJECTION64_PATH=$TL/libep_timeline.so \
    EP_TIMELINE_OUT=$OUT/r/tl-default timeout 150 $B/bench_moe_layer > $OUT/r/tl-default.txt 2>&1
echo "timeline rc=$?"
cd $OUT && tar cJf r.tar.xz r tests && rm -rf r tests
