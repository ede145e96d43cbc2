#!/usr/bin/env bash
# On the GPU machine: the DeepSeek-V3-style example across 4 GPUs (one process each), the
# same command as on CPU plus --dtype bf16: generate (normal-mode prefill, low-latency decode)
# on GPUs and on CPUs for comparison, then serve + one plain and one streaming completion.
set -uo pipefail
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export DEEPSEEK_V3_CACHE=/tmp/dsv3-cache RUST_LOG=${RUST_LOG:-info} RUST_BACKTRACE=1
OUT="${OUT:-$PWD/gpu-out}"
mkdir -p "$OUT"
X="${EP_EXAMPLE_BIN:-.gpu/ex/deepseek-v3}"
n=$(nvidia-smi -L | wc -l)
prompts=(--prompt "Hello" --prompt "The quick brown fox" --prompt "Expert parallelism" --prompt "a b c" --prompt "DeepSeek")
for dev in gpu cpu; do
    extra=()
    [[ $dev == cpu ]] && extra=(--cpu)
    timeout 240 "$X" launch --nproc-per-node "$n" --master-port 29600 -- generate --dtype bf16 "${extra[@]}" \
        "${prompts[@]}" --max-tokens 12 --json >"$OUT/generate-$dev.txt" 2>"$OUT/generate-$dev.log"
    echo "generate on $dev x$n: rc=$?"
    grep '^{' "$OUT/generate-$dev.txt" | head -n 5
done
timeout 200 "$X" launch --nproc-per-node "$n" --master-port 29700 -- serve --dtype bf16 --port 8000 >"$OUT/serve.log" 2>&1 &
for i in $(seq 1 120); do
    curl -sf localhost:8000/health >/dev/null 2>&1 && break
    sleep 1
done
echo "health: $(curl -s localhost:8000/health)"
echo "completion: $(curl -s localhost:8000/v1/completions -H 'content-type: application/json' -d '{"prompt": "Hello", "max_tokens": 8}')"
echo "streaming:"
curl -sN localhost:8000/v1/completions -H 'content-type: application/json' -d '{"prompt": "Hello", "max_tokens": 8, "stream": true}' | head -n 12
echo "bad request: $(curl -s localhost:8000/v1/completions -H 'content-type: application/json' -d '{"prompt": 5}')"
kill %1 2>/dev/null
wait
tail -n 5 "$OUT/serve.log"
