#!/usr/bin/env bash
# Call 10 (twenty-first session), w21 (the committed kernels): the fp8 dispatch's split and
# local roles now that it has a config of its own (`CeConfig::dispatch_fp8_for`): splits 20+4 and
# 18+6, local roles 0:4, 2:4, 1:4, 0:3, chunks 768/4096 and 768/2048, twice in two orders.
# bench_intranode EP4 (the bf16 rows of the same sweep use the bf16 push chunks), NCCL in every run.
set -uo pipefail
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0
W=.gpu/w21 R=/tmp/c10
mkdir -p $R
xz -d -f $W/bench_intranode.xz
chmod +x $W/bench_intranode
{ date -u +%FT%TZ; nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm --format=csv; } >"$R/machine.txt" 2>&1
head -n 3 "$R/machine.txt"
bench() {
    local tag=$1 s=$SECONDS; shift
    env "$@" EP_BENCH_QUICK=1 EP_BENCH_OUT=$R/$tag.json timeout 170 $W/bench_intranode >"$R/$tag.txt" 2>&1
    echo "$tag rc=$? ($((SECONDS - s)) s) timeouts: $(grep -c 'timed out' $R/$tag.txt)"
    grep -E 'ce-dispatch-fp8 +sms|best at <= 24|nccl-rows' "$R/$tag.txt" | sed -E 's/ +/ /g; s/ \(NVL, mean of ranks;/ (/; s/ring //; s/ lanes2 ce-out//'
}
bench fp8-1 EP_BENCH_RANKS=4 EP_BENCH_PATH=ce EP_BENCH_CE_SPLITS=1:20:4:1,1:18:6:1 EP_BENCH_CE_CHUNKS=768:4096,768:2048 EP_BENCH_CE_LOCAL=0:4,2:4,1:4,0:3 EP_BENCH_CE_TAIL=2
bench fp8-2 EP_BENCH_RANKS=4 EP_BENCH_PATH=ce EP_BENCH_CE_SPLITS=1:18:6:1,1:20:4:1 EP_BENCH_CE_CHUNKS=768:2048,768:4096 EP_BENCH_CE_LOCAL=0:3,1:4,2:4,0:4 EP_BENCH_CE_TAIL=2
tar -C $R -czf $OUT/call10.tgz .
