#!/usr/bin/env bash
# Call 12: the final tree again (w10 = w8's bench_intranode) on a fresh machine named nvidia-h200-x4: bench_intranode
# EP4 copy-engine defaults twice, the rings once, EP2; NCCL in every run.
set -uo pipefail
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0
W=.gpu/w10 R=/tmp/c12
mkdir -p $R
xz -d -f $W/bench_intranode.xz
chmod +x $W/bench_intranode
{ date -u +%FT%TZ; nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm --format=csv; } >"$R/machine.txt" 2>&1
head -n 3 "$R/machine.txt"
bench() {
    local tag=$1 s=$SECONDS; shift
    env "$@" EP_BENCH_QUICK=1 EP_BENCH_OUT=$R/$tag.json timeout 150 $W/bench_intranode >"$R/$tag.txt" 2>&1
    echo "$tag rc=$? ($((SECONDS - s)) s) timeouts: $(grep -c 'timed out' $R/$tag.txt)"
    grep -E 'best at <= 24|nccl-rows' "$R/$tag.txt"
}
bench ep4-1 EP_BENCH_RANKS=4 EP_BENCH_PATH=ce EP_BENCH_CE_SPLITS=1:20:4:1 EP_BENCH_CE_CHUNKS=768:4096,1024:4096 EP_BENCH_CE_LOCAL=0:4,2:4
bench ep4-ring EP_BENCH_RANKS=4 EP_BENCH_PATH=ring
bench ep4-2 EP_BENCH_RANKS=4 EP_BENCH_PATH=ce EP_BENCH_CE_SPLITS=1:20:4:1 EP_BENCH_CE_CHUNKS=768:4096,1024:4096 EP_BENCH_CE_LOCAL=0:4,2:4
bench ep2 CUDA_VISIBLE_DEVICES=0,1 EP_BENCH_RANKS=2 EP_BENCH_PATH=ce EP_BENCH_CE_SPLITS=1:22:2:1 EP_BENCH_CE_CHUNKS=768:4096,1024:4096
tar -C $R -czf $OUT/call12.tgz .
