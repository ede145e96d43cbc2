#!/usr/bin/env bash
# Call 1 (twenty-first session), tree 90aaa30 (w15), a machine named nvidia-h200-x4. If it is not
# 4 x H200, print the machine and stop. Otherwise: bench_intranode EP4 copy-engine defaults
# twice, the rings, EP2 (NCCL in every run); every multi-rank GPU test at 4 and 2 GPUs;
# compute-sanitizer memcheck on every copy-engine case of gpu_intranode, racecheck on the
# combine's tail cases.
set -uo pipefail
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0
W=.gpu/w15 R=/tmp/c1
mkdir -p $R
{ date -u +%FT%TZ; nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm --format=csv; } >"$R/machine.txt" 2>&1
cat "$R/machine.txt"
if ! grep -q H200 "$R/machine.txt"; then
    echo "not 4 x H200: nothing run"
    tar -C $R -czf $OUT/call1.tgz .
    exit 0
fi
for f in $W/*.xz; do xz -d -f "$f" & done; wait
chmod +x $W/*
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
bench ep2 CUDA_VISIBLE_DEVICES=0,1 EP_BENCH_RANKS=2 EP_BENCH_PATH=ce EP_BENCH_CE_SPLITS=1:22:2:1 EP_BENCH_CE_CHUNKS=768:4096,1024:4096
for b in gpu_intranode gpu_low_latency gpu_runtime gpu_layer_ep; do
    t $b-4 timeout 240 $W/$b
done
for b in gpu_intranode gpu_low_latency gpu_runtime gpu_layer_ep; do
    t $b-2 CUDA_VISIBLE_DEVICES=0,1 timeout 240 $W/$b
done
s=$SECONDS
timeout 240 compute-sanitizer --tool memcheck --report-api-errors no $W/gpu_intranode ce- >"$R/memcheck-ce.txt" 2>&1
echo "memcheck ce- rc=$? ($((SECONDS - s)) s)"; grep -E 'ERROR SUMMARY|passed, ' "$R/memcheck-ce.txt" | tail -n 3
s=$SECONDS
timeout 150 compute-sanitizer --tool racecheck $W/gpu_intranode ce-combine-tail >"$R/racecheck-tail.txt" 2>&1
echo "racecheck ce-combine-tail rc=$? ($((SECONDS - s)) s)"; grep -E 'RACECHECK SUMMARY|ERROR SUMMARY|passed, ' "$R/racecheck-tail.txt" | tail -n 3
for f in $R/*.txt; do [ $(wc -c <"$f") -gt 200000 ] && { head -c 100000 "$f" >"$f.head"; rm "$f"; }; done
tar -C $R -czf $OUT/call1.tgz .
