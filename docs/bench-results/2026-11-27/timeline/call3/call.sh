#!/usr/bin/env bash
# Call 3: the GPU tests of the combine bias build (gpu_intranode, gpu_runtime, gpu_layer_ep on
# 4 GPUs; gpu_layer).
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo
nvidia-smi -L
B=/tmp/t; mkdir -p $B
for n in gpu_intranode gpu_runtime gpu_layer_ep gpu_layer; do xz -dc .gpu/w7/$n.xz > $B/$n; chmod +x $B/$n; done
EP_GPU_BIN=$B OUT=$OUT/tests bash scripts/gpu/run-all.sh 2>&1 | tail -15
cd $OUT && tar cJf tests.tar.xz tests && rm -rf tests
