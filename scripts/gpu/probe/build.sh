#!/usr/bin/env bash
# Builds the probes (nvlink_probe.cu, lazy_load_probe.cu: plain CUDA C++, no Rust) here with the project's
# CUDA toolchain into .gpu/probe/, which travels to the GPU machine (carry `.gpu/probe`).
# There: `.gpu/probe/nvlink_probe --mib 64` (all visible GPUs; CUDA_VISIBLE_DEVICES=0,1 for 2).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../../.."
eval "$(scripts/cuda-toolchain.sh)"
mkdir -p .gpu/probe
nvcc -O3 -std=c++17 --expt-relaxed-constexpr -gencode=arch=compute_90a,code=sm_90a \
    -o .gpu/probe/nvlink_probe scripts/gpu/probe/nvlink_probe.cu
echo "built .gpu/probe/nvlink_probe"
nvcc -O2 -std=c++17 -gencode=arch=compute_90a,code=sm_90a \
    -o .gpu/probe/lazy_load_probe scripts/gpu/probe/lazy_load_probe.cu
echo "built .gpu/probe/lazy_load_probe"
