#!/usr/bin/env bash
# Call 5 (4 x H100): the copy-engine combine with every block pushing first, then reducing
# (w4, `combine_push_first`), against reduce blocks beside push blocks; gpu_intranode on w4;
# the rings beside it.
set -uo pipefail
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0
R=/tmp/c5
mkdir -p $R
for f in .gpu/w4/*.xz; do xz -d -f "$f" & done; wait
chmod +x .gpu/w*/bench_intranode .gpu/w*/gpu_intranode
{ date -u +%FT%TZ; nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm --format=csv; } >"$R/machine.txt" 2>&1
head -n 2 "$R/machine.txt"
s=$SECONDS
timeout 200 .gpu/w4/gpu_intranode >"$R/gpu_intranode.txt" 2>&1
echo "gpu_intranode rc=$? ($((SECONDS - s)) s): $(grep -E '[0-9]+ passed' $R/gpu_intranode.txt | tail -n 1)"
grep -E '^(FAILED|FAIL )' $R/gpu_intranode.txt | head -n 8
bench() {
    local tag=$1 w=$2 s=$SECONDS; shift 2
    env "$@" EP_BENCH_QUICK=1 EP_BENCH_OUT=$R/$tag.json timeout 200 .gpu/$w/bench_intranode >"$R/$tag.txt" 2>&1
    echo "$tag rc=$? ($((SECONDS - s)) s)"
    grep -E 'best at <= 24|nccl-rows' "$R/$tag.txt"
}
for i in 1 2; do
    bench ep4-ce-$i w4 EP_BENCH_RANKS=4 EP_BENCH_PATH=ce EP_BENCH_CE_SPLITS=1:16:8:1,1:20:4:1,1:22:2:1,1:12:12:1,0:20:4:1,0:12:12:1 \
        EP_BENCH_CE_CHUNKS=256:1024,768:4096,512:2048 EP_BENCH_CE_LOCAL=0:4 EP_BENCH_CE_COMBINE_PUSH_FIRST=0,1
    bench ep4-ring-$i w4 EP_BENCH_RANKS=4 EP_BENCH_PATH=ring
done
tar -C $R -czf $OUT/call5.tgz .
