#!/usr/bin/env bash
# Call 2 (seventeenth session, 4 GPUs, call 1's build on the same warm machine): more pairs,
# exact against worst-case dispatch outputs, at EP2 (4096, 8192) and EP4 (4096). The
# "ep2-rings" runs set EP_BENCH_NVL=rings, which this build did not read yet: they are a third
# run of the exact (copy-engine) path.
set -uo pipefail
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo
B=.gpu/w1; R=/tmp/w2; rm -rf $R; mkdir -p $R
[ -x $B/bench_moe_layer ] || { for f in "$B"/*.xz; do xz -d -f "$f" & done; wait; chmod +x $B/*; }
layer() {
    local tag=$1 ranks=$2 tokens=$3 s=$SECONDS; shift 3
    env "$@" CUDA_VISIBLE_DEVICES=$(seq -s, 0 $((ranks - 1))) EP_BENCH_RANKS=$ranks EP_BENCH_TOKENS=$tokens \
        EP_BENCH_ITERS=20 EP_BENCH_OUT=$R/layer-$tag.json timeout 100 $B/bench_moe_layer >"$R/layer-$tag.txt" 2>&1
    echo "$tag rc=$? $(grep -E '^ *[0-9]+ +normal' "$R/layer-$tag.txt" | cut -c1-150)"
}
for i in 1 2 3 4 5; do
  for tok in 4096 8192; do
    layer ep2-exact-$tok-$i 2 $tok
    layer ep2-worst-$tok-$i 2 $tok EP_BENCH_WORST=$tok
    layer ep2-rings-$tok-$i 2 $tok EP_BENCH_NVL=rings
  done
  layer ep4-exact-4096-$i 4 4096
  layer ep4-worst-4096-$i 4 4096 EP_BENCH_WORST=4096
done
tar -C $R -czf $OUT/call2.tgz .
echo total ${SECONDS}s
