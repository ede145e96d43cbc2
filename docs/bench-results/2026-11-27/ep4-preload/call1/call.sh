#!/usr/bin/env bash
# Call 1: the lazy-load probe (LAZY, EAGER); gpu_layout_fp8 (every kernel loaded up front);
# gpu_intranode at 4 GPUs; bench_intranode EP4 copy-engine defaults (the combine with both roles
# now the EP4 default) in three fresh processes, the rings once, EP2; NCCL in every run.
set -uo pipefail
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0
W=.gpu/w1 R=/tmp/c1
mkdir -p $R
for f in $W/*.xz; do xz -d -f "$f" & done; wait
chmod +x $W/*
{ date -u +%FT%TZ; nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm --format=csv; nvidia-smi topo -m; } >"$R/machine.txt" 2>&1
head -n 3 "$R/machine.txt"
for mode in LAZY EAGER; do
    CUDA_MODULE_LOADING=$mode CUDA_VISIBLE_DEVICES=0,1 timeout 60 $W/lazy_load_probe >"$R/probe-$mode.txt" 2>&1
    echo "probe $mode rc=$?"; cat "$R/probe-$mode.txt"
done
s=$SECONDS
timeout 120 $W/gpu_layout_fp8 >"$R/gpu_layout_fp8.txt" 2>&1
echo "gpu_layout_fp8 rc=$? ($((SECONDS - s)) s): $(grep -E '[0-9]+ passed' $R/gpu_layout_fp8.txt | tail -n 1)"
grep -E -A1 'entry point' $R/gpu_layout_fp8.txt | head -n 4
s=$SECONDS
timeout 150 $W/gpu_intranode >"$R/gpu_intranode.txt" 2>&1
echo "gpu_intranode rc=$? ($((SECONDS - s)) s): $(grep -E '[0-9]+ passed' $R/gpu_intranode.txt | tail -n 1)"
grep -E '^(FAILED|FAIL )' $R/gpu_intranode.txt | head -n 8
bench() {
    local tag=$1 s=$SECONDS; shift
    env "$@" EP_BENCH_QUICK=1 EP_BENCH_OUT=$R/$tag.json timeout 100 $W/bench_intranode >"$R/$tag.txt" 2>&1
    echo "$tag rc=$? ($((SECONDS - s)) s) timeouts: $(grep -c 'timed out' $R/$tag.txt)"
    grep -E 'best at <= 24|nccl-rows' "$R/$tag.txt"
}
for i in 1 2 3; do
    bench ep4-ce-$i EP_BENCH_RANKS=4 EP_BENCH_PATH=ce EP_BENCH_CE_SPLITS=1:20:4:1 EP_BENCH_CE_CHUNKS=768:4096 EP_BENCH_CE_LOCAL=0:4,2:4 EP_BENCH_CE_COMBINE_PUSH_WARPS=5,0
done
bench ep4-ring EP_BENCH_RANKS=4 EP_BENCH_PATH=ring
bench ep2-ce CUDA_VISIBLE_DEVICES=0,1 EP_BENCH_RANKS=2 EP_BENCH_PATH=ce EP_BENCH_CE_SPLITS=1:22:2:1 EP_BENCH_CE_CHUNKS=768:4096,1024:4096
for f in $R/*.txt; do [ $(wc -c <"$f") -gt 200000 ] && { head -c 100000 "$f" >"$f.head"; rm "$f"; }; done
tar -C $R -czf $OUT/call1.tgz .
