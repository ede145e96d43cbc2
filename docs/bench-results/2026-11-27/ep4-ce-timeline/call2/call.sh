#!/usr/bin/env bash
# Call 2 (4 x H100): the copy-engine pack from two work queues (local stores first, NVLink
# pushes beside them) against the old static pack: gpu_intranode, then bench_intranode EP4 on
# the copy-engine path, old (w1) and new (w2) alternating; EP2 defaults old / new; a timeline
# of the new dispatch.
set -uo pipefail
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0
R=/tmp/c2
mkdir -p $R
for f in .gpu/w1/*.xz .gpu/w2/*.xz; do xz -d -f "$f" & done; wait
chmod +x .gpu/w1/bench_intranode .gpu/w1/gpu_intranode .gpu/w2/bench_intranode .gpu/w2/gpu_intranode
{ date -u +%FT%TZ; nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm --format=csv; } >"$R/machine.txt" 2>&1
head -n 2 "$R/machine.txt"
s=$SECONDS
timeout 200 .gpu/w2/gpu_intranode >"$R/gpu_intranode.txt" 2>&1
echo "gpu_intranode rc=$? ($((SECONDS - s)) s): $(grep -E '[0-9]+ passed' $R/gpu_intranode.txt | tail -n 1)"
grep -E '^(FAILED|FAIL )' $R/gpu_intranode.txt | head -n 8
bench() {
    local tag=$1 w=$2 s=$SECONDS; shift 2
    env "$@" EP_BENCH_QUICK=1 EP_BENCH_PATH=ce EP_BENCH_OUT=$R/$tag.json timeout 150 .gpu/$w/bench_intranode >"$R/$tag.txt" 2>&1
    echo "$tag rc=$? ($((SECONDS - s)) s)"
    grep -E 'best at <= 24|nccl-rows' "$R/$tag.txt"
}
EP4=(EP_BENCH_RANKS=4 EP_BENCH_CE_SPLITS=1:22:2:1,1:16:8:1,1:20:4:1 EP_BENCH_CE_CHUNKS=512:2048,768:4096,1024:4096)
for i in 1 2; do
    bench ep4-old-$i w1 "${EP4[@]}"
    bench ep4-new-$i w2 "${EP4[@]}" EP_BENCH_CE_LOCAL_WARPS=4,8,12
done
for i in 1; do
    bench ep2-old-$i w1 CUDA_VISIBLE_DEVICES=0,1 EP_BENCH_RANKS=2 EP_BENCH_CE_SPLITS=1:22:2:1 EP_BENCH_CE_CHUNKS=768:4096
    bench ep2-new-$i w2 CUDA_VISIBLE_DEVICES=0,1 EP_BENCH_RANKS=2 EP_BENCH_CE_SPLITS=1:22:2:1 EP_BENCH_CE_CHUNKS=768:4096
done
TL=$PWD/.gpu/w1
bench ep4-new-tl w2 EP_BENCH_RANKS=4 EP_BENCH_CE_SPLITS=1:22:2:1 EP_BENCH_CE_CHUNKS=768:4096 EP_BENCH_CE_LOCAL_WARPS=8 \
    LD_LIBRARY_PATH=$TL CUDA_INJECTION64_PATH=$TL/libep_timeline.so EP_TIMELINE_OUT=$R/tl
csv=$(ls $R/tl*.csv | head -n 1)
for d in 0 1 2 3; do
    python3 scripts/gpu/timeline/ce_steps.py "$csv" --device $d --kernel ce_dispatch --skip 3 --ops 10 --show 1 > $R/tl-dispatch-dev$d.txt 2>&1
done
cat $R/tl-dispatch-dev0.txt
tail -n 6 $R/tl-dispatch-dev[123].txt
xz -T8 $R/tl*.csv
tar -C $R -czf $OUT/call2.tgz .
