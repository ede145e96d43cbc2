#!/usr/bin/env bash
# CI step: install the pinned CUDA 13.0 toolchain from PyPI (no GPU needed) and type-check the
# CUDA build (nvcc compiles every kernel to sm_90a cubins in ep-kernels' build.rs; everything
# links against the generated libcuda stub). Called by .ci/run.
#
# Only ep-kernels has a `cuda` feature so far; once every member has one, switch to
#   cargo check --workspace --all-targets --features cuda
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
eval "$(scripts/cuda-toolchain.sh)"
nvcc --version | tail -n 2
cargo check -p ep-kernels --all-targets --features cuda
cargo clippy -p ep-kernels --all-targets --features cuda -- -D warnings
