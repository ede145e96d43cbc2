#!/usr/bin/env bash
# Call 7, the final tree: gpu_layer_ep, gpu_layer, gpu_runtime (feature ep-runtime/nvshmem:
# the 2 nodes x 2 launches run the internode combine with a bias); bench_moe_layer at EP4
# (4096: worst-case outputs with the shared experts first twice, the default once; 128, a
# decode step); the example on 4 GPUs (worst-case prefill outputs now on by default).
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo
nvidia-smi -L | head -1
B=/tmp/b; mkdir -p $B/tests $B/ex
for n in gpu_layer_ep gpu_layer; do xz -dc .gpu/w10/$n.xz > $B/tests/$n; done
xz -dc .gpu/w10/gpu_runtime_nvshmem.xz > $B/tests/gpu_runtime
xz -dc .gpu/w10/bench_moe_layer.xz > $B/bench_moe_layer
xz -dc .gpu/w10/deepseek-v3.xz > $B/ex/deepseek-v3
chmod +x $B/tests/* $B/bench_moe_layer $B/ex/deepseek-v3
EP_GPU_BIN=$B/tests OUT=$OUT/tests bash scripts/gpu/run-all.sh 2>&1 | tail -7
mkdir -p $OUT/r
layer() { # name tokens env...
    local name=$1 tok=$2; shift 2
    env "$@" EP_BENCH_RANKS=4 EP_BENCH_TOKENS=$tok EP_BENCH_ITERS=20 EP_BENCH_OUT=$OUT/r/$name.json \
        timeout 150 $B/bench_moe_layer > $OUT/r/$name.txt 2>&1
    echo "$name rc=$?"; grep -E "^ +$tok (normal|low-latency|back|exposed)" $OUT/r/$name.txt
}
layer ep4-4096-worst-shared1-1 4096 EP_BENCH_WORST=4096 EP_BENCH_SHARED_FIRST=1
layer ep4-4096-default-1 4096
layer ep4-4096-worst-shared1-2 4096 EP_BENCH_WORST=4096 EP_BENCH_SHARED_FIRST=1
layer ep4-128-default-1 128
EP_EXAMPLE_BIN=$B/ex/deepseek-v3 OUT=$OUT/ex timeout 420 bash scripts/gpu/example-run.sh 2>&1 | tail -25
cd $OUT && tar cJf r.tar.xz r tests ex && rm -rf r tests ex
