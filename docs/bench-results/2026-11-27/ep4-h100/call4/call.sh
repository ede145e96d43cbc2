#!/usr/bin/env bash
# Call 4 (fifteenth session, 4 GPUs), the final tree after the review (test setups as a
# constructor, the pipeline moved into normal.rs): gpu_layer_ep, gpu_grouped_gemm, gpu_layer;
# then, where Nsight Systems is installed, a kernel trace of bench_moe_layer at EP4, 4096
# tokens per rank, with 1, 2 and 4 expert groups (where the pipeline's time goes).
set -uo pipefail
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo
B=.gpu/d4
R=/tmp/d4
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
( CUDA_VISIBLE_DEVICES=0 timeout 120 $B/gpu_grouped_gemm >"$R/gpu_grouped_gemm.txt" 2>&1; echo "gpu_grouped_gemm rc=$?" >>"$R/gpu_grouped_gemm.txt" ) &
( CUDA_VISIBLE_DEVICES=1 timeout 200 $B/gpu_layer >"$R/gpu_layer.txt" 2>&1; echo "gpu_layer rc=$?" >>"$R/gpu_layer.txt" ) &
wait
for t in gpu_grouped_gemm gpu_layer; do
    echo "$t: $(grep -E '^[0-9]+ passed|rc=' $R/$t.txt | tr '\n' ' ')"; grep -E '^(FAILED|FAIL )' $R/$t.txt | head -n 5
done
NSYS=$(command -v nsys || ls /usr/local/cuda*/bin/nsys /opt/nvidia/nsight-systems*/bin/nsys 2>/dev/null | head -n 1)
echo "nsys: ${NSYS:-none}"
if [ -n "$NSYS" ]; then
    for g in 1 2 4; do
        left 420 || break
        s=$SECONDS
        EP_BENCH_RANKS=4 EP_BENCH_TOKENS=4096 EP_BENCH_ITERS=3 EP_BENCH_EXPERT_GROUPS=$g \
            timeout 150 $NSYS profile --trace=cuda --force-overwrite true -o $R/trace-g$g $B/bench_moe_layer \
            >"$R/trace-g$g.txt" 2>&1
        echo "nsys g$g rc=$? ($((SECONDS - s)) s)"; grep -E '^ *[0-9]+ +normal' "$R/trace-g$g.txt" | cut -c1-120
        timeout 120 $NSYS stats --report cuda_gpu_trace --format csv --force-export true -o $R/trace-g$g $R/trace-g$g.nsys-rep \
            >"$R/stats-g$g.txt" 2>&1
        echo "stats g$g rc=$?: $(ls -la $R/trace-g$g*.csv 2>/dev/null | awk '{print $5, $9}' | tr '\n' ' ')"
        xz -T8 -6 $R/trace-g$g*.csv 2>/dev/null
        rm -f $R/trace-g$g.nsys-rep $R/trace-g$g.sqlite
    done
fi
tar -C $R -cf $OUT/call4.tar .
ls -la $OUT
echo "total ${SECONDS}s"
