#!/usr/bin/env bash
# Call 4 (twenty-first session), w18: the own rows stored in the pushes' pass
# (`own_rows_with_pushes`, variant own 2) against a pass of their own (own 1); the pushed rows
# copied out by SMs (variant 1:2:0), one copy lane (1:1:1), first chunks 640 and 896.
# gpu_intranode at 4 and 2 GPUs; bench_intranode EP4 (twice for the own-rows comparison), EP2.
set -uo pipefail
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0
W=.gpu/w18 R=/tmp/c4
mkdir -p $R
for f in $W/*.xz; do xz -d -f "$f" & done; wait
chmod +x $W/*
{ date -u +%FT%TZ; nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm --format=csv; } >"$R/machine.txt" 2>&1
head -n 3 "$R/machine.txt"
t() {
    local tag=$1 s=$SECONDS; shift
    env "$@" >"$R/$tag.txt" 2>&1
    echo "$tag rc=$? ($((SECONDS - s)) s): $(grep -E '^[0-9]+ passed, [0-9]+ failed' $R/$tag.txt | tail -n 1)"
    grep -iE 'fail' $R/$tag.txt | grep -v '0 failed' | head -n 8
}
bench() {
    local tag=$1 s=$SECONDS; shift
    env "$@" EP_BENCH_QUICK=1 EP_BENCH_OUT=$R/$tag.json timeout 170 $W/bench_intranode >"$R/$tag.txt" 2>&1
    echo "$tag rc=$? ($((SECONDS - s)) s) timeouts: $(grep -c 'timed out' $R/$tag.txt)"
    grep -E 'ce-dispatch-(bf16|fp8) +sms|best at <= 24|nccl-rows' "$R/$tag.txt" | sed -E 's/ +/ /g; s/ \(NVL, mean of ranks;/ (/'
}
t gpu_intranode-4 timeout 240 $W/gpu_intranode
t gpu_intranode-2 CUDA_VISIBLE_DEVICES=0,1 timeout 200 $W/gpu_intranode
S4="EP_BENCH_RANKS=4 EP_BENCH_PATH=ce EP_BENCH_CE_SPLITS=1:20:4:1 EP_BENCH_CE_TAIL=2"
bench ep4-own-1 $S4 EP_BENCH_CE_VARIANTS=1:2:1,2:2:1 EP_BENCH_CE_CHUNKS=768:4096,1024:4096 EP_BENCH_CE_LOCAL=0:4,0:3,0:6
bench ep4-own-2 $S4 EP_BENCH_CE_VARIANTS=2:2:1,1:2:1 EP_BENCH_CE_CHUNKS=1024:4096,768:4096 EP_BENCH_CE_LOCAL=0:6,0:3,0:4
bench ep4-misc $S4 EP_BENCH_CE_VARIANTS=1:2:1,1:2:0,1:1:1 EP_BENCH_CE_CHUNKS=768:4096,640:4096,896:4096
bench ep2 CUDA_VISIBLE_DEVICES=0,1 EP_BENCH_RANKS=2 EP_BENCH_PATH=ce EP_BENCH_CE_SPLITS=1:22:2:1 EP_BENCH_CE_CHUNKS=768:4096 EP_BENCH_CE_VARIANTS=1:2:0,2:2:0
tar -C $R -czf $OUT/call4.tgz .
