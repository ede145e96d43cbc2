#!/usr/bin/env bash
# Call 6 (twenty-first session), w20: the dispatch's pushed blocks in chunks of their own
# (`push_first_chunk_rows` / `push_max_chunk_rows`, EP_BENCH_CE_PUSH_CHUNKS), so that the
# receivers copy them out while they are in L2. gpu_intranode at 4 and 2 GPUs; bench_intranode
# EP4 twice (push chunks in two orders, general chunks 768/4096), NCCL in every run.
set -uo pipefail
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0
W=.gpu/w20 R=/tmp/c6
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
    grep -E 'ce-dispatch-(bf16|fp8) +sms|nccl-rows' "$R/$tag.txt" | sed -E 's/ +/ /g; s/ \(NVL, mean of ranks;/ (/; s/ring 4096: //; s/ local0:4 lanes2 ce-out//'
}
t gpu_intranode-4 timeout 240 $W/gpu_intranode
t gpu_intranode-2 CUDA_VISIBLE_DEVICES=0,1 timeout 200 $W/gpu_intranode
S4="EP_BENCH_RANKS=4 EP_BENCH_PATH=ce EP_BENCH_CE_SPLITS=1:20:4:1 EP_BENCH_CE_TAIL=2 EP_BENCH_CE_CHUNKS=768:4096"
bench ep4-1 $S4 EP_BENCH_CE_PUSH_CHUNKS=0:0,128:128,256:256,384:384,512:512,768:768,128:512,256:1024
bench ep4-2 $S4 EP_BENCH_CE_PUSH_CHUNKS=256:1024,128:512,768:768,512:512,384:384,256:256,128:128,0:0
tar -C $R -czf $OUT/call6.tgz .
