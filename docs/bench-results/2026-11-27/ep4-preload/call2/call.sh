#!/usr/bin/env bash
# Call 2: the multi-rank GPU tests at 4 GPUs (gpu_intranode also at 2); bench_intranode EP4:
# chunk sizes of the copy-engine path (dispatch, and the combine with both roles), then the
# combine with both roles for 400 timed iterations in two fresh processes (EP_BENCH_ITERS).
set -uo pipefail
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0
W=.gpu/w2 R=/tmp/c2
mkdir -p $R
for f in $W/*.xz; do xz -d -f "$f" & done; wait
chmod +x $W/*
{ date -u +%FT%TZ; nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm --format=csv; } >"$R/machine.txt" 2>&1
head -n 2 "$R/machine.txt"
t() {
    local tag=$1 s=$SECONDS; shift
    env "$@" >"$R/$tag.txt" 2>&1
    echo "$tag rc=$? ($((SECONDS - s)) s): $(grep -E '^[0-9]+ passed, [0-9]+ failed' $R/$tag.txt | tail -n 1)"
    grep -E '^(FAILED|FAIL )' $R/$tag.txt | head -n 5
}
t gpu_intranode-4 timeout 150 $W/gpu_intranode
t gpu_intranode-2 CUDA_VISIBLE_DEVICES=0,1 timeout 150 $W/gpu_intranode
t gpu_low_latency-4 timeout 150 $W/gpu_low_latency
t gpu_runtime-4 timeout 240 $W/gpu_runtime
t gpu_layer_ep-4 timeout 240 $W/gpu_layer_ep
bench() {
    local tag=$1 s=$SECONDS; shift
    env "$@" EP_BENCH_QUICK=1 EP_BENCH_OUT=$R/$tag.json timeout 150 $W/bench_intranode >"$R/$tag.txt" 2>&1
    echo "$tag rc=$? ($((SECONDS - s)) s) timeouts: $(grep -c 'timed out' $R/$tag.txt)"
    grep -E 'best at <= 24|nccl-rows' "$R/$tag.txt"
}
bench ep4-chunks EP_BENCH_RANKS=4 EP_BENCH_PATH=ce EP_BENCH_CE_SPLITS=1:20:4:1,1:21:3:1 EP_BENCH_CE_CHUNKS=768:4096,512:2048,512:1024,384:768,1024:2048 EP_BENCH_CE_LOCAL=0:4,2:4 EP_BENCH_CE_COMBINE_PUSH_WARPS=5
grep -E '^ce-' $R/ep4-chunks.txt | grep -v summary | head -n 60
for i in 1 2; do
    bench ep4-stress-$i EP_BENCH_RANKS=4 EP_BENCH_PATH=ce EP_BENCH_ITERS=400 EP_BENCH_CE_SPLITS=1:20:4:1 EP_BENCH_CE_CHUNKS=768:4096 EP_BENCH_CE_COMBINE_PUSH_WARPS=5
done
for f in $R/*.txt; do [ $(wc -c <"$f") -gt 200000 ] && { head -c 100000 "$f" >"$f.head"; rm "$f"; }; done
tar -C $R -czf $OUT/call2.tgz .
