#!/usr/bin/env bash
# Call 13 (4 x H100): the final tree (w11: the chunk count-and-publish in one helper of
# copy_engine.cuh): gpu_intranode at 2 and 4 GPUs; bench_intranode EP4 copy-engine defaults
# (and the opt-in combine with both roles), the rings, EP2; NCCL in every run.
set -uo pipefail
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0
R=/tmp/c13
mkdir -p $R
for f in .gpu/w11/*.xz; do xz -d -f "$f" & done; wait
chmod +x .gpu/w11/*
{ date -u +%FT%TZ; nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm --format=csv; } >"$R/machine.txt" 2>&1
head -n 2 "$R/machine.txt"
s=$SECONDS
timeout 120 .gpu/w11/gpu_intranode >"$R/gpu_intranode.txt" 2>&1
echo "gpu_intranode rc=$? ($((SECONDS - s)) s): $(grep -E '[0-9]+ passed' $R/gpu_intranode.txt | tail -n 1)"
grep -E '^(FAILED|FAIL )' $R/gpu_intranode.txt | head -n 8
bench() {
    local tag=$1 s=$SECONDS; shift
    env "$@" EP_BENCH_QUICK=1 EP_BENCH_OUT=$R/$tag.json timeout 90 .gpu/w11/bench_intranode >"$R/$tag.txt" 2>&1
    echo "$tag rc=$? ($((SECONDS - s)) s)"
    grep -E 'best at <= 24|nccl-rows' "$R/$tag.txt"
}
bench ep4-ce EP_BENCH_RANKS=4 EP_BENCH_PATH=ce EP_BENCH_CE_SPLITS=1:20:4:1,1:16:8:1 EP_BENCH_CE_CHUNKS=768:4096,256:1024 EP_BENCH_CE_COMBINE_PUSH_WARPS=0,5
bench ep4-ring EP_BENCH_RANKS=4 EP_BENCH_PATH=ring
bench ep2-ce CUDA_VISIBLE_DEVICES=0,1 EP_BENCH_RANKS=2 EP_BENCH_PATH=ce EP_BENCH_CE_SPLITS=1:22:2:1 EP_BENCH_CE_CHUNKS=768:4096,1024:4096
tar -C $R -czf $OUT/call13.tgz .
