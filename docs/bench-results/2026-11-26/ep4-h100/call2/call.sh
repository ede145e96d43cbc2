#!/usr/bin/env bash
# Call 2 on a 4-GPU machine: the benchmarks. bench_moe_layer at EP4 with the shared experts
# after / before the dispatch (alternating), bench_internode and bench_moe_layer_nodes as
# 2 nodes x 2, bench_low_latency at EP4, the EP4 ring dispatch / combine beside NCCL.
set -uo pipefail
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo
B=.gpu/c2
R=$OUT
for f in "$B"/*.xz; do xz -d -f "$f" & done; wait
chmod +x "$B"/*
{ date -u +%FT%TZ; nvidia-smi --query-gpu=index,name,driver_version --format=csv; } >"$R/machine.txt" 2>&1
head -n 3 "$R/machine.txt"
left() { (( SECONDS < ${1} )); }
layer() {
    local tag=$1 first=$2 s=$SECONDS
    EP_BENCH_RANKS=4 EP_BENCH_TOKENS=${EP_TOK:-128,4096} EP_BENCH_ITERS=${EP_IT:-20} EP_BENCH_SHARED_FIRST=$first \
        EP_BENCH_OUT=$R/layer-$tag.json timeout 150 $B/bench_moe_layer >"$R/layer-$tag.txt" 2>&1
    echo "layer $tag rc=$? ($((SECONDS - s)) s)"; grep -A 4 '^tokens' "$R/layer-$tag.txt"; grep 'beside the shared' "$R/layer-$tag.txt"
}
layer off-1 0
layer on-1 1
layer off-2 0
layer on-2 1
s=$SECONDS
EP_BENCH_ITERS=7 timeout 120 $B/bench_internode >"$R/internode.txt" 2>&1
echo "bench_internode rc=$? ($((SECONDS - s)) s)"; tail -n 14 "$R/internode.txt"
s=$SECONDS
EP_BENCH_TOKENS=512,4096 EP_BENCH_ITERS=5 timeout 150 $B/bench_moe_layer_nodes >"$R/layer-nodes.txt" 2>&1
echo "bench_moe_layer_nodes rc=$? ($((SECONDS - s)) s)"; tail -n 6 "$R/layer-nodes.txt"
if left 470; then
    s=$SECONDS
    EP_BENCH_RANKS=4 EP_BENCH_EXPERTS=288 EP_BENCH_OUT=$R/low-latency.json timeout 100 $B/bench_low_latency >"$R/low-latency.txt" 2>&1
    echo "bench_low_latency rc=$? ($((SECONDS - s)) s)"
    head -n 46 "$R/low-latency.txt"
fi
if left 530; then
    s=$SECONDS
    EP_BENCH_RANKS=4 EP_BENCH_QUICK=1 EP_BENCH_PATH=ring EP_BENCH_OUT=$R/intranode.json timeout 60 $B/bench_intranode >"$R/intranode.txt" 2>&1
    echo "bench_intranode rc=$? ($((SECONDS - s)) s)"; grep -E '^(dispatch|combine|nccl)' "$R/intranode.txt" | grep -v summary | head -n 20
fi
echo "total ${SECONDS}s"
