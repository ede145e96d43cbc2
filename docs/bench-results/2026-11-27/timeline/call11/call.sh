#!/usr/bin/env bash
# Call 11: after the error records' store moved into one helper (csrc/intranode.cuh):
# gpu_intranode (its timeout cases record timeouts) and gpu_runtime (worst-case overflow
# records a capacity error) at 4 GPUs.
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0
nvidia-smi -L | head -1
B=/tmp/t; mkdir -p $B
for n in gpu_intranode gpu_runtime; do xz -dc .gpu/w13/$n.xz > $B/$n; chmod +x $B/$n; done
EP_GPU_BIN=$B OUT=$OUT/tests bash scripts/gpu/run-all.sh 2>&1 | tail -6
grep -hE "timeout|capacity|RecvCapacity" $OUT/tests/logs/*.log | grep -E "^(ok|FAILED)" | head -12
