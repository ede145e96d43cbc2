#!/usr/bin/env bash
# Call 12 (4 x H200, the machine, lent late in the session): the final tree (w10 =
# commit d7e86cd): gpu_intranode at 2 and 4 GPUs; bench_intranode EP4 copy-engine defaults
# twice, the rings once, EP2 copy-engine defaults, NCCL in every run.
set -uo pipefail
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0
R=/tmp/c12
mkdir -p $R
for f in .gpu/w10/*.xz; do xz -d -f "$f" & done; wait
chmod +x .gpu/w10/*
{ date -u +%FT%TZ; nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm --format=csv; } >"$R/machine.txt" 2>&1
head -n 3 "$R/machine.txt"
s=$SECONDS
timeout 120 .gpu/w10/gpu_intranode >"$R/gpu_intranode.txt" 2>&1
echo "gpu_intranode rc=$? ($((SECONDS - s)) s): $(grep -E '[0-9]+ passed' $R/gpu_intranode.txt | tail -n 1)"
grep -E '^(FAILED|FAIL )' $R/gpu_intranode.txt | head -n 8
bench() {
    local tag=$1 s=$SECONDS; shift
    env "$@" EP_BENCH_QUICK=1 EP_BENCH_OUT=$R/$tag.json timeout 120 .gpu/w10/bench_intranode >"$R/$tag.txt" 2>&1
    echo "$tag rc=$? ($((SECONDS - s)) s)"
    grep -E 'best at <= 24|nccl-rows' "$R/$tag.txt"
}
bench ep4-ce-1 EP_BENCH_RANKS=4 EP_BENCH_PATH=ce EP_BENCH_CE_SPLITS=1:20:4:1,1:18:6:1 EP_BENCH_CE_CHUNKS=768:4096 EP_BENCH_CE_LOCAL=0:4,2:4
bench ep4-ring EP_BENCH_RANKS=4 EP_BENCH_PATH=ring
bench ep4-ce-2 EP_BENCH_RANKS=4 EP_BENCH_PATH=ce EP_BENCH_CE_SPLITS=1:20:4:1,1:18:6:1 EP_BENCH_CE_CHUNKS=768:4096 EP_BENCH_CE_LOCAL=0:4,2:4
bench ep2-ce CUDA_VISIBLE_DEVICES=0,1 EP_BENCH_RANKS=2 EP_BENCH_PATH=ce EP_BENCH_CE_SPLITS=1:22:2:1 EP_BENCH_CE_CHUNKS=768:4096,1024:4096
tar -C $R -czf $OUT/call12.tgz .
