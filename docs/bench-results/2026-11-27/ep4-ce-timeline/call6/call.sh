#!/usr/bin/env bash
# Call 6 (4 x H100): the final tree (w5): gpu_intranode, gpu_runtime, gpu_layer_ep at 2 and 4
# GPUs; compute-sanitizer memcheck on the copy-engine pack's cases; bench_intranode EP4 on
# the copy-engine defaults, the old static pack (w1) alternating, the rings; EP2 old / new.
set -uo pipefail
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0
R=/tmp/c6
mkdir -p $R
for f in .gpu/w1/*.xz .gpu/w5/*.xz; do xz -d -f "$f" & done; wait
chmod +x .gpu/w1/* .gpu/w5/*
{ date -u +%FT%TZ; nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm --format=csv; } >"$R/machine.txt" 2>&1
head -n 2 "$R/machine.txt"
for t in gpu_intranode gpu_runtime gpu_layer_ep; do
    s=$SECONDS
    timeout 240 .gpu/w5/$t >"$R/$t.txt" 2>&1
    echo "$t rc=$? ($((SECONDS - s)) s): $(grep -E '[0-9]+ passed' $R/$t.txt | tail -n 1)"
    grep -E '^(FAILED|FAIL )' $R/$t.txt | head -n 8
done
bench() {
    local tag=$1 w=$2 s=$SECONDS; shift 2
    env "$@" EP_BENCH_QUICK=1 EP_BENCH_OUT=$R/$tag.json timeout 200 .gpu/$w/bench_intranode >"$R/$tag.txt" 2>&1
    echo "$tag rc=$? ($((SECONDS - s)) s)"
    grep -E 'best at <= 24|nccl-rows' "$R/$tag.txt"
}
for i in 1 2; do
    bench ep4-old-$i w1 EP_BENCH_RANKS=4 EP_BENCH_PATH=ce EP_BENCH_CE_SPLITS=1:22:2:1,1:16:8:1 EP_BENCH_CE_CHUNKS=768:4096,1024:4096
    bench ep4-new-$i w5 EP_BENCH_RANKS=4 EP_BENCH_PATH=ce EP_BENCH_CE_SPLITS=1:20:4:1,1:16:8:1 EP_BENCH_CE_CHUNKS=768:4096
done
bench ep4-ring w5 EP_BENCH_RANKS=4 EP_BENCH_PATH=ring
bench ep2-old w1 CUDA_VISIBLE_DEVICES=0,1 EP_BENCH_RANKS=2 EP_BENCH_PATH=ce EP_BENCH_CE_SPLITS=1:22:2:1 EP_BENCH_CE_CHUNKS=768:4096
bench ep2-new w5 CUDA_VISIBLE_DEVICES=0,1 EP_BENCH_RANKS=2 EP_BENCH_PATH=ce EP_BENCH_CE_SPLITS=1:22:2:1 EP_BENCH_CE_CHUNKS=768:4096
s=$SECONDS
timeout 300 compute-sanitizer --tool memcheck --report-api-errors no .gpu/w5/gpu_intranode ce-pack >"$R/memcheck-ce-pack.txt" 2>&1
echo "memcheck ce-pack rc=$? ($((SECONDS - s)) s)"; tail -n 4 "$R/memcheck-ce-pack.txt"
s=$SECONDS
timeout 200 compute-sanitizer --tool racecheck .gpu/w5/gpu_intranode ce-pack-local >"$R/racecheck-ce-pack.txt" 2>&1
echo "racecheck ce-pack-local rc=$? ($((SECONDS - s)) s)"; tail -n 4 "$R/racecheck-ce-pack.txt"
tar -C $R -czf $OUT/call6.tgz .
