#!/usr/bin/env bash
# Call 2: the combine bias (shared experts' output added inside the combine) against the
# seventeenth session's build (old), bench_moe_layer alternating at EP4 and EP2; the timeline
# of the new build with the driver calls; bench_intranode's rings old against new.
set -x
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo
nvidia-smi -L
B=/tmp/b; mkdir -p $B
for f in .gpu/w7/*.xz; do n=$(basename $f .xz); xz -dc $f > $B/$n; chmod +x $B/$n; done
mkdir -p $OUT/r
TL=$PWD/.gpu/timeline
layer() { # name bin tokens ranks env...
    local name=$1 bin=$2 tok=$3 ranks=$4; shift 4
    env "$@" EP_BENCH_RANKS=$ranks EP_BENCH_TOKENS=$tok EP_BENCH_ITERS=20 timeout 120 $B/$bin > $OUT/r/$name.txt 2>&1
    echo "$name rc=$? $(grep -E "^ +$tok normal" $OUT/r/$name.txt)"
}
for i in 1 2 3 4; do
    layer ep4-4096-old-$i bench_moe_layer_old 4096 4
    layer ep4-4096-new-$i bench_moe_layer 4096 4
done
for tok in 2048 8192; do for i in 1 2; do
    layer ep4-$tok-old-$i bench_moe_layer_old $tok 4
    layer ep4-$tok-new-$i bench_moe_layer $tok 4
done; done
for i in 1 2; do
    layer ep4-4096-worst-shared1-old-$i bench_moe_layer_old 4096 4 EP_BENCH_WORST=4096 EP_BENCH_SHARED_FIRST=1
    layer ep4-4096-worst-shared1-new-$i bench_moe_layer 4096 4 EP_BENCH_WORST=4096 EP_BENCH_SHARED_FIRST=1
done
for i in 1 2; do
    CUDA_VISIBLE_DEVICES=0,1 layer ep2-4096-old-$i bench_moe_layer_old 4096 2
    CUDA_VISIBLE_DEVICES=0,1 layer ep2-4096-new-$i bench_moe_layer 4096 2
done
for cfg in default worst-shared1; do
    extra=""; [ $cfg = worst-shared1 ] && extra="EP_BENCH_WORST=4096 EP_BENCH_SHARED_FIRST=1"
    env $extra EP_BENCH_RANKS=4 EP_BENCH_TOKENS=4096 EP_BENCH_ITERS=8 EP_TIMELINE_DRIVER=1 \
        LD_LIBRARY_PATH=$TL:${LD_LIBRARY_PATH:-} CUDA_INJECTION64_PATH=$TL/libep_timeline.so \
        EP_TIMELINE_OUT=$OUT/r/tl-$cfg timeout 120 $B/bench_moe_layer > $OUT/r/tl-$cfg.txt 2>&1
    echo "timeline $cfg rc=$?"
done
for v in old new; do
    bin=bench_intranode; [ $v = old ] && bin=bench_intranode_old
    EP_BENCH_RANKS=4 EP_BENCH_QUICK=1 EP_BENCH_PATH=ring timeout 200 $B/$bin > $OUT/r/intranode-$v.txt 2>&1
    echo "intranode $v rc=$?"; grep -iE "combine|dispatch" $OUT/r/intranode-$v.txt | tail -8
done
cd $OUT && tar cJf r.tar.xz r && rm -rf r
