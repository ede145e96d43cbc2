#!/usr/bin/env bash
# Call 8 (fifteenth session): on 4 x H200 (this call's machine), bench_intranode at EP4 with the
# copy-engine path and the rings, twice each, beside NCCL (issue 19's targets are on H200).
set -uo pipefail
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo
B=.gpu/d8
R=/tmp/d8
rm -rf $R; mkdir -p $R
xz -d -f $B/bench_intranode.xz; chmod +x $B/*
{ date -u +%FT%TZ; nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm --format=csv; } >"$R/machine.txt" 2>&1
head -n 3 "$R/machine.txt"
ce() {
    local tag=$1 path=$2 ranks=$3 s=$SECONDS
    CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((ranks - 1))) EP_BENCH_RANKS=$ranks EP_BENCH_QUICK=1 EP_BENCH_PATH=$path \
        EP_BENCH_OUT=$R/intranode-$tag.json timeout 90 $B/bench_intranode >"$R/intranode-$tag.txt" 2>&1
    echo "intranode $tag rc=$? ($((SECONDS - s)) s)"
    grep -E 'best at <= 24|nccl-rows' "$R/intranode-$tag.txt"
}
for i in 1 2; do
    ce ep4-ce-$i ce 4
    ce ep4-ring-$i ring 4
done
ce ep2-ce ce 2
tar -C $R -czf $OUT/call8.tgz .
echo "total ${SECONDS}s"
