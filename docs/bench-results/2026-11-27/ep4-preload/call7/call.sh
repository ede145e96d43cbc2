#!/usr/bin/env bash
# Call 7: w7 = the pack takes its next work item one token ahead and loads a token's routing
# before its row; w6 = call 6's build. gpu_intranode (w7) at 4 and 2 GPUs; EP4 dispatch of
# both builds, alternating, twice: splits 20+4 and 22+2, 2 / 4 / 8 local-role warps.
set -uo pipefail
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0
R=/tmp/c7
mkdir -p $R
for w in .gpu/w6 .gpu/w7; do for f in $w/*.xz; do xz -d -f "$f" & done; done; wait
chmod +x .gpu/w6/bench_intranode .gpu/w7/*
{ date -u +%FT%TZ; nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm --format=csv; } >"$R/machine.txt" 2>&1
head -n 2 "$R/machine.txt"
t() {
    local tag=$1 s=$SECONDS; shift
    env "$@" >"$R/$tag.txt" 2>&1
    echo "$tag rc=$? ($((SECONDS - s)) s): $(grep -E '^[0-9]+ passed, [0-9]+ failed' $R/$tag.txt | tail -n 1)"
    grep -E '^(FAILED|FAIL )' $R/$tag.txt | head -n 5
}
t gpu_intranode-4 timeout 150 .gpu/w7/gpu_intranode
t gpu_intranode-2 CUDA_VISIBLE_DEVICES=0,1 timeout 150 .gpu/w7/gpu_intranode
bench() {
    local tag=$1 w=$2 s=$SECONDS; shift 2
    env "$@" EP_BENCH_QUICK=1 EP_BENCH_OUT=$R/$tag.json timeout 150 .gpu/$w/bench_intranode >"$R/$tag.txt" 2>&1
    echo "$tag rc=$? ($((SECONDS - s)) s) timeouts: $(grep -c 'timed out' $R/$tag.txt)"
    grep -E 'best at <= 24|nccl-rows' "$R/$tag.txt"
}
for i in 1 2; do
    for w in w6 w7; do
        bench d-$w-$i $w EP_BENCH_RANKS=4 EP_BENCH_PATH=ce EP_BENCH_CE_SPLITS=1:20:4:1,1:22:2:1 EP_BENCH_CE_CHUNKS=768:4096 EP_BENCH_CE_LOCAL=0:2,0:4,0:8 EP_BENCH_CE_TAIL=2
    done
done
for f in $R/*.txt; do [ $(wc -c <"$f") -gt 200000 ] && { head -c 100000 "$f" >"$f.head"; rm "$f"; }; done
tar -C $R -czf $OUT/call7.tgz .
