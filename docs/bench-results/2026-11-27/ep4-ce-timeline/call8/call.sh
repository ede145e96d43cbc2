#!/usr/bin/env bash
# Call 8 (4 x H100): the copy-engine combine with both roles in every block, fewer pushing warps
# (`intranode_ce_combine_roles`, `combine_push_warps`) against reduce blocks beside push blocks
set -uo pipefail
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0
R=/tmp/c8
mkdir -p $R
for f in .gpu/w6/*.xz; do xz -d -f "$f" & done; wait
chmod +x .gpu/w6/*
{ date -u +%FT%TZ; nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm --format=csv; } >"$R/machine.txt" 2>&1
head -n 2 "$R/machine.txt"
s=$SECONDS
bench() {
    local tag=$1 w=$2 s=$SECONDS; shift 2
    env "$@" EP_BENCH_QUICK=1 EP_BENCH_OUT=$R/$tag.json timeout 200 .gpu/$w/bench_intranode >"$R/$tag.txt" 2>&1
    echo "$tag rc=$? ($((SECONDS - s)) s)"
    grep -E 'best at <= 24|nccl-rows' "$R/$tag.txt"
}
for i in 1 2; do
    bench ep4-ce-$i w6 EP_BENCH_RANKS=4 EP_BENCH_PATH=ce EP_BENCH_CE_SPLITS=1:16:8:1 \
        EP_BENCH_CE_CHUNKS=256:1024,384:2048,768:2048,768:4096 EP_BENCH_CE_COMBINE_PUSH_WARPS=1,2,3,4,5,6
    bench ep4-ring-$i w6 EP_BENCH_RANKS=4 EP_BENCH_PATH=ring
done
tar -C $R -czf $OUT/call8.tgz .
