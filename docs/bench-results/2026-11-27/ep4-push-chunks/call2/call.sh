#!/usr/bin/env bash
# Call 2 (twenty-first session), w16: the copy-engine peer's last dispatch chunks stored by the
# pack over NVLink (`dispatch_sm_tail_chunks`). gpu_intranode at 4 and 2 GPUs; bench_intranode
# EP4 with tails 0, 1, 2 crossed with chunks 768/4096, 1024/4096, 512/4096, twice; EP2 with
# tails 0 and 1. NCCL in every run.
set -uo pipefail
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0
W=.gpu/w16 R=/tmp/c2
mkdir -p $R
for f in $W/*.xz; do xz -d -f "$f" & done; wait
chmod +x $W/*
{ date -u +%FT%TZ; nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm --format=csv; } >"$R/machine.txt" 2>&1
head -n 3 "$R/machine.txt"
t() {
    local tag=$1 s=$SECONDS; shift
    env "$@" >"$R/$tag.txt" 2>&1
    echo "$tag rc=$? ($((SECONDS - s)) s): $(grep -E '^[0-9]+ passed, [0-9]+ failed' $R/$tag.txt | tail -n 1)"
    grep -iE '^(FAILED|FAIL )|fail' $R/$tag.txt | grep -v '0 failed' | head -n 8
}
bench() {
    local tag=$1 s=$SECONDS; shift
    env "$@" EP_BENCH_QUICK=1 EP_BENCH_OUT=$R/$tag.json timeout 170 $W/bench_intranode >"$R/$tag.txt" 2>&1
    echo "$tag rc=$? ($((SECONDS - s)) s) timeouts: $(grep -c 'timed out' $R/$tag.txt)"
    grep -E 'ce-dispatch-bf16 sms|ce-dispatch-fp8 sms|best at <= 24|nccl-rows' "$R/$tag.txt" | sed -E 's/ +/ /g'
}
t gpu_intranode-4 timeout 240 $W/gpu_intranode
t gpu_intranode-2 CUDA_VISIBLE_DEVICES=0,1 timeout 200 $W/gpu_intranode
bench ep4-a EP_BENCH_RANKS=4 EP_BENCH_PATH=ce EP_BENCH_CE_SPLITS=1:20:4:1 EP_BENCH_CE_CHUNKS=768:4096,1024:4096,512:4096 EP_BENCH_CE_DISPATCH_TAIL=0,1,2
bench ep4-b EP_BENCH_RANKS=4 EP_BENCH_PATH=ce EP_BENCH_CE_SPLITS=1:20:4:1 EP_BENCH_CE_CHUNKS=768:4096,1024:4096,512:4096 EP_BENCH_CE_DISPATCH_TAIL=2,1,0
bench ep2 CUDA_VISIBLE_DEVICES=0,1 EP_BENCH_RANKS=2 EP_BENCH_PATH=ce EP_BENCH_CE_SPLITS=1:22:2:1 EP_BENCH_CE_CHUNKS=768:4096,1024:4096 EP_BENCH_CE_DISPATCH_TAIL=0,1
tar -C $R -czf $OUT/call2.tgz .
