#!/usr/bin/env bash
# Call 6 (w6: the dispatch-side tail reverted, `serial_copy_engines` kept, the combine's tail
# chunks chunk-major): gpu_intranode at 4 and 2 GPUs; the EP4 copy-engine dispatch on the
# CUPTI timeline with 4 local-role warps per block (default) and with 4 whole local blocks;
# the defaults twice beside NCCL.
set -uo pipefail
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0
W=.gpu/w6 R=/tmp/c6
mkdir -p $R
for f in $W/*.xz; do xz -d -f "$f" & done; wait
chmod +x $W/bench_intranode $W/gpu_intranode
{ date -u +%FT%TZ; nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm --format=csv; } >"$R/machine.txt" 2>&1
head -n 2 "$R/machine.txt"
t() {
    local tag=$1 s=$SECONDS; shift
    env "$@" >"$R/$tag.txt" 2>&1
    echo "$tag rc=$? ($((SECONDS - s)) s): $(grep -E '^[0-9]+ passed, [0-9]+ failed' $R/$tag.txt | tail -n 1)"
    grep -E '^(FAILED|FAIL )' $R/$tag.txt | head -n 5
}
t gpu_intranode-4 timeout 150 $W/gpu_intranode
t gpu_intranode-2 CUDA_VISIBLE_DEVICES=0,1 timeout 150 $W/gpu_intranode
bench() {
    local tag=$1 s=$SECONDS; shift
    env "$@" EP_BENCH_QUICK=1 EP_BENCH_OUT=$R/$tag.json timeout 150 $W/bench_intranode >"$R/$tag.txt" 2>&1
    echo "$tag rc=$? ($((SECONDS - s)) s) timeouts: $(grep -c 'timed out' $R/$tag.txt)"
    grep -E 'best at <= 24|nccl-rows' "$R/$tag.txt"
}
TL=$PWD/$W
for loc in 0:4 4:0; do
    bench tl-$loc EP_BENCH_RANKS=4 EP_BENCH_PATH=ce EP_BENCH_CE_SPLITS=1:20:4:1 EP_BENCH_CE_CHUNKS=768:4096 EP_BENCH_CE_LOCAL=$loc \
        LD_LIBRARY_PATH=$TL CUDA_INJECTION64_PATH=$TL/libep_timeline.so EP_TIMELINE_OUT=$R/tl-${loc/:/-}
    csv=$(ls $R/tl-${loc/:/-}*.csv | head -n 1)
    for d in 0 1 2 3; do
        python3 scripts/gpu/timeline/ce_steps.py "$csv" --device $d --kernel ce_dispatch --skip 3 --ops 10 --show 1 > $R/steps-${loc/:/-}-dev$d.txt 2>&1
    done
    head -n 40 $R/steps-${loc/:/-}-dev0.txt
    tail -n 6 $R/steps-${loc/:/-}-dev*.txt
    xz -T8 "$csv"
done
for i in 1 2; do
    bench ep4-$i EP_BENCH_RANKS=4 EP_BENCH_PATH=ce EP_BENCH_CE_SPLITS=1:20:4:1 EP_BENCH_CE_CHUNKS=768:4096 EP_BENCH_CE_LOCAL=0:4 EP_BENCH_CE_COMBINE_PUSH_WARPS=5 EP_BENCH_CE_TAIL=2
done
for f in $R/*.txt; do [ $(wc -c <"$f") -gt 200000 ] && { head -c 100000 "$f" >"$f.head"; rm "$f"; }; done
tar -C $R -czf $OUT/call6.tgz .
