#!/usr/bin/env bash
# On a 4-GPU machine: the DeepSeek-V3-style example as 2 nodes x 2 GPUs on one host, built with
# `--features nvshmem` (the EP buffer's low-latency ops over NVSHMEM, prefill through the
# internode normal mode), beside the same command as one node of 4 GPUs; on a 2-GPU machine,
# 2 nodes x 1 beside one node of 2. Two launchers stand for the two nodes; node 1 sees the GPUs
# permuted (CUDA_VISIBLE_DEVICES=2,3,0,1, or 1,0) so that its ranks take the upper GPUs while
# NVSHMEM's P2P transport still sees every GPU (NVLink standing in for the network:
# NVSHMEM_REMOTE_TRANSPORT=none). Prints each run's generations (rank 0's JSON).
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

# The generations of a run's JSON lines (rank 0's, "[rank 0] {...}"), without the timings.
gens() {
    grep -o '"index":[0-9]*,"prompt":"[^"]*","prompt_tokens":[0-9]*,"text":"[^"]*","tokens":\[[0-9,]*\]' "$1"
}

GPUS=$(nvidia-smi -L | wc -l)
if (( GPUS >= 4 )); then
    G=4 P=2 ORDER0=0,1,2,3 ORDER1=2,3,0,1
else
    G=2 P=1 ORDER0=0,1 ORDER1=1,0
fi

s=$(date +%s)
timeout 240 "$X" launch --nproc-per-node "$G" --master-port 29600 -- "${gen[@]}" \
    >"$OUT/generate-1x$G.txt" 2>"$OUT/generate-1x$G.log"
echo "one node x $G: rc=$? ($(( $(date +%s) - s )) s)"
gens "$OUT/generate-1x$G.txt" | head -n 5

s=$(date +%s)
CUDA_VISIBLE_DEVICES=$ORDER0 timeout 300 "$X" launch --nnodes 2 --node-rank 0 --nproc-per-node "$P" \
    --master-port 29650 -- "${gen[@]}" >"$OUT/generate-2x$P.txt" 2>"$OUT/generate-2x$P-node0.log" &
CUDA_VISIBLE_DEVICES=$ORDER1 timeout 300 "$X" launch --nnodes 2 --node-rank 1 --nproc-per-node "$P" \
    --master-port 29650 -- "${gen[@]}" >"$OUT/generate-2x$P-node1.txt" 2>"$OUT/generate-2x$P-node1.log"
rc1=$?
wait %1
rc0=$?
echo "two nodes x $P: rc node0=$rc0 node1=$rc1 ($(( $(date +%s) - s )) s)"
gens "$OUT/generate-2x$P.txt" | head -n 5
n=$(gens "$OUT/generate-1x$G.txt" | wc -l)
if (( n == 0 )); then
    echo "NO generations from one node of $G"
elif diff <(gens "$OUT/generate-1x$G.txt") <(gens "$OUT/generate-2x$P.txt") >/dev/null; then
    echo "same generations ($n prompts) on one node of $G and on 2 nodes of $P"
else
    echo "DIFFERENT generations on one node of $G and on 2 nodes of $P"
fi
grep -hiE "error|panicked|nvshmem.*(fail|error)" "$OUT"/generate-2x$P-node*.log | head -n 12
grep -h "internode buffer ready\|CUDA buffer ready" "$OUT"/generate-2x$P-node*.log | head -n 4
