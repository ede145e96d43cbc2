#!/usr/bin/env bash
# Call 8, the final tree (w8; a fresh machine named nvidia-h200-x4): every multi-rank GPU test
# at 4 and 2 GPUs, gpu_layout_fp8 and gpu_layer on one; compute-sanitizer memcheck on every copy-engine case of
# gpu_intranode and racecheck on the combine's tail cases; bench_intranode EP4 defaults three
# times (one with 400 timed iterations), the rings, EP2; NCCL in every run.
set -uo pipefail
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
W=.gpu/w8 R=/tmp/c8
mkdir -p $R
for f in $W/*.xz; do xz -d -f "$f" & done; wait
chmod +x $W/*
{ date -u +%FT%TZ; nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm --format=csv; } >"$R/machine.txt" 2>&1
head -n 3 "$R/machine.txt"
t() {
    local tag=$1 s=$SECONDS; shift
    env "$@" >"$R/$tag.txt" 2>&1
    echo "$tag rc=$? ($((SECONDS - s)) s): $(grep -E '^[0-9]+ passed, [0-9]+ failed' $R/$tag.txt | tail -n 1)"
    grep -E '^(FAILED|FAIL )' $R/$tag.txt | head -n 5
}
bench() {
    local tag=$1 s=$SECONDS; shift
    env "$@" EP_BENCH_QUICK=1 EP_BENCH_OUT=$R/$tag.json timeout 150 $W/bench_intranode >"$R/$tag.txt" 2>&1
    echo "$tag rc=$? ($((SECONDS - s)) s) timeouts: $(grep -c 'timed out' $R/$tag.txt)"
    grep -E 'best at <= 24|nccl-rows' "$R/$tag.txt"
}
bench ep4-1 EP_BENCH_RANKS=4 EP_BENCH_PATH=ce EP_BENCH_CE_SPLITS=1:20:4:1 EP_BENCH_CE_CHUNKS=768:4096,1024:4096 EP_BENCH_CE_LOCAL=0:4,2:4
bench ep4-ring EP_BENCH_RANKS=4 EP_BENCH_PATH=ring
bench ep4-2 EP_BENCH_RANKS=4 EP_BENCH_PATH=ce EP_BENCH_CE_SPLITS=1:20:4:1 EP_BENCH_CE_CHUNKS=768:4096,1024:4096 EP_BENCH_CE_LOCAL=0:4,2:4
bench ep4-400 EP_BENCH_RANKS=4 EP_BENCH_PATH=ce EP_BENCH_ITERS=400 EP_BENCH_CE_SPLITS=1:20:4:1 EP_BENCH_CE_CHUNKS=768:4096,1024:4096
bench ep2 CUDA_VISIBLE_DEVICES=0,1 EP_BENCH_RANKS=2 EP_BENCH_PATH=ce EP_BENCH_CE_SPLITS=1:22:2:1 EP_BENCH_CE_CHUNKS=768:4096,1024:4096
for b in gpu_intranode gpu_low_latency gpu_runtime gpu_layer_ep; do
    t $b-4 timeout 240 $W/$b
done
(t gpu_layout_fp8 CUDA_VISIBLE_DEVICES=3 timeout 120 $W/gpu_layout_fp8; t gpu_layer CUDA_VISIBLE_DEVICES=3 timeout 240 $W/gpu_layer) &
for b in gpu_intranode gpu_low_latency gpu_runtime gpu_layer_ep; do
    t $b-2 CUDA_VISIBLE_DEVICES=0,1 timeout 240 $W/$b
done
wait
s=$SECONDS
timeout 300 compute-sanitizer --tool memcheck --report-api-errors no $W/gpu_intranode ce- >"$R/memcheck-ce.txt" 2>&1
echo "memcheck ce- rc=$? ($((SECONDS - s)) s)"; grep -E 'ERROR SUMMARY|passed, ' "$R/memcheck-ce.txt" | tail -n 3
s=$SECONDS
timeout 200 compute-sanitizer --tool racecheck $W/gpu_intranode ce-combine-tail >"$R/racecheck-tail.txt" 2>&1
echo "racecheck ce-combine-tail rc=$? ($((SECONDS - s)) s)"; grep -E 'RACECHECK SUMMARY|ERROR SUMMARY|passed, ' "$R/racecheck-tail.txt" | tail -n 3
for f in $R/*.txt; do [ $(wc -c <"$f") -gt 200000 ] && { head -c 100000 "$f" >"$f.head"; rm "$f"; }; done
tar -C $R -czf $OUT/call8.tgz .
