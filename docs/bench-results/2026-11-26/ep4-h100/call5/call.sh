#!/usr/bin/env bash
# Call 5 (4 GPUs), the final tree: gpu_runtime (ep-runtime/nvshmem, 2 nodes x 2 included),
# gpu_intranode, gpu_layer_ep at 4 ranks, and the example as 2 nodes x 2 beside one node of 4
# with ep_runtime's debug log (which buffer each rank built).
set -uo pipefail
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo
B=.gpu/c5
R=/tmp/c5
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
s=$SECONDS
RUST_LOG=info,ep_runtime=debug EP_EXAMPLE_BIN=$B/deepseek-v3 OUT=$R/example timeout 150 bash scripts/gpu/example-nodes-run.sh >"$R/example.txt" 2>&1
echo "example rc=$? ($((SECONDS - s)) s)"; grep -E "same|DIFFERENT|NO gen|rc" "$R/example.txt"; grep -h "internode buffer ready\|nodes=" $R/example/generate-2x2-node*.log | head -n 4 | cut -c1-300
tar -C $R -czf $OUT/call5.tgz .
echo "total ${SECONDS}s"
