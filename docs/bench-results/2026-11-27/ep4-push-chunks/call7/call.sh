#!/usr/bin/env bash
# Call 7 (twenty-first session), w21: the tree with the pushed blocks' own chunking as the EP4
# bf16 default (512 rows; fp8 keeps the general chunking). Every multi-rank GPU test at 4 and 2
# GPUs; compute-sanitizer memcheck on the copy-engine cases of gpu_intranode; bench_intranode
# EP4 defaults three times (one beside the rings), a sweep around the defaults, EP2. NCCL in
# every run.
set -uo pipefail
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0
W=.gpu/w21 R=/tmp/c7
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
    grep -E 'ce-(dispatch-(bf16|fp8)|combine-bf16) +sms|best at <= 24|nccl-rows' "$R/$tag.txt" | sed -E 's/ +/ /g; s/ \(NVL, mean of ranks;/ (/; s/ring 4096: //'
}
S4="EP_BENCH_RANKS=4 EP_BENCH_PATH=ce EP_BENCH_CE_SPLITS=1:20:4:1"
bench ep4-1 $S4 EP_BENCH_CE_CHUNKS=768:4096
bench ep4-ring EP_BENCH_RANKS=4 EP_BENCH_PATH=ring
bench ep4-2 $S4 EP_BENCH_CE_CHUNKS=768:4096,1024:4096
bench ep4-sweep EP_BENCH_RANKS=4 EP_BENCH_PATH=ce EP_BENCH_CE_SPLITS=1:20:4:1,1:22:2:1,1:18:6:1 EP_BENCH_CE_CHUNKS=768:4096 EP_BENCH_CE_PUSH_CHUNKS=448:448,512:512,640:640,384:1536 EP_BENCH_CE_LOCAL=0:3,0:4,0:5 EP_BENCH_CE_TAIL=2
bench ep4-3 $S4 EP_BENCH_CE_CHUNKS=768:4096
bench ep2 CUDA_VISIBLE_DEVICES=0,1 EP_BENCH_RANKS=2 EP_BENCH_PATH=ce EP_BENCH_CE_SPLITS=1:22:2:1 EP_BENCH_CE_CHUNKS=768:4096,1024:4096
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
tar -C $R -czf $OUT/call7.tgz .
