#!/usr/bin/env bash
# Call 9 (fifteenth session, 4 GPUs), the final tree: gpu_layer_ep, then gpu_layer and
# gpu_expert_path side by side; bench_moe_layer at EP4 with the default options.
set -uo pipefail
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo
B=.gpu/d9
R=/tmp/d9
rm -rf $R; mkdir -p $R
for f in "$B"/*.xz; do xz -d -f "$f" & done; wait
chmod +x "$B"/*
{ date -u +%FT%TZ; nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm --format=csv; } >"$R/machine.txt" 2>&1
head -n 3 "$R/machine.txt"
s=$SECONDS
timeout 200 $B/gpu_layer_ep >"$R/gpu_layer_ep.txt" 2>&1
echo "gpu_layer_ep rc=$? ($((SECONDS - s)) s): $(grep -E '^[0-9]+ passed' $R/gpu_layer_ep.txt | tail -n 1)"
grep -E '^(FAILED|FAIL )' $R/gpu_layer_ep.txt | head -n 8
( CUDA_VISIBLE_DEVICES=0 timeout 150 $B/gpu_layer >"$R/gpu_layer.txt" 2>&1; echo "rc=$?" >>"$R/gpu_layer.txt" ) &
( CUDA_VISIBLE_DEVICES=1 timeout 150 $B/gpu_expert_path >"$R/gpu_expert_path.txt" 2>&1; echo "rc=$?" >>"$R/gpu_expert_path.txt" ) &
wait
for t in gpu_layer gpu_expert_path; do
    echo "$t: $(grep -E '^[0-9]+ passed|^rc=' $R/$t.txt | tr '\n' ' ')"; grep -E '^(FAILED|FAIL )' $R/$t.txt | head -n 5
done
EP_BENCH_RANKS=4 EP_BENCH_TOKENS=128,4096 EP_BENCH_ITERS=20 EP_BENCH_OUT=$R/layer-default.json timeout 60 \
    $B/bench_moe_layer >"$R/layer-default.txt" 2>&1
echo "layer default rc=$?"; grep -E '^ *[0-9]+ +(normal|low-latency)' "$R/layer-default.txt" | cut -c1-170
tar -C $R -czf $OUT/call9.tgz .
echo "total ${SECONDS}s"
