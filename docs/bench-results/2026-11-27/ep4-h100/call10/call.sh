#!/usr/bin/env bash
# Call 10 (fifteenth session, 4 GPUs), the final tree (commit 48e556b): gpu_layer_ep, gpu_layer.
set -uo pipefail
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo
B=.gpu/d10
R=/tmp/d10
rm -rf $R; mkdir -p $R
for f in "$B"/*.xz; do xz -d -f "$f" & done; wait
chmod +x "$B"/*
{ date -u +%FT%TZ; nvidia-smi --query-gpu=index,name,driver_version --format=csv; } >"$R/machine.txt" 2>&1
head -n 3 "$R/machine.txt"
s=$SECONDS
timeout 200 $B/gpu_layer_ep >"$R/gpu_layer_ep.txt" 2>&1
echo "gpu_layer_ep rc=$? ($((SECONDS - s)) s): $(grep -E '^[0-9]+ passed' $R/gpu_layer_ep.txt | tail -n 1)"
grep -E '^(FAILED|FAIL )' $R/gpu_layer_ep.txt | head -n 8
s=$SECONDS
CUDA_VISIBLE_DEVICES=0 timeout 150 $B/gpu_layer >"$R/gpu_layer.txt" 2>&1
echo "gpu_layer rc=$? ($((SECONDS - s)) s): $(grep -E '^[0-9]+ passed' $R/gpu_layer.txt | tail -n 1)"
tar -C $R -czf $OUT/call10.tgz .
echo "total ${SECONDS}s"
