# Session 11, call 4 (final tree): gpu_low_latency (threads + NVSHMEM launches), gpu_runtime
# (incl. nodes-2 / nodes-1), bench_low_latency threaded and NVSHMEM 2 x 2.
set -u
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo
R=.gpu/run
for f in $R/*.xz; do xz -d -f "$f"; done
chmod +x $R/* 2>/dev/null
nvidia-smi -L
t() { local name=$1; shift; s=$(date +%s); timeout 300 "$@" > $OUT/$name.txt 2>&1; echo "$name rc=$? $(( $(date +%s) - s )) s: $(grep -E '^[0-9]+ passed, [0-9]+ failed' $OUT/$name.txt | tail -1)"; grep -E "^(FAILED|FAIL )|\] FAILED|FAIL " $OUT/$name.txt | head -8; }
t test_ll $R/gpu_low_latency
t test_rt $R/gpu_runtime
export EP_BENCH_EXPERTS=288 EP_BENCH_ITERS=100
timeout 100 $R/bench_low_latency > $OUT/new.txt 2>&1; echo "new rc=$?"
EP_BENCH_NVSHMEM=2 timeout 100 $R/bench_low_latency > $OUT/nv2.txt 2>&1; echo "nv2 rc=$?"
for f in new nv2; do echo "== $f"; grep -E "x16|failed|Error" $OUT/$f.txt | grep -v "^{" | head -8; done
