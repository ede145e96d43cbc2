#!/usr/bin/env bash
# Call 9 (twenty-first session), w22: the final tree's gpu_intranode (the call-7 tree plus a
# case checking the pushed blocks' chunking) at 4 and 2 GPUs, and compute-sanitizer racecheck
# on the push-chunk cases.
set -uo pipefail
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0
W=.gpu/w22 R=/tmp/c9
mkdir -p $R
xz -d -f $W/gpu_intranode.xz
chmod +x $W/gpu_intranode
{ date -u +%FT%TZ; nvidia-smi --query-gpu=index,name,driver_version,clocks.max.sm --format=csv; } >"$R/machine.txt" 2>&1
head -n 3 "$R/machine.txt"
t() {
    local tag=$1 s=$SECONDS; shift
    env "$@" >"$R/$tag.txt" 2>&1
    echo "$tag rc=$? ($((SECONDS - s)) s): $(grep -E '^[0-9]+ passed, [0-9]+ failed' $R/$tag.txt | tail -n 1)"
    grep -E '^(FAILED|FAIL )' $R/$tag.txt | head -n 5
}
t gpu_intranode-4 timeout 240 $W/gpu_intranode
t gpu_intranode-2 CUDA_VISIBLE_DEVICES=0,1 timeout 200 $W/gpu_intranode
s=$SECONDS
timeout 200 compute-sanitizer --tool racecheck $W/gpu_intranode ce-push-chunks >"$R/racecheck-push-chunks.txt" 2>&1
echo "racecheck ce-push-chunks rc=$? ($((SECONDS - s)) s)"; grep -E 'RACECHECK SUMMARY|ERROR SUMMARY|passed, ' "$R/racecheck-push-chunks.txt" | tail -n 3
tar -C $R -czf $OUT/call9.tgz .
