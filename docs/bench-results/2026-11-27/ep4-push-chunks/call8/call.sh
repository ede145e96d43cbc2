#!/usr/bin/env bash
# Call 8 (twenty-first session), w21 again: the pushed rows copied out by the SM pull blocks
# (variant 1:2:0) instead of the copy engines (1:2:1), and one copy lane (1:1:1), each with
# push chunks 512, 256 and the general chunking, on 20+4, 18+6 and 16+8 SMs; then the defaults
# twice. bench_intranode EP4, NCCL in every run.
set -uo pipefail
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0
W=.gpu/w21 R=/tmp/c8
mkdir -p $R
xz -d -f $W/bench_intranode.xz
chmod +x $W/bench_intranode
{ date -u +%FT%TZ; nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm --format=csv; } >"$R/machine.txt" 2>&1
head -n 3 "$R/machine.txt"
bench() {
    local tag=$1 s=$SECONDS; shift
    env "$@" EP_BENCH_QUICK=1 EP_BENCH_OUT=$R/$tag.json timeout 170 $W/bench_intranode >"$R/$tag.txt" 2>&1
    echo "$tag rc=$? ($((SECONDS - s)) s) timeouts: $(grep -c 'timed out' $R/$tag.txt)"
    grep -E 'ce-dispatch-(bf16|fp8) +sms|best at <= 24|nccl-rows' "$R/$tag.txt" | sed -E 's/ +/ /g; s/ \(NVL, mean of ranks;/ (/; s/ring 4096: //; s/chunk 768 //; s/ local0:4//'
}
bench ep4-sweep EP_BENCH_RANKS=4 EP_BENCH_PATH=ce EP_BENCH_CE_SPLITS=1:20:4:1,1:18:6:1,1:16:8:1 EP_BENCH_CE_CHUNKS=768:4096 EP_BENCH_CE_VARIANTS=1:2:1,1:2:0,1:1:1 EP_BENCH_CE_PUSH_CHUNKS=512:512,256:256,0:0 EP_BENCH_CE_TAIL=2
bench ep4-1 EP_BENCH_RANKS=4 EP_BENCH_PATH=ce EP_BENCH_CE_SPLITS=1:20:4:1 EP_BENCH_CE_CHUNKS=768:4096,1024:4096
bench ep4-2 EP_BENCH_RANKS=4 EP_BENCH_PATH=ce EP_BENCH_CE_SPLITS=1:20:4:1 EP_BENCH_CE_CHUNKS=768:4096,1024:4096
tar -C $R -czf $OUT/call8.tgz .
