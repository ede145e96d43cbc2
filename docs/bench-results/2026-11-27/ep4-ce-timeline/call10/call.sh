#!/usr/bin/env bash
# Call 10 (4 x H100): the final tree (w8: the copy-engine kernels split into
# copy_engine_dispatch.cu / copy_engine_combine.cu, `NvlTransfer::Auto` back to the rings
# beyond 2 ranks): gpu_intranode, gpu_runtime, gpu_layer_ep; memcheck on every copy-engine
# case; bench_intranode EP4 / EP2 copy-engine defaults and the rings.
set -uo pipefail
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo
R=/tmp/c10
mkdir -p $R
for f in .gpu/w8/*.xz; do xz -d -f "$f" & done; wait
chmod +x .gpu/w8/*
{ date -u +%FT%TZ; nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm --format=csv; } >"$R/machine.txt" 2>&1
head -n 2 "$R/machine.txt"
for t in gpu_intranode gpu_runtime gpu_layer_ep; do
    s=$SECONDS
    timeout 240 .gpu/w8/$t >"$R/$t.txt" 2>&1
    echo "$t rc=$? ($((SECONDS - s)) s): $(grep -E '[0-9]+ passed' $R/$t.txt | tail -n 1)"
    grep -E '^(FAILED|FAIL )' $R/$t.txt | head -n 8
done
bench() {
    local tag=$1 s=$SECONDS; shift
    env "$@" EP_BENCH_QUICK=1 EP_BENCH_OUT=$R/$tag.json timeout 200 .gpu/w8/bench_intranode >"$R/$tag.txt" 2>&1
    echo "$tag rc=$? ($((SECONDS - s)) s)"
    grep -E 'best at <= 24|nccl-rows' "$R/$tag.txt"
}
for i in 1 2; do
    bench ep4-ce-$i EP_BENCH_RANKS=4 EP_BENCH_PATH=ce EP_BENCH_CE_SPLITS=1:20:4:1,1:16:8:1 EP_BENCH_CE_CHUNKS=768:4096
done
bench ep4-ring EP_BENCH_RANKS=4 EP_BENCH_PATH=ring
bench ep2-ce CUDA_VISIBLE_DEVICES=0,1 EP_BENCH_RANKS=2 EP_BENCH_PATH=ce EP_BENCH_CE_SPLITS=1:22:2:1 EP_BENCH_CE_CHUNKS=768:4096,1024:4096
s=$SECONDS
timeout 300 compute-sanitizer --tool memcheck --report-api-errors no .gpu/w8/gpu_intranode ce- >"$R/memcheck-ce.txt" 2>&1
echo "memcheck ce- rc=$? ($((SECONDS - s)) s)"; tail -n 3 "$R/memcheck-ce.txt"
tar -C $R -czf $OUT/call10.tgz .
