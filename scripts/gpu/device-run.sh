#!/usr/bin/env bash
# One batch on the GPU machine (4 x H200 expected): every GPU test, compute-sanitizer on the
# small cases, and the benchmarks at EP4 and EP2 (EP2 on GPUs 0,1 of the same machine).
# Everything lands in $OUT; a tarball of the logs and JSON is $OUT/all.tgz.
#
# Usage (on the GPU machine, from the repo root, with .gpu/bin carried):
#   bash scripts/gpu/device-run.sh [tests|sanitize|bench]...   (default: all three)
set -uo pipefail
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
OUT="${OUT:-$PWD/gpu-out}"
B="${EP_GPU_BIN:-.gpu/bin}"
R="$OUT/run"
mkdir -p "$R"
steps=("$@")
[[ ${#steps[@]} -eq 0 ]] && steps=(tests sanitize bench)
want() { [[ " ${steps[*]} " == *" $1 "* ]]; }
ngpu=$(nvidia-smi -L | wc -l)
{ date -u +%FT%TZ; nvidia-smi -L; nvidia-smi topo -m; } >"$R/machine.txt" 2>&1

if want tests; then
    OUT="$R" EP_GPU_TIMEOUT="${EP_GPU_TIMEOUT:-300}" bash scripts/gpu/run-all.sh >"$R/tests.txt" 2>&1
    tail -n 12 "$R/tests.txt"
fi
if want sanitize; then
    for tool in memcheck racecheck; do
        for t in gpu_intranode gpu_low_latency; do
            [[ -x "$B/$t" ]] || continue
            timeout 240 compute-sanitizer --tool "$tool" --error-exitcode 9 "$B/$t" small \
                >"$R/sanitize-$tool-$t.txt" 2>&1
            echo "sanitize $tool $t: rc=$? $(grep -E 'ERROR SUMMARY|passed, ' "$R/sanitize-$tool-$t.txt" | tail -n 2 | tr '\n' ' ')"
        done
    done
fi
if want bench; then
    for ranks in 4 2; do
        [[ $ngpu -lt $ranks ]] && continue
        vis=$(seq -s, 0 $((ranks - 1)))
        CUDA_VISIBLE_DEVICES=$vis EP_BENCH_RANKS=$ranks EP_BENCH_OUT="$R/intranode-ep$ranks.json" \
            timeout 300 "$B/bench_intranode" >"$R/bench-intranode-ep$ranks.txt" 2>&1
        echo "bench_intranode EP$ranks rc=$?"
        tail -n 14 "$R/bench-intranode-ep$ranks.txt"
        CUDA_VISIBLE_DEVICES=$vis EP_BENCH_RANKS=$ranks EP_BENCH_OUT="$R/low-latency-ep$ranks.json" \
            timeout 200 "$B/bench_low_latency" >"$R/bench-low-latency-ep$ranks.txt" 2>&1
        echo "bench_low_latency EP$ranks rc=$?"
        tail -n 24 "$R/bench-low-latency-ep$ranks.txt"
    done
fi
tar -C "$R" -czf "$OUT/all.tgz" . && rm -rf "$R"
