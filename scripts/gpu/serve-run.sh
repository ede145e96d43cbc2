#!/usr/bin/env bash
# Serving on one GPU: `deepseek-v3 serve` with DeepSeek-V2-Lite's shape and random weights,
# `bench-serve` against it at concurrency 1, 8, 32 and 64 (512-token prompts, 128 output
# tokens), the server's /metrics after the run, then the Hugging Face transformers baseline
# on the same config at batch 1 and 64, all in one device command.
#
# Usage (GPU machine, repo root; the cuda build of deepseek-v3 in $EP_GPU_BIN, maybe .xz):
#   bash scripts/gpu/serve-run.sh [serve|hf]...   (default: both)
# Env: EP_SERVE_GPUS=N serves with N processes, one per GPU (`deepseek-v3 launch`; default 1),
#      EP_SERVE_MAX_BATCH (per rank, default 64), EP_SERVE_CONCURRENCY (default 1,8,32,64),
#      EP_SERVE_QUANT=fp8 makes the weights block-scaled fp8 (`--quant fp8`; default none),
#      EP_SERVE_CONFIG another model shape (default configs/deepseek-v2-lite.json; e.g.
#      configs/deepseek-v3-6-layers.json, DeepSeek-V3's widths in 6 layers), EP_SERVE_EXTRA more
#      `serve` arguments (e.g. `--init-router-skew 1 --eplb-interval 40`).
set -uo pipefail
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
OUT="${OUT:-$PWD/gpu-out}"
B="${EP_GPU_BIN:-.gpu/bin}"
mkdir -p "$OUT"
for f in "$B"/*.xz; do [[ -e "$f" ]] && xz -d -f "$f"; done
chmod +x "$B"/* 2>/dev/null
steps=("$@")
[[ ${#steps[@]} -eq 0 ]] && steps=(serve hf)
want() { [[ " ${steps[*]} " == *" $1 "* ]]; }
CONFIG=${EP_SERVE_CONFIG:-examples/deepseek-v3/configs/deepseek-v2-lite.json}
{ date -u +%FT%TZ; nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv; } | tee "$OUT/machine.txt"
if want serve; then
    gpus=${EP_SERVE_GPUS:-1}
    launch=()
    [[ $gpus -gt 1 ]] && launch=(launch --nproc-per-node "$gpus" --master-port 29650 --)
    # Its own process group, so that stopping it stops every rank.
    RUST_LOG=${RUST_LOG:-info} setsid "$B/deepseek-v3" "${launch[@]}" serve --init random --config "$CONFIG" --dtype bf16 \
        --quant "${EP_SERVE_QUANT:-none}" --max-batch "${EP_SERVE_MAX_BATCH:-64}" --max-prompt-tokens 512 --max-tokens-limit 128 \
        --port 8000 ${EP_SERVE_EXTRA:-} >"$OUT/serve.log" 2>&1 &
    server=$!
    for _ in $(seq 1 300); do
        curl -sf http://127.0.0.1:8000/health >/dev/null 2>&1 && break
        kill -0 $server 2>/dev/null || break
        sleep 1
    done
    echo "server up after ${SECONDS}s: $(curl -s http://127.0.0.1:8000/health)"
    timeout "${EP_SERVE_TIMEOUT:-420}" "$B/deepseek-v3" bench-serve --url http://127.0.0.1:8000 \
        --concurrency "${EP_SERVE_CONCURRENCY:-1,8,32,64}" --prompt-tokens 512 --output-tokens 128 \
        --json "$OUT/bench-serve.json" >"$OUT/bench-serve.txt" 2>&1
    echo "bench-serve rc=$?"; tail -n 20 "$OUT/bench-serve.txt"
    curl -s http://127.0.0.1:8000/metrics >"$OUT/metrics.txt"
    grep -E "^(ds_|deepseek|ep_)?[a-z_]*(step|seconds)_(sum|count)" "$OUT/metrics.txt" | head -n 12
    kill -TERM -- -$server; wait $server 2>/dev/null
    tail -n 5 "$OUT/serve.log"
fi
if want hf; then
    PYTHONUNBUFFERED=1 timeout "${EP_HF_TIMEOUT:-300}" python3 scripts/gpu/anchors/hf_generate.py \
        --batch-sizes 1,64 --prompt-tokens 512 --output-tokens 128 >"$OUT/hf.jsonl" 2>"$OUT/hf.log"
    echo "hf rc=$?"; cat "$OUT/hf.jsonl"; tail -n 5 "$OUT/hf.log"
fi
