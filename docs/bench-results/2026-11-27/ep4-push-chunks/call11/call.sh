#!/usr/bin/env bash
# Call 11 (twenty-first session), w23: the final tree (fp8 with its own split: 18+6, two whole
# local blocks). bench_intranode EP4 with exactly the defaults (EP_BENCH_CE_DEFAULTS=1) five
# times in fresh processes, the rings once, EP2 defaults twice; every multi-rank GPU test at 4
# and 2 GPUs; compute-sanitizer memcheck on the copy-engine cases of gpu_intranode. NCCL in
# every bench run.
set -uo pipefail
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0
W=.gpu/w23 R=/tmp/c11
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
    env "$@" EP_BENCH_QUICK=1 EP_BENCH_OUT=$R/$tag.json timeout 170 $W/bench_intranode >"$R/$tag.txt" 2>&1
    echo "$tag rc=$? ($((SECONDS - s)) s) timeouts: $(grep -c 'timed out' $R/$tag.txt)"
    grep -E 'ce-(dispatch-(bf16|fp8)|combine-bf16) +sms|best at <= 24|nccl-rows' "$R/$tag.txt" | grep -v 'best at' | sed -E 's/ +/ /g; s/ \(NVL, mean of ranks;/ (/; s/ring //'
    grep -E 'best at <= 24' "$R/$tag.txt" | sed -E 's/ +/ /g'
}
for i in 1 2 3; do bench ep4-$i EP_BENCH_RANKS=4 EP_BENCH_PATH=ce EP_BENCH_CE_DEFAULTS=1; done
bench ep4-ring EP_BENCH_RANKS=4 EP_BENCH_PATH=ring
for i in 4 5; do bench ep4-$i EP_BENCH_RANKS=4 EP_BENCH_PATH=ce EP_BENCH_CE_DEFAULTS=1; done
for i in 1 2; do bench ep2-$i CUDA_VISIBLE_DEVICES=0,1 EP_BENCH_RANKS=2 EP_BENCH_PATH=ce EP_BENCH_CE_DEFAULTS=1; done
for b in gpu_intranode gpu_low_latency gpu_runtime gpu_layer_ep; do
    t $b-4 timeout 240 $W/$b
done
for b in gpu_intranode gpu_low_latency gpu_runtime gpu_layer_ep; do
    t $b-2 CUDA_VISIBLE_DEVICES=0,1 timeout 240 $W/$b
done
s=$SECONDS
timeout 200 compute-sanitizer --tool memcheck --report-api-errors no $W/gpu_intranode ce- >"$R/memcheck-ce.txt" 2>&1
echo "memcheck ce- rc=$? ($((SECONDS - s)) s)"; grep -E 'ERROR SUMMARY|passed, ' "$R/memcheck-ce.txt" | tail -n 3
for f in $R/*.txt; do [ $(wc -c <"$f") -gt 200000 ] && { head -c 100000 "$f" >"$f.head"; rm "$f"; }; done
tar -C $R -czf $OUT/call11.tgz .
