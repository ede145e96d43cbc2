#!/usr/bin/env bash
# CI step: install the pinned CUDA 13.0 toolchain from PyPI (no GPU needed) and type-check the
# whole workspace with its GPU features (nvcc compiles every kernel to sm_90a cubins in
# ep-kernels' build.rs and candle's kernels in candle-kernels'; everything links against the
# generated libcuda stub), plus clippy on the GPU crates. Called by .ci/run.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
eval "$(scripts/cuda-toolchain.sh)"
nvcc --version | tail -n 2
features="ep-kernels/nccl,ep-runtime/cuda,moe-layer/cuda,deepseek-v3/cuda,ep-moe-tests/cuda,nvshmem-sys/cuda"
cargo check --workspace --all-targets --features "$features"
cargo clippy -p ep-kernels -p ep-runtime -p moe-layer -p nvshmem-sys --all-targets --features "ep-kernels/nccl,ep-runtime/cuda,moe-layer/cuda,nvshmem-sys/cuda" -- -D warnings
# NVSHMEM through the bootstrap store and CUDA buffers across nodes (ep-runtime's `nvshmem`
# feature, a superset of `cuda`), apart so that the lines above still check `cuda` without it.
cargo clippy -p ep-runtime --all-targets --features nvshmem -- -D warnings
# The low-latency kernels across nodes (ep-kernels' `nvshmem` feature: the *_nvshmem cubins,
# device-linked with NVSHMEM, and the NVSHMEM process modes of gpu_low_latency and
# bench_low_latency).
cargo clippy -p ep-kernels --all-targets --features nccl,nvshmem -- -D warnings
bash scripts/gpu/probe/build.sh
