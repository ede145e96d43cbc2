#!/usr/bin/env bash
# Call 13: gpu_low_latency built with the `nvshmem` feature (final tree): every context now
# loads the NVSHMEM-linked cubins' kernels up front, also where NVSHMEM is never initialised.
# The thread cases at 4, 2 and 1 ranks, then one process per GPU over NVSHMEM.
set -uo pipefail
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo
W=.gpu/w13 R=/tmp/c13
mkdir -p $R
xz -d -f $W/gpu_low_latency.xz
chmod +x $W/gpu_low_latency
{ date -u +%FT%TZ; nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm --format=csv; } >"$R/machine.txt" 2>&1
head -n 2 "$R/machine.txt"
s=$SECONDS
timeout 400 $W/gpu_low_latency >"$R/gpu_low_latency-nvshmem.txt" 2>&1
echo "gpu_low_latency (nvshmem) rc=$? ($((SECONDS - s)) s): $(grep -E '^[0-9]+ passed, [0-9]+ failed' $R/gpu_low_latency-nvshmem.txt | tail -n 3 | tr '\n' ' ')"
grep -E '^(FAILED|FAIL )' $R/gpu_low_latency-nvshmem.txt | head -n 8
tar -C $R -czf $OUT/call13.tgz .
