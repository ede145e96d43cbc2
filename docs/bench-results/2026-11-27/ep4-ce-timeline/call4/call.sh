#!/usr/bin/env bash
# Call 4 (4 x H100): sweep of the three-queue pack (w3): local roles x splits x chunks, twice;
# the rings and the static pack (w1) beside it; EP2 old / new.
set -uo pipefail
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0
R=/tmp/c4
mkdir -p $R
for f in .gpu/w1/*.xz .gpu/w3/*.xz; do xz -d -f "$f" & done; wait
chmod +x .gpu/w*/bench_intranode .gpu/w*/gpu_intranode
{ date -u +%FT%TZ; nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm --format=csv; } >"$R/machine.txt" 2>&1
head -n 2 "$R/machine.txt"
bench() {
    local tag=$1 w=$2 s=$SECONDS; shift 2
    env "$@" EP_BENCH_QUICK=1 EP_BENCH_OUT=$R/$tag.json timeout 200 .gpu/$w/bench_intranode >"$R/$tag.txt" 2>&1
    echo "$tag rc=$? ($((SECONDS - s)) s)"
    grep -E 'best at <= 24|nccl-rows' "$R/$tag.txt"
}
EP4=(EP_BENCH_RANKS=4 EP_BENCH_PATH=ce EP_BENCH_CE_SPLITS=1:22:2:1,1:20:4:1,1:18:6:1 EP_BENCH_CE_CHUNKS=768:4096,512:4096,768:2048,1024:2048)
for i in 1 2; do
    bench ep4-w3-$i w3 "${EP4[@]}" EP_BENCH_CE_LOCAL=0:3,0:4,0:5,1:3,1:4,2:2,2:4,1:0,2:0
done
bench ep4-w1 w1 EP_BENCH_RANKS=4 EP_BENCH_PATH=ce EP_BENCH_CE_SPLITS=1:22:2:1,1:16:8:1 EP_BENCH_CE_CHUNKS=768:4096,1024:4096
bench ep4-ring w3 EP_BENCH_RANKS=4 EP_BENCH_PATH=ring
bench ep2-w1 w1 CUDA_VISIBLE_DEVICES=0,1 EP_BENCH_RANKS=2 EP_BENCH_PATH=ce EP_BENCH_CE_SPLITS=1:22:2:1 EP_BENCH_CE_CHUNKS=768:4096
bench ep2-w3 w3 CUDA_VISIBLE_DEVICES=0,1 EP_BENCH_RANKS=2 EP_BENCH_PATH=ce EP_BENCH_CE_SPLITS=1:22:2:1 EP_BENCH_CE_CHUNKS=768:4096
tar -C $R -czf $OUT/call4.tgz .
