#!/usr/bin/env bash
# Call 12 (twenty-first session), w23 (the final tree), a fresh machine named nvidia-h200-x4:
# if it is 4 x H200, bench_intranode EP4 defaults three times, the rings, EP2, and
# gpu_intranode at 4 and 2 GPUs; otherwise print the machine and stop.
set -uo pipefail
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0
W=.gpu/w23 R=/tmp/c12
mkdir -p $R
{ date -u +%FT%TZ; nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm --format=csv; } >"$R/machine.txt" 2>&1
cat "$R/machine.txt"
if ! grep -q H200 "$R/machine.txt"; then
    echo "not 4 x H200: nothing run"
    tar -C $R -czf $OUT/call12.tgz .
    exit 0
fi
for f in $W/bench_intranode.xz $W/gpu_intranode.xz; do xz -d -f "$f" & done; wait
chmod +x $W/*
bench() {
    local tag=$1 s=$SECONDS; shift
    env "$@" EP_BENCH_QUICK=1 EP_BENCH_OUT=$R/$tag.json timeout 170 $W/bench_intranode >"$R/$tag.txt" 2>&1
    echo "$tag rc=$? ($((SECONDS - s)) s) timeouts: $(grep -c 'timed out' $R/$tag.txt)"
    grep -E 'best at <= 24|nccl-rows' "$R/$tag.txt" | sed -E 's/ +/ /g'
}
for i in 1 2 3; do bench ep4-$i EP_BENCH_RANKS=4 EP_BENCH_PATH=ce EP_BENCH_CE_DEFAULTS=1; done
bench ep4-ring EP_BENCH_RANKS=4 EP_BENCH_PATH=ring
bench ep2 CUDA_VISIBLE_DEVICES=0,1 EP_BENCH_RANKS=2 EP_BENCH_PATH=ce EP_BENCH_CE_DEFAULTS=1
timeout 240 $W/gpu_intranode >"$R/gpu_intranode-4.txt" 2>&1; echo "gpu_intranode-4 rc=$?: $(tail -n 1 $R/gpu_intranode-4.txt)"
CUDA_VISIBLE_DEVICES=0,1 timeout 200 $W/gpu_intranode >"$R/gpu_intranode-2.txt" 2>&1; echo "gpu_intranode-2 rc=$?: $(tail -n 1 $R/gpu_intranode-2.txt)"
tar -C $R -czf $OUT/call12.tgz .
