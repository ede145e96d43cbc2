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
    # Small cases only: the sanitizers slow kernels down by orders of magnitude.
    for tool in memcheck racecheck; do
        for spec in "gpu_intranode small" "gpu_low_latency r1/round_trip/fp8/random"; do
            set -- $spec
            [[ -x "$B/$1" ]] || continue
            # One GPU (R = 1): the sanitizers serialise kernels, so ranks that spin on each
            # other across GPUs of one process would only time out.
            CUDA_VISIBLE_DEVICES=0 timeout "${EP_SANITIZE_TIMEOUT:-100}" compute-sanitizer --tool "$tool" --error-exitcode 9 \
                "$B/$1" "$2" >"$R/sanitize-$tool-$1.txt" 2>&1
            echo "sanitize $tool $1 $2: rc=$? $(grep -E 'ERROR SUMMARY|passed, ' "$R/sanitize-$tool-$1.txt" | tail -n 2 | tr '\n' ' ')"
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
