#!/usr/bin/env bash
# Call 9: compute-sanitizer memcheck on gpu_intranode's bias cases (the rings' and the copy
# engines' combine starting from a bias, at 2 and 4 GPUs).
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0
nvidia-smi -L | head -1
xz -dc .gpu/w7/gpu_intranode.xz > /tmp/gpu_intranode; chmod +x /tmp/gpu_intranode
timeout 500 compute-sanitizer --tool memcheck --report-api-errors no /tmp/gpu_intranode bias 2>&1 | tail -25
