#!/usr/bin/env bash
# Call 11 (4 x H100): why the copy-engine path is slower inside the layer at EP4: bench_moe_layer
# EP4 4096 tokens with the rings and with the copy engines (`EP_BENCH_NVL`), each on a CUPTI
# timeline (`scripts/gpu/timeline/`), per-step tables of the back-to-back steps.
set -uo pipefail
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo
R=/tmp/c11
mkdir -p $R
for f in .gpu/w9/*.xz; do xz -d -f "$f" & done; wait
chmod +x .gpu/w9/bench_moe_layer
{ date -u +%FT%TZ; nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm --format=csv; } >"$R/machine.txt" 2>&1
head -n 2 "$R/machine.txt"
TL=$PWD/.gpu/w9
for nvl in rings copy-engine; do
    s=$SECONDS
    env EP_BENCH_NVL=$nvl EP_BENCH_RANKS=4 EP_BENCH_TOKENS=4096 EP_BENCH_ITERS=8 \
        LD_LIBRARY_PATH=$TL CUDA_INJECTION64_PATH=$TL/libep_timeline.so EP_TIMELINE_OUT=$R/tl-$nvl \
        timeout 150 .gpu/w9/bench_moe_layer >"$R/layer-$nvl.txt" 2>&1
    echo "layer $nvl rc=$? ($((SECONDS - s)) s)"; grep -E '^ *4096 (normal|back)' "$R/layer-$nvl.txt" | cut -c1-200
    csv=$(ls $R/tl-$nvl*.csv | head -n 1)
    for d in 0 1 2 3; do
        python3 scripts/gpu/timeline/timeline.py "$csv" --device $d --steps 20 --skip 12 > "$R/steps-$nvl-dev$d.txt" 2>&1
    done
    tail -n 30 "$R/steps-$nvl-dev0.txt"
    xz -T8 "$csv"
done
tar -C $R -czf $OUT/call11.tgz .
