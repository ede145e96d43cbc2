#!/usr/bin/env bash
# Call 3 (4 x H100): the copy-engine pack from three work queues (rows fetched by the peers,
# pushes, own rows) with local-role warps or whole local blocks (w3), against the two-queue
# build of call 2 (w2, pack_local_warps 4) and the static pack (w1); gpu_intranode on w3;
# a timeline of w3's dispatch.
set -uo pipefail
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0
R=/tmp/c3
mkdir -p $R
for f in .gpu/w1/*.xz .gpu/w2/*.xz .gpu/w3/*.xz; do xz -d -f "$f" & done; wait
chmod +x .gpu/w*/bench_intranode .gpu/w*/gpu_intranode
{ date -u +%FT%TZ; nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm --format=csv; } >"$R/machine.txt" 2>&1
head -n 2 "$R/machine.txt"
s=$SECONDS
timeout 200 .gpu/w3/gpu_intranode >"$R/gpu_intranode.txt" 2>&1
echo "gpu_intranode rc=$? ($((SECONDS - s)) s): $(grep -E '[0-9]+ passed' $R/gpu_intranode.txt | tail -n 1)"
grep -E '^(FAILED|FAIL )' $R/gpu_intranode.txt | head -n 8
bench() {
    local tag=$1 w=$2 s=$SECONDS; shift 2
    env "$@" EP_BENCH_QUICK=1 EP_BENCH_PATH=ce EP_BENCH_OUT=$R/$tag.json timeout 150 .gpu/$w/bench_intranode >"$R/$tag.txt" 2>&1
    echo "$tag rc=$? ($((SECONDS - s)) s)"
    grep -E 'best at <= 24|nccl-rows' "$R/$tag.txt"
}
EP4=(EP_BENCH_RANKS=4 EP_BENCH_CE_SPLITS=1:22:2:1,1:20:4:1 EP_BENCH_CE_CHUNKS=768:4096,1024:4096)
for i in 1 2; do
    bench ep4-w1-$i w1 "${EP4[@]}"
    bench ep4-w2-$i w2 "${EP4[@]}" EP_BENCH_CE_LOCAL_WARPS=2,4
    bench ep4-w3-$i w3 "${EP4[@]}" EP_BENCH_CE_LOCAL=0:2,0:4,0:6,3:0,4:0,6:0,3:2,4:2
done
TL=$PWD/.gpu/w1
bench ep4-w3-tl w3 EP_BENCH_RANKS=4 EP_BENCH_CE_SPLITS=1:20:4:1 EP_BENCH_CE_CHUNKS=768:4096 EP_BENCH_CE_LOCAL=4:0,0:4 \
    LD_LIBRARY_PATH=$TL CUDA_INJECTION64_PATH=$TL/libep_timeline.so EP_TIMELINE_OUT=$R/tl
csv=$(ls $R/tl*.csv | head -n 1)
for d in 0 1 2 3; do
    python3 scripts/gpu/timeline/ce_steps.py "$csv" --device $d --kernel ce_dispatch --skip 3 --ops 10 --show 1 > $R/tl-local4-dev$d.txt 2>&1
    python3 scripts/gpu/timeline/ce_steps.py "$csv" --device $d --kernel ce_dispatch --skip 29 --ops 10 --show 1 > $R/tl-warps4-dev$d.txt 2>&1
done
cat $R/tl-local4-dev0.txt
tail -n 6 $R/tl-warps4-dev0.txt
xz -T8 $R/tl*.csv
tar -C $R -czf $OUT/call3.tgz .
