#!/usr/bin/env bash
# Call 4 (4 GPUs): the copy-engine path without its system fences per token (pack, "nf1") and
# per warp and chunk (combine's SM push, "nf2") against the build with both ("old"),
# alternating at EP4 and EP2; gpu_intranode three times and gpu_runtime on nf2; the EP4 rings
# in the same call; compute-sanitizer on gpu_intranode's small case.
set -uo pipefail
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo
B=.gpu/c4
R=/tmp/c4
mkdir -p $R
for f in "$B"/*.xz; do xz -d -f "$f" & done; wait
chmod +x "$B"/*
{ date -u +%FT%TZ; nvidia-smi --query-gpu=index,name,driver_version --format=csv; } >"$R/machine.txt" 2>&1
head -n 3 "$R/machine.txt"
t() {
    local name=$1 lim=$2; shift 2
    local s=$SECONDS
    timeout "$lim" "$@" >"$R/$name.txt" 2>&1
    echo "$name rc=$? ($((SECONDS - s)) s): $(grep -E '^[0-9]+ passed, [0-9]+ failed' "$R/$name.txt" | tail -n 1)"
    grep -E '^(FAILED|FAIL )' "$R/$name.txt" | head -n 8
}
t gpu_intranode-1 90 $B/gpu_intranode
t gpu_intranode-2 90 $B/gpu_intranode
t gpu_intranode-3 90 $B/gpu_intranode
t gpu_runtime 200 $B/gpu_runtime
ce() {
    local bin=$1 tag=$2 ranks=$3 s=$SECONDS
    CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((ranks - 1))) EP_BENCH_RANKS=$ranks EP_BENCH_QUICK=1 EP_BENCH_PATH=${PATHSEL:-ce} \
        EP_BENCH_OUT=$R/intranode-$tag.json timeout 90 $B/$bin >"$R/intranode-$tag.txt" 2>&1
    echo "intranode $tag rc=$? ($((SECONDS - s)) s)"
    grep -E '\(best\)|best at <= 24|nccl-rows' "$R/intranode-$tag.txt"
}
for i in 1 2; do
    ce bench_intranode_old ep4-ce-old-$i 4
    ce bench_intranode_nf1 ep4-ce-nf1-$i 4
    ce bench_intranode ep4-ce-nf2-$i 4
done
PATHSEL=ring ce bench_intranode ep4-ring-nf2 4
ce bench_intranode_old ep2-ce-old 2
ce bench_intranode ep2-ce-nf2 2
for tool in memcheck racecheck; do
    s=$SECONDS
    CUDA_VISIBLE_DEVICES=0 timeout 100 compute-sanitizer --tool $tool --error-exitcode 9 $B/gpu_intranode small \
        >"$R/sanitize-intranode-$tool.txt" 2>&1
    echo "sanitize intranode $tool rc=$? ($((SECONDS - s)) s): $(grep -E 'ERROR SUMMARY|RACECHECK SUMMARY|passed, ' $R/sanitize-intranode-$tool.txt | tr '\n' ' ')"
done
tar -C $R -czf $OUT/call4.tgz .
echo "total ${SECONDS}s"
