#!/usr/bin/env bash
# Call 4: w4 = the copy streams' chunks in chunk-major order (the combine's tail chunks
# interleaved with the copy-engine home's) and `serial_copy_engines`; w3 = call 3's build (the
# tail chunks after the copy-engine home's). gpu_intranode (w4) at 4 and 2 GPUs; EP4 combine
# tails 0/2/3 in both builds, twice each, alternating; EP4 dispatch / combine with 2 and 3
# copy-engine peers, each with and without `serial_copy_engines`.
set -uo pipefail
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0
R=/tmp/c4
mkdir -p $R
for w in .gpu/w3 .gpu/w4; do for f in $w/*.xz; do xz -d -f "$f" & done; done; wait
chmod +x .gpu/w3/* .gpu/w4/*
{ date -u +%FT%TZ; nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm --format=csv; } >"$R/machine.txt" 2>&1
head -n 2 "$R/machine.txt"
t() {
    local tag=$1 s=$SECONDS; shift
    env "$@" >"$R/$tag.txt" 2>&1
    echo "$tag rc=$? ($((SECONDS - s)) s): $(grep -E '^[0-9]+ passed, [0-9]+ failed' $R/$tag.txt | tail -n 1)"
    grep -E '^(FAILED|FAIL )' $R/$tag.txt | head -n 5
}
t gpu_intranode-4 timeout 150 .gpu/w4/gpu_intranode
t gpu_intranode-2 CUDA_VISIBLE_DEVICES=0,1 timeout 150 .gpu/w4/gpu_intranode
bench() {
    local tag=$1 w=$2 s=$SECONDS; shift 2
    env "$@" EP_BENCH_QUICK=1 EP_BENCH_OUT=$R/$tag.json timeout 150 .gpu/$w/bench_intranode >"$R/$tag.txt" 2>&1
    echo "$tag rc=$? ($((SECONDS - s)) s) timeouts: $(grep -c 'timed out' $R/$tag.txt)"
    grep -E 'best at <= 24|nccl-rows' "$R/$tag.txt"
}
for i in 1 2; do
    for w in w3 w4; do
        bench tail-$w-$i $w EP_BENCH_RANKS=4 EP_BENCH_PATH=ce EP_BENCH_CE_SPLITS=1:20:4:1 EP_BENCH_CE_CHUNKS=768:4096,1024:4096,512:2048 EP_BENCH_CE_LOCAL=0:4 EP_BENCH_CE_COMBINE_PUSH_WARPS=4,5,6 EP_BENCH_CE_TAIL=0,2,3
    done
done
bench serial w4 EP_BENCH_RANKS=4 EP_BENCH_PATH=ce EP_BENCH_CE_SPLITS=1:20:4:1,2:20:4:1,3:20:4:1,2:22:2:1,3:22:2:1,2:16:8:1 EP_BENCH_CE_SERIAL=0,1 EP_BENCH_CE_CHUNKS=768:4096,512:2048 EP_BENCH_CE_LOCAL=0:4,2:4 EP_BENCH_CE_COMBINE_PUSH_WARPS=5 EP_BENCH_CE_TAIL=0,2
for f in $R/*.txt; do [ $(wc -c <"$f") -gt 200000 ] && { head -c 100000 "$f" >"$f.head"; rm "$f"; }; done
tar -C $R -czf $OUT/call4.tgz .
