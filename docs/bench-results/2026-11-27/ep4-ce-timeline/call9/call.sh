#!/usr/bin/env bash
# Call 9 (4 x H100): the final tree (w7: pack work queues, the combine with both roles per
# block, `NvlTransfer::Auto` = copy engines up to 4 ranks): gpu_intranode, gpu_runtime,
# gpu_layer_ep; compute-sanitizer on the new cases; bench_intranode EP4 / EP2 defaults beside
# the rings and the session's first build (w1); bench_moe_layer EP4 4096 rings / copy engines.
set -uo pipefail
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo
R=/tmp/c9
mkdir -p $R
for f in .gpu/w1/*.xz .gpu/w7/*.xz; do xz -d -f "$f" & done; wait
chmod +x .gpu/w1/* .gpu/w7/*
{ date -u +%FT%TZ; nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm --format=csv; } >"$R/machine.txt" 2>&1
head -n 2 "$R/machine.txt"
for t in gpu_intranode gpu_runtime gpu_layer_ep; do
    s=$SECONDS
    timeout 240 .gpu/w7/$t >"$R/$t.txt" 2>&1
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
    bench ep4-new-$i w7 EP_BENCH_RANKS=4 EP_BENCH_PATH=ce EP_BENCH_CE_SPLITS=1:20:4:1,1:16:8:1 EP_BENCH_CE_CHUNKS=768:4096
    bench ep4-old-$i w1 EP_BENCH_RANKS=4 EP_BENCH_PATH=ce EP_BENCH_CE_SPLITS=1:22:2:1,1:16:8:1 EP_BENCH_CE_CHUNKS=768:4096,256:1024
done
bench ep4-ring w7 EP_BENCH_RANKS=4 EP_BENCH_PATH=ring
bench ep2-new w7 CUDA_VISIBLE_DEVICES=0,1 EP_BENCH_RANKS=2 EP_BENCH_PATH=ce EP_BENCH_CE_SPLITS=1:22:2:1 EP_BENCH_CE_CHUNKS=768:4096,1024:4096 EP_BENCH_CE_COMBINE_PUSH_WARPS=0,5
bench ep2-old w1 CUDA_VISIBLE_DEVICES=0,1 EP_BENCH_RANKS=2 EP_BENCH_PATH=ce EP_BENCH_CE_SPLITS=1:22:2:1 EP_BENCH_CE_CHUNKS=768:4096,1024:4096
layer() {
    local tag=$1 nvl=$2 s=$SECONDS
    EP_BENCH_NVL=$nvl EP_BENCH_RANKS=4 EP_BENCH_TOKENS=4096 EP_BENCH_ITERS=20 EP_BENCH_OUT=$R/layer-$tag.json \
        timeout 150 .gpu/w7/bench_moe_layer >"$R/layer-$tag.txt" 2>&1
    echo "layer $tag rc=$? ($((SECONDS - s)) s)"; grep -E '^ *[0-9]+ +normal' "$R/layer-$tag.txt" | cut -c1-170
}
for i in 1 2; do
    layer rings-$i rings
    layer ce-$i copy-engine
done
s=$SECONDS
timeout 200 compute-sanitizer --tool memcheck --report-api-errors no .gpu/w7/gpu_intranode ce-combine-roles >"$R/memcheck-roles.txt" 2>&1
echo "memcheck ce-combine-roles rc=$? ($((SECONDS - s)) s)"; tail -n 3 "$R/memcheck-roles.txt"
s=$SECONDS
timeout 200 compute-sanitizer --tool racecheck .gpu/w7/gpu_intranode ce-combine-roles-all >"$R/racecheck-roles.txt" 2>&1
echo "racecheck ce-combine-roles-all rc=$? ($((SECONDS - s)) s)"; tail -n 3 "$R/racecheck-roles.txt"
tar -C $R -czf $OUT/call9.tgz .
