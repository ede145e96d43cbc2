#!/usr/bin/env bash
# Call 6 (4 GPUs, final tree): the EP4 copy-engine path with two copy-engine peers per GPU
# beside one, now that the pack has no per-token fence; the rings in the same call.
set -uo pipefail
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0
B=.gpu/c6
R=/tmp/c6
mkdir -p $R
xz -d -f $B/bench_intranode.xz; chmod +x $B/bench_intranode
nvidia-smi --query-gpu=index,name --format=csv | head -n 2
for i in 1 2; do
    for splits in "1:22:2:1,1:20:4:1" "2:22:2:1,2:20:4:1,2:16:8:1,2:12:12:1"; do
        tag=ce$(echo ${splits:0:1})-$i
        EP_BENCH_RANKS=4 EP_BENCH_QUICK=1 EP_BENCH_PATH=ce EP_BENCH_CE_SPLITS="$splits" \
            EP_BENCH_CE_CHUNKS="512:2048,768:4096,1024:4096" EP_BENCH_OUT=$R/$tag.json \
            timeout 90 $B/bench_intranode >$R/$tag.txt 2>&1
        echo "$tag rc=$?"; grep -E '\(best\)|nccl-rows' $R/$tag.txt
    done
done
EP_BENCH_RANKS=4 EP_BENCH_QUICK=1 EP_BENCH_PATH=ring EP_BENCH_OUT=$R/ring.json timeout 60 $B/bench_intranode >$R/ring.txt 2>&1
echo "ring rc=$?"; grep -E '\(best\)|nccl-rows' $R/ring.txt
tar -C $R -czf $OUT/call6.tgz .
