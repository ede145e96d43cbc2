#!/usr/bin/env bash
# On a 4-GPU machine: the DeepSeek-V3-style example as 2 nodes x 2 GPUs on one host, built with
# `--features nvshmem` (the EP buffer's low-latency ops over NVSHMEM, prefill as low-latency
# chunks), beside the same command as one node of 4 GPUs. Two launchers stand for the two
# nodes; node 1 sees the GPUs permuted (CUDA_VISIBLE_DEVICES=2,3,0,1) so that its ranks take
# GPUs 2 and 3 while NVSHMEM's P2P transport still sees every GPU (NVLink standing in for the
# network: NVSHMEM_REMOTE_TRANSPORT=none). Prints each run's generations (rank 0's JSON).
#
# Usage (GPU machine, repo root): bash scripts/gpu/example-nodes-run.sh
# Env: EP_EXAMPLE_BIN (default .gpu/ex/deepseek-v3), OUT (default ./gpu-out).
set -uo pipefail
export NVSHMEM_DISABLE_NVLS=1 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
export NVSHMEM_REMOTE_TRANSPORT=none NVSHMEM_BOOTSTRAP_UID_SOCK_IFNAME=lo
export DEEPSEEK_V3_CACHE=/tmp/dsv3-cache RUST_LOG=${RUST_LOG:-info} RUST_BACKTRACE=1
OUT="${OUT:-$PWD/gpu-out}"
mkdir -p "$OUT"
X="${EP_EXAMPLE_BIN:-.gpu/ex/deepseek-v3}"
[[ -f "$X.xz" ]] && xz -d -f "$X.xz"
chmod +x "$X"
prompts=(--prompt "Hello" --prompt "The quick brown fox" --prompt "Expert parallelism" --prompt "a b c" --prompt "DeepSeek")
gen=(generate --dtype bf16 "${prompts[@]}" --max-tokens 12 --json)

s=$(date +%s)
timeout 240 "$X" launch --nproc-per-node 4 --master-port 29600 -- "${gen[@]}" \
    >"$OUT/generate-1x4.txt" 2>"$OUT/generate-1x4.log"
echo "one node x 4: rc=$? ($(( $(date +%s) - s )) s)"
grep '^{' "$OUT/generate-1x4.txt" | head -n 5

s=$(date +%s)
CUDA_VISIBLE_DEVICES=0,1,2,3 timeout 300 "$X" launch --nnodes 2 --node-rank 0 --nproc-per-node 2 \
    --master-port 29650 -- "${gen[@]}" >"$OUT/generate-2x2.txt" 2>"$OUT/generate-2x2-node0.log" &
CUDA_VISIBLE_DEVICES=2,3,0,1 timeout 300 "$X" launch --nnodes 2 --node-rank 1 --nproc-per-node 2 \
    --master-port 29650 -- "${gen[@]}" >"$OUT/generate-2x2-node1.txt" 2>"$OUT/generate-2x2-node1.log"
rc1=$?
wait %1
rc0=$?
echo "two nodes x 2: rc node0=$rc0 node1=$rc1 ($(( $(date +%s) - s )) s)"
grep '^{' "$OUT/generate-2x2.txt" | head -n 5
grep -hiE "error|panicked|nvshmem.*(fail|error)" "$OUT"/generate-2x2-node*.log | head -n 12
