#!/usr/bin/env bash
# Builds the CUPTI timeline injection library (ep_timeline.c) here, with CUPTI's headers and
# library from the pinned PyPI wheel, into .gpu/timeline/ (with libcupti.so.13 beside it, which
# the GPU machine's image may not have on its library path). Carry that folder; run there as
#
#   LD_LIBRARY_PATH=.gpu/timeline CUDA_INJECTION64_PATH=$PWD/.gpu/timeline/libep_timeline.so \
#   EP_TIMELINE_OUT=$OUT/tl <program>
#
# and turn the CSV into per-step tables with scripts/gpu/timeline/timeline.py.
set -euo pipefail
REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../../.." && pwd)"
WORK="${EP_CUPTI_DIR:-$REPO_ROOT/.cuda/cupti}"
OUT="$REPO_ROOT/.gpu/timeline"
if [[ ! -f "$WORK/nvidia/cu13/include/cupti.h" ]]; then
    mkdir -p "$WORK"
    python3 -m pip download --quiet --no-deps "nvidia-cuda-cupti==13.0.85" -d "$WORK" >&2
    (cd "$WORK" && python3 -m zipfile -e nvidia_cuda_cupti-13.0.85-*.whl .)
fi
CUDA_INC="${CUDA_ROOT:-$REPO_ROOT/.cuda/root}/include"
mkdir -p "$OUT"
cp "$WORK/nvidia/cu13/lib/libcupti.so.13" "$OUT/"
gcc -O2 -Wall -Wextra -fPIC -shared -o "$OUT/libep_timeline.so" \
    "$REPO_ROOT/scripts/gpu/timeline/ep_timeline.c" \
    -I"$WORK/nvidia/cu13/include" -I"$CUDA_INC" \
    -L"$OUT" -l:libcupti.so.13 -Wl,-rpath,'$ORIGIN'
echo "$OUT/libep_timeline.so" >&2
