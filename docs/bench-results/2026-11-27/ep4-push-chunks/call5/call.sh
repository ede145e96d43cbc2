#!/usr/bin/env bash
# Call 5 (twenty-first session), w19: an experiment, not a kept build. bench_intranode at EP4
# with the receivers' copy-out of the pushed rows skipped (EP_EXPERIMENT_SKIP_COPY_OUT, a
# temporary line in the launcher; the received rows are then wrong) against the same binary
# without it, alternating, to bound what landing the pushed rows straight in recv_x could gain.
set -uo pipefail
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0
W=.gpu/w19 R=/tmp/c5
mkdir -p $R
for f in $W/*.xz; do xz -d -f "$f" & done; wait
chmod +x $W/*
{ date -u +%FT%TZ; nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm --format=csv; } >"$R/machine.txt" 2>&1
head -n 3 "$R/machine.txt"
bench() {
    local tag=$1 s=$SECONDS; shift
    env "$@" EP_BENCH_QUICK=1 EP_BENCH_OUT=$R/$tag.json timeout 170 $W/bench_intranode >"$R/$tag.txt" 2>&1
    echo "$tag rc=$? ($((SECONDS - s)) s) timeouts: $(grep -c 'timed out' $R/$tag.txt)"
    grep -E 'ce-dispatch-(bf16|fp8) +sms|nccl-rows|rror' "$R/$tag.txt" | sed -E 's/ +/ /g; s/ \(NVL, mean of ranks;/ (/'
}
S4="EP_BENCH_RANKS=4 EP_BENCH_PATH=ce EP_BENCH_CE_SPLITS=1:20:4:1,1:16:8:1 EP_BENCH_CE_TAIL=2 EP_BENCH_CE_CHUNKS=768:4096,1024:4096"
bench base-1 $S4
bench skip-1 $S4 EP_EXPERIMENT_SKIP_COPY_OUT=1
bench base-2 $S4
bench skip-2 $S4 EP_EXPERIMENT_SKIP_COPY_OUT=1
tar -C $R -czf $OUT/call5.tgz .
