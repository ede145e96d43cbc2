#!/usr/bin/env bash
# Call 1 (nineteenth session, 4 x H100): the copy-engine dispatch and combine at EP4 on a
# CUPTI timeline (kernel vs copy-engine copies per op), and the quick ring / copy-engine
# sweeps as this machine's baseline.
set -uo pipefail
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0
B=.gpu/w1
R=/tmp/c1
mkdir -p $R
for f in "$B"/*.xz; do xz -d -f "$f" & done; wait
chmod +x "$B"/bench_intranode "$B"/gpu_intranode
{ date -u +%FT%TZ; nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm --format=csv; } >"$R/machine.txt" 2>&1
head -n 3 "$R/machine.txt"
bench() {
    local tag=$1 s=$SECONDS; shift
    env "$@" EP_BENCH_RANKS=4 EP_BENCH_QUICK=1 timeout 150 $B/bench_intranode >"$R/$tag.txt" 2>&1
    echo "$tag rc=$? ($((SECONDS - s)) s)"
    grep -E 'best at <= 24|nccl-rows' "$R/$tag.txt"
}
bench ring EP_BENCH_PATH=ring
TL=$PWD/$B
bench ce-tl EP_BENCH_PATH=ce EP_BENCH_CE_SPLITS=1:22:2:1,1:16:8:1 EP_BENCH_CE_CHUNKS=768:4096 \
    LD_LIBRARY_PATH=$TL CUDA_INJECTION64_PATH=$TL/libep_timeline.so EP_TIMELINE_OUT=$R/tl
ls $R
csv=$(ls $R/tl*.csv | head -n 1)
for d in 0 1 2 3; do
  for k in "ce_dispatch" "ce_combine"; do
    python3 scripts/gpu/timeline/ce_steps.py "$csv" --device $d --kernel $k --skip 3 --ops 10 --show 1 > $R/ce-$k-dev$d.txt 2>&1
  done
done
cat $R/ce-ce_dispatch-dev0.txt | head -60
tail -n 8 $R/ce-ce_dispatch-dev*.txt
tail -n 8 $R/ce-ce_combine-dev0.txt
xz -T8 $R/tl*.csv
tar -C $R -czf $OUT/call1.tgz .
