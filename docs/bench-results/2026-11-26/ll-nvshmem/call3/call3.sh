# Session 11, call 3: gpu_low_latency (threads 4/2/1; NVSHMEM 2x2, 1x4, 2x1 incl. a rank that
# never launches / is masked), gpu_runtime (incl. nodes-2 / nodes-1), memcheck and racecheck on
# NVSHMEM cases (API errors of NCCL's init inside NVSHMEM not reported), the NVSHMEM process
# bench (1 x 4 on the heap, 2 x 2 again) beside the threaded one.
set -u
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo
R=.gpu/run
for f in $R/*.xz $R/old/*.xz; do [ -e "$f" ] && xz -d -f "$f"; done
chmod +x $R/* $R/old/* 2>/dev/null
nvidia-smi -L
t() { local name=$1; shift; s=$(date +%s); timeout ${TT:-300} "$@" > $OUT/$name.txt 2>&1; echo "$name rc=$? $(( $(date +%s) - s )) s: $(grep -E '^[0-9]+ passed, [0-9]+ failed' $OUT/$name.txt | tail -1)"; grep -E "^(FAILED|FAIL )|\] FAILED|FAIL " $OUT/$name.txt | head -8; }
t test_ll $R/gpu_low_latency
t test_rt $R/gpu_runtime
grep -E "absent rank" $OUT/test_ll.txt | head -8
export EP_BENCH_EXPERTS=288 EP_BENCH_ITERS=100
b() { local name=$1; shift; s=$(date +%s); timeout 120 "$@" > $OUT/$name.txt 2>&1; echo "$name rc=$? $(( $(date +%s) - s )) s"; }
b new $R/bench_low_latency
b nv4 env EP_BENCH_NVSHMEM=4 $R/bench_low_latency
b nv2 env EP_BENCH_NVSHMEM=2 $R/bench_low_latency
for f in new nv4 nv2; do echo "== $f"; grep -E "x16|failed|Error" $OUT/$f.txt | grep -v "^{" | head -8; done
S="/usr/local/cuda/bin/compute-sanitizer --target-processes all --report-api-errors no --error-exitcode 7"
for tool in memcheck racecheck; do
  s=$(date +%s)
  EP_NVSHMEM_TIMEOUT=170 timeout 200 $S --tool $tool $R/gpu_low_latency nvshmem/2x1/round_trip/bf16/random > $OUT/$tool.txt 2>&1
  echo "$tool rc=$? $(( $(date +%s) - s )) s"; grep -E "ERROR SUMMARY|RACECHECK SUMMARY|passed, " $OUT/$tool.txt | tail -8
done
cd $OUT && tar czf bench.tgz new.txt nv*.txt && rm -f new.txt nv*.txt
