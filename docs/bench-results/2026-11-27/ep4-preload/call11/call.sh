#!/usr/bin/env bash
# Call 11: the layer at EP4 (bench_moe_layer, 4096 tokens per rank, exact outputs) with the SM
# rings and with the copy-engine path (`EP_BENCH_NVL`), alternating, twice each: does the
# copy-engine combine's new default change which path the layer should take?
set -uo pipefail
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo
W=.gpu/w11 R=/tmp/c11
mkdir -p $R
xz -d -f $W/bench_moe_layer.xz
chmod +x $W/bench_moe_layer
{ date -u +%FT%TZ; nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm --format=csv; } >"$R/machine.txt" 2>&1
head -n 2 "$R/machine.txt"
for i in 1 2; do
    for nvl in rings copy-engine; do
        s=$SECONDS
        env EP_BENCH_NVL=$nvl EP_BENCH_RANKS=4 EP_BENCH_TOKENS=4096 EP_BENCH_ITERS=8 \
            timeout 150 $W/bench_moe_layer >"$R/layer-$nvl-$i.txt" 2>&1
        echo "layer $nvl $i rc=$? ($((SECONDS - s)) s)"
        grep -E '^ *4096 (normal|back|dispatch)' "$R/layer-$nvl-$i.txt" | cut -c1-240
    done
done
tar -C $R -czf $OUT/call11.tgz .
