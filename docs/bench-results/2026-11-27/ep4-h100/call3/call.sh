#!/usr/bin/env bash
# Call 3 (fifteenth session, 4 GPUs), the final tree: gpu_layer_ep and gpu_grouped_gemm;
# compute-sanitizer memcheck on the new launch grids (gpu_grouped_gemm PerTile / PersistentOn)
# and on a pipelined layer case; bench_moe_layer at EP4 with the default options, three times.
set -uo pipefail
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo
B=.gpu/d3
R=/tmp/d3
rm -rf $R; mkdir -p $R
for f in "$B"/*.xz; do xz -d -f "$f" & done; wait
chmod +x "$B"/*
{ date -u +%FT%TZ; nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm --format=csv; } >"$R/machine.txt" 2>&1
head -n 3 "$R/machine.txt"
left() { (( SECONDS < ${1} )); }
s=$SECONDS
timeout 240 $B/gpu_layer_ep >"$R/gpu_layer_ep.txt" 2>&1
echo "gpu_layer_ep rc=$? ($((SECONDS - s)) s): $(grep -E '^[0-9]+ passed' $R/gpu_layer_ep.txt | tail -n 1)"
grep -E '^(FAILED|FAIL )' $R/gpu_layer_ep.txt | head -n 8
s=$SECONDS
CUDA_VISIBLE_DEVICES=0 timeout 120 $B/gpu_grouped_gemm >"$R/gpu_grouped_gemm.txt" 2>&1
echo "gpu_grouped_gemm rc=$? ($((SECONDS - s)) s): $(grep -E '^[0-9]+ passed' $R/gpu_grouped_gemm.txt | tail -n 1)"
for f in PerTile PersistentOn; do
    left 330 || break
    s=$SECONDS
    CUDA_VISIBLE_DEVICES=0 timeout 120 compute-sanitizer --tool memcheck --error-exitcode 9 $B/gpu_grouped_gemm $f \
        >"$R/sanitize-gemm-$f.txt" 2>&1
    echo "memcheck gpu_grouped_gemm $f rc=$? ($((SECONDS - s)) s): $(grep -E 'ERROR SUMMARY|passed, ' $R/sanitize-gemm-$f.txt | tr '\n' ' ')"
done
if left 360; then
    s=$SECONDS
    timeout 200 compute-sanitizer --tool memcheck --error-exitcode 9 --report-api-errors no $B/gpu_layer_ep expert-groups-2/normal/T=300 \
        >"$R/sanitize-layer-groups.txt" 2>&1
    echo "memcheck gpu_layer_ep expert-groups-2/normal/T=300 rc=$? ($((SECONDS - s)) s): $(grep -E 'ERROR SUMMARY|passed, ' $R/sanitize-layer-groups.txt | tr '\n' ' ')"
fi
for i in 1 2 3; do
    left 540 || break
    s=$SECONDS
    EP_BENCH_RANKS=4 EP_BENCH_TOKENS=128,4096 EP_BENCH_ITERS=20 EP_BENCH_OUT=$R/layer-default-$i.json timeout 100 \
        $B/bench_moe_layer >"$R/layer-default-$i.txt" 2>&1
    echo "layer default-$i rc=$? ($((SECONDS - s)) s)"; grep -E '^ *[0-9]+ +(normal|low-latency)' "$R/layer-default-$i.txt" | cut -c1-170
done
tar -C $R -czf $OUT/call3.tgz .
echo "total ${SECONDS}s"
