#!/usr/bin/env bash
# Call 7 (4 GPUs), the final tree after the review (DeviceProps module, sms_left from it):
# gpu_runtime (ep-runtime/nvshmem, 2 nodes x 2 included), gpu_intranode, gpu_layer_ep at 4
# ranks (incl. shared-before-dispatch), gpu_layer on one GPU, and bench_moe_layer at EP4 with
# the shared experts first (the path that calls sms_left).
set -uo pipefail
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo
B=.gpu/c7
R=/tmp/c7
mkdir -p $R
for f in "$B"/*.xz; do xz -d -f "$f" & done; wait
chmod +x "$B"/*
{ date -u +%FT%TZ; nvidia-smi --query-gpu=index,name,driver_version --format=csv; } >"$R/machine.txt" 2>&1
head -n 3 "$R/machine.txt"
t() {
    local name=$1 lim=$2; shift 2
    local s=$SECONDS
    timeout "$lim" "$@" >"$R/$name.txt" 2>&1
    echo "$name rc=$? ($((SECONDS - s)) s): $(grep -E '^[0-9]+ passed, [0-9]+ failed' "$R/$name.txt" | tail -n 1)"
    grep -E '^(FAILED|FAIL )' "$R/$name.txt" | head -n 8
}
t gpu_runtime 200 $B/gpu_runtime
t gpu_intranode 90 $B/gpu_intranode
t gpu_layer_ep 170 $B/gpu_layer_ep
t gpu_layer 200 $B/gpu_layer
s=$SECONDS
EP_BENCH_RANKS=4 EP_BENCH_TOKENS=128,4096 EP_BENCH_ITERS=20 EP_BENCH_SHARED_FIRST=1 EP_BENCH_OUT=$R/layer-on.json \
    timeout 150 $B/bench_moe_layer >$R/layer-on.txt 2>&1
echo "layer on rc=$? ($((SECONDS - s)) s)"; grep -A 3 '^tokens' $R/layer-on.txt | cut -c1-160; grep 'beside the shared' $R/layer-on.txt | cut -c1-200
tar -C $R -czf $OUT/call7.tgz .
echo "total ${SECONDS}s"
