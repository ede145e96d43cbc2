#!/usr/bin/env bash
# Call 6 (seventeenth session, 4 GPUs): gpu_runtime after its dispatch comparisons were shared
# between the exact and the worst-case cases (routing_matches, pick, cached_pair); run twice,
# the second time (this output) after cached_pair.
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo
xz -d .gpu/w6/gpu_runtime.xz && chmod +x .gpu/w6/gpu_runtime && nvidia-smi --query-gpu=index,name --format=csv,noheader && timeout 200 .gpu/w6/gpu_runtime > $OUT/gpu_runtime.txt 2>&1; echo rc=$?; grep -E "^FAIL|passed," $OUT/gpu_runtime.txt
