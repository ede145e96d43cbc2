#!/usr/bin/env bash
# Call 3 (4 GPUs): the copy-engine dispatch without the pack's per-token system fence (new)
# against the build with it (old), alternating; gpu_intranode on the new build three times;
# the low-latency ops at EP2; the layer at EP4 with the shared experts after / before the
# dispatch at 2048 / 4096 / 8192 tokens; compute-sanitizer on the low-latency protocol (R = 1).
set -uo pipefail
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo
B=.gpu/c3
R=/tmp/c3
mkdir -p $R
for f in "$B"/*.xz; do xz -d -f "$f" & done; wait
chmod +x "$B"/*
{ date -u +%FT%TZ; nvidia-smi --query-gpu=index,name,driver_version --format=csv; } >"$R/machine.txt" 2>&1
head -n 3 "$R/machine.txt"
left() { (( SECONDS < ${1} )); }
for i in 1 2 3; do
    s=$SECONDS
    timeout 90 $B/gpu_intranode >"$R/gpu_intranode-$i.txt" 2>&1
    echo "gpu_intranode #$i rc=$? ($((SECONDS - s)) s): $(grep -E '^[0-9]+ passed' $R/gpu_intranode-$i.txt | tail -n 1)"
    grep -E '^(FAILED|FAIL )' $R/gpu_intranode-$i.txt | head -n 5
done
ce() {
    local bin=$1 tag=$2 ranks=$3 s=$SECONDS
    CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((ranks - 1))) EP_BENCH_RANKS=$ranks EP_BENCH_QUICK=1 EP_BENCH_PATH=${PATHSEL:-ce} \
        EP_BENCH_OUT=$R/intranode-$tag.json timeout 90 $B/$bin >"$R/intranode-$tag.txt" 2>&1
    echo "intranode $tag rc=$? ($((SECONDS - s)) s)"
    grep -E 'best at <= 24|nccl-rows' "$R/intranode-$tag.txt"
}
ce bench_intranode_old ep4-ce-old-1 4
ce bench_intranode ep4-ce-new-1 4
ce bench_intranode_old ep4-ce-old-2 4
ce bench_intranode ep4-ce-new-2 4
PATHSEL=ring ce bench_intranode ep4-ring-new 4
ce bench_intranode_old ep2-ce-old 2
ce bench_intranode ep2-ce-new 2
s=$SECONDS
CUDA_VISIBLE_DEVICES=0,1 EP_BENCH_RANKS=2 EP_BENCH_EXPERTS=256,288 EP_BENCH_OUT=$R/low-latency-ep2.json timeout 100 \
    $B/bench_low_latency >"$R/low-latency-ep2.txt" 2>&1
echo "bench_low_latency EP2 rc=$? ($((SECONDS - s)) s)"
grep -E 'x16 graph|^ +288 (dispatch|combine)( per rank)? ' "$R/low-latency-ep2.txt"
layer() {
    local tag=$1 first=$2 s=$SECONDS
    EP_BENCH_RANKS=4 EP_BENCH_TOKENS=2048,4096,8192 EP_BENCH_ITERS=30 EP_BENCH_SHARED_FIRST=$first \
        EP_BENCH_OUT=$R/layer-$tag.json timeout 150 $B/bench_moe_layer >"$R/layer-$tag.txt" 2>&1
    echo "layer $tag rc=$? ($((SECONDS - s)) s)"; grep -A 3 '^tokens' "$R/layer-$tag.txt" | cut -c1-160; grep 'beside the shared' "$R/layer-$tag.txt" | sort -u | cut -c1-200
}
for i in 1 2 3; do
    left 420 || break
    layer off-$i 0
    layer on-$i 1
done
for tool in memcheck racecheck; do
    left 540 || break
    s=$SECONDS
    CUDA_VISIBLE_DEVICES=0 timeout 100 compute-sanitizer --tool $tool --error-exitcode 9 $B/gpu_low_latency r1/round_trip/fp8/random \
        >"$R/sanitize-ll-$tool.txt" 2>&1
    echo "sanitize ll $tool rc=$? ($((SECONDS - s)) s): $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|passed, ' $R/sanitize-ll-$tool.txt | tr '\n' ' ')"
done
tar -C $R -czf $OUT/call3.tgz .
echo "total ${SECONDS}s"
