#!/usr/bin/env bash
# Call 1 on a 4-GPU machine: every multi-rank GPU test at 4 GPUs (2 nodes x 2 included), the
# example as 2 nodes x 2 beside one node of 4, and compute-sanitizer on the 2 x 2 launch.
set -uo pipefail
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo
B=.gpu/c1
R=$OUT
for f in "$B"/*.xz; do xz -d -f "$f" & done; wait
chmod +x "$B"/*
{ date -u +%FT%TZ; nvidia-smi --query-gpu=index,name,driver_version --format=csv; nvidia-smi topo -m; } >"$R/machine.txt" 2>&1
head -n 3 "$R/machine.txt"
left() { (( SECONDS < ${1} )); }
t() {
    local name=$1 lim=$2; shift 2
    local s=$SECONDS
    timeout "$lim" "$@" >"$R/$name.txt" 2>&1
    echo "$name rc=$? ($((SECONDS - s)) s): $(grep -E '^[0-9]+ passed, [0-9]+ failed' "$R/$name.txt" | tail -n 1)"
    grep -E '^(FAILED|FAIL )' "$R/$name.txt" | head -n 8
}
t gpu_runtime 200 $B/gpu_runtime
t gpu_low_latency 200 $B/gpu_low_latency
t gpu_intranode 150 $B/gpu_intranode
t gpu_layout_fp8 60 $B/gpu_layout_fp8
left 420 && t gpu_layer_ep 170 $B/gpu_layer_ep
if left 470; then
    s=$SECONDS
    EP_EXAMPLE_BIN=$B/deepseek-v3 OUT=$R/example timeout 150 bash scripts/gpu/example-nodes-run.sh >"$R/example.txt" 2>&1
    echo "example rc=$? ($((SECONDS - s)) s)"; cat "$R/example.txt" | head -n 30
fi
for tool in memcheck racecheck; do
    left 540 || break
    s=$SECONDS
    EP_GPU_RUNTIME_ONLY=nodes-2 timeout 90 compute-sanitizer --target-processes all --report-api-errors no \
        --tool $tool $B/gpu_runtime >"$R/sanitize-$tool.txt" 2>&1
    echo "sanitize $tool rc=$? ($((SECONDS - s)) s): $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|passed, ' "$R/sanitize-$tool.txt" | sort | uniq -c | tr '\n' ' ')"
done
echo "total ${SECONDS}s"
