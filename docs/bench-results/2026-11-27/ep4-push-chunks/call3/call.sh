#!/usr/bin/env bash
# Call 3 (twenty-first session), w17: one direction of each SM pair pushed, the other pulled by
# the receiver's SM blocks (`dispatch_push_one_way`, split push mode 2), against both pushed
# (mode 1). gpu_intranode at 4 and 2 GPUs; bench_intranode EP4 twice (splits 20+4 push, and
# 20+4 / 16+8 / 12+12 one-way, local warps 4 / 8 / 12, chunks 768/4096 and 1024/4096). NCCL in
# every run.
set -uo pipefail
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0
W=.gpu/w17 R=/tmp/c3
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
    grep -E 'ce-dispatch-bf16 sms|best at <= 24|nccl-rows' "$R/$tag.txt" | sed -E 's/ +/ /g; s/ \(NVL, mean of ranks;/ (/'
}
t gpu_intranode-4 timeout 240 $W/gpu_intranode
t gpu_intranode-2 CUDA_VISIBLE_DEVICES=0,1 timeout 200 $W/gpu_intranode
for i in 1 2; do
bench ep4-$i EP_BENCH_RANKS=4 EP_BENCH_PATH=ce EP_BENCH_CE_SPLITS=1:20:4:1,1:20:4:2,1:16:8:2,1:12:12:2 EP_BENCH_CE_CHUNKS=768:4096,1024:4096 EP_BENCH_CE_LOCAL=0:4,0:8,0:12 EP_BENCH_CE_TAIL=2
done
tar -C $R -czf $OUT/call3.tgz .
