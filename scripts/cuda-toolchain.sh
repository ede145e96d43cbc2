#!/usr/bin/env bash
# Install a CUDA 13.0 toolchain from PyPI wheels (no GPU, no system CUDA needed) and print the
# environment that makes nvcc, cudarc and candle-kernels use it.
#
#   eval "$(scripts/cuda-toolchain.sh)"
#
# The toolchain goes to $EP_CUDA_DIR (default: <repo>/.cuda, ignored by git):
#   .cuda/venv/            python venv holding the pinned nvidia-* wheels
#   .cuda/root/            a CUDA_ROOT laid out like /usr/local/cuda:
#       bin/               real folder, one symlink per wheel binary (nvcc resolves ../lib64)
#       include/           real folder, one symlink per wheel header entry, plus NCCL/NVSHMEM
#       nvvm -> wheel      libdevice, cicc
#       lib64/             one symlink per shared library + unversioned names
#       lib64/stubs/       link-only libcuda.so (SONAME libcuda.so.1); never shipped
#       lib -> lib64
#       cutlass -> wheel   CUTLASS 3 headers (nvidia-cutlass), for the grouped GEMMs
# Versions are pinned to the GPU machine's CUDA 13.0.2 (cubins must match its driver stack).
# Idempotent: a second run only checks a stamp and prints the environment.
# All logs go to stderr; stdout carries only `export` lines.
set -euo pipefail

log() { printf '[cuda-toolchain] %s\n' "$*" >&2; }
die() {
    log "error: $*"
    exit 1
}

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
CUDA_DIR="${EP_CUDA_DIR:-$REPO_ROOT/.cuda}"
VENV="$CUDA_DIR/venv"
ROOT="$CUDA_DIR/root"

PINS=(
    nvidia-cuda-nvcc==13.0.88
    nvidia-cuda-crt==13.0.88
    nvidia-nvvm==13.0.88
    nvidia-cuda-runtime==13.0.96
    nvidia-cuda-cccl==13.0.85
    nvidia-cuda-nvrtc==13.0.88
    nvidia-cublas==13.0.2.14
    nvidia-curand==10.4.0.35
    nvidia-nccl-cu13==2.28.3
    nvidia-nvshmem-cu13==3.4.5
    nvidia-cutlass==4.2.0.0
)
# Bump when the layout below changes so existing installs are rebuilt.
LAYOUT_VERSION=4
STAMP="$ROOT/.ep-toolchain-stamp"
STAMP_TEXT="layout=$LAYOUT_VERSION pins=${PINS[*]}"

print_env() {
    local path_prefix="$ROOT/bin"
    case ":${PATH:-}:" in
    *":$path_prefix:"*) path_prefix="" ;;
    esac
    local library_path="$ROOT/lib64/stubs:$ROOT/lib64"
    case ":${LIBRARY_PATH:-}:" in
    *":$ROOT/lib64/stubs:"*) library_path="" ;;
    esac
    echo "export CUDA_ROOT='$ROOT'"
    echo "export CUDA_HOME='$ROOT'"
    if [[ -n "$path_prefix" ]]; then
        echo "export PATH='$path_prefix':\"\$PATH\""
    fi
    echo "export CUDA_COMPUTE_CAP=90"
    echo "export CUDARC_CUDA_VERSION=13000"
    if [[ -n "$library_path" ]]; then
        echo "export LIBRARY_PATH='$library_path'\${LIBRARY_PATH:+:\$LIBRARY_PATH}"
    fi
    echo "export NVSHMEM_HOME='$ROOT/nvshmem'"
}

if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$STAMP_TEXT" && -x "$ROOT/bin/nvcc" ]]; then
    log "toolchain already installed at $ROOT"
    print_env
    exit 0
fi

command -v python3 >/dev/null || die "python3 not found on PATH (needed to install the nvidia-* wheels)"
command -v gcc >/dev/null || die "gcc not found on PATH (needed to build the libcuda link stub)"

mkdir -p "$CUDA_DIR"
if [[ ! -x "$VENV/bin/python" ]]; then
    log "creating venv $VENV"
    python3 -m venv "$VENV" >&2
fi
log "installing ${PINS[*]}"
"$VENV/bin/python" -m pip install --quiet --disable-pip-version-check "${PINS[@]}" >&2

SITE="$("$VENV/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')"
CU="$SITE/nvidia/cu13"
NCCL="$SITE/nvidia/nccl"
NVSHMEM="$SITE/nvidia/nvshmem"
[[ -x "$CU/bin/nvcc" ]] || die "nvcc not found at $CU/bin/nvcc after installing the wheels"
[[ -d "$NCCL/include" ]] || die "NCCL headers not found at $NCCL/include"

log "laying out CUDA_ROOT at $ROOT"
rm -rf "$ROOT"
mkdir -p "$ROOT/bin" "$ROOT/include" "$ROOT/lib64/stubs"

# bin/: a real folder so that nvcc's `$_HERE_/..` is $ROOT (which has lib64), not the wheel.
for f in "$CU"/bin/*; do
    ln -s "$f" "$ROOT/bin/$(basename "$f")"
done
ln -s "$CU/nvvm" "$ROOT/nvvm"

# include/: every wheel header entry, plus NCCL's headers (cudarc's build looks for nccl.h
# under $CUDA_HOME/include).
for f in "$CU"/include/* "$NCCL"/include/*; do
    name="$(basename "$f")"
    [[ -e "$ROOT/include/$name" ]] || ln -s "$f" "$ROOT/include/$name"
done

# lib64/: per-library symlinks and the unversioned names the linker wants.
for dir in "$CU/lib" "$NCCL/lib"; do
    for f in "$dir"/*; do
        name="$(basename "$f")"
        [[ -e "$ROOT/lib64/$name" ]] || ln -s "$f" "$ROOT/lib64/$name"
    done
done
for f in "$ROOT"/lib64/lib*.so.*; do
    [[ -e "$f" ]] || continue
    name="$(basename "$f")"
    base="${name%%.so.*}.so"
    [[ -e "$ROOT/lib64/$base" ]] || ln -s "$name" "$ROOT/lib64/$base"
done
ln -s lib64 "$ROOT/lib"

# NVSHMEM keeps its own prefix (include/, lib/ with host .so, device .a/.bc).
ln -s "$NVSHMEM" "$ROOT/nvshmem"

# CUTLASS 3 / CuTe headers (include/, tools/util/include/) from the nvidia-cutlass wheel, for
# ep-kernels' grouped GEMMs (its build.rs looks for $CUDA_ROOT/cutlass).
CUTLASS="$SITE/cutlass_library/source"
[[ -f "$CUTLASS/include/cutlass/cutlass.h" ]] || die "CUTLASS headers not found at $CUTLASS/include"
ln -s "$CUTLASS" "$ROOT/cutlass"

# The link-only libcuda stub: no wheel ships the driver library. Export every `cu*` function
# that cuda.h declares (default, per-thread-stream variants, and the `#define cuX cuX_v2`
# aliases), each trapping if ever called. The real libcuda.so.1 is found at run time.
log "generating link-only lib64/stubs/libcuda.so"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT
printf '#include <cuda.h>\n' >"$TMP/probe.c"
names_from_aux_info() {
    # -aux-info writes one prototype per declared function (after macro expansion).
    gcc -fsyntax-only -I"$ROOT/include" "$@" -aux-info "$TMP/aux.txt" "$TMP/probe.c" >&2
    grep -oE '\b(cu[A-Za-z0-9_]+) \(' "$TMP/aux.txt" | sed 's/ ($//'
}
{
    names_from_aux_info
    names_from_aux_info -DCUDA_API_PER_THREAD_DEFAULT_STREAM
    # Both sides of the version aliases (`#define cuMemAlloc cuMemAlloc_v2`, `..._ptsz`).
    grep -hoE '^[[:space:]]*#[[:space:]]*define[[:space:]]+cu[A-Za-z0-9_]+[[:space:]]+__CUDA_API_[A-Z_]+\(cu[A-Za-z0-9_]+\)' \
        "$ROOT/include/cuda.h" | sed -E 's/.*define[[:space:]]+(cu[A-Za-z0-9_]+).*\((cu[A-Za-z0-9_]+)\)/\1\n\2/'
    grep -hoE '^[[:space:]]*#[[:space:]]*define[[:space:]]+cu[A-Za-z0-9_]+[[:space:]]+cu[A-Za-z0-9_]+[[:space:]]*$' \
        "$ROOT/include/cuda.h" | awk '{print $(NF-1); print $NF}'
} | grep -E '^cu[A-Za-z0-9_]+$' | sort -u >"$TMP/names.txt"
# Per-thread variants built from the macros: every API with a _ptsz/_ptds form.
sed -nE 's/.*__CUDA_API_PTSZ\((cu[A-Za-z0-9_]+)\).*/\1_ptsz/p; s/.*__CUDA_API_PTDS\((cu[A-Za-z0-9_]+)\).*/\1_ptds/p' \
    "$ROOT/include/cuda.h" >>"$TMP/names.txt"
sort -u -o "$TMP/names.txt" "$TMP/names.txt"
count="$(wc -l <"$TMP/names.txt")"
[[ "$count" -gt 400 ]] || die "only $count cu* names found in cuda.h; the stub would be incomplete"
awk '{ printf "void %s(void) { __builtin_trap(); }\n", $1 }' "$TMP/names.txt" >"$TMP/stub.c"
gcc -shared -fPIC -O1 -Wl,-soname,libcuda.so.1 -o "$ROOT/lib64/stubs/libcuda.so" "$TMP/stub.c" >&2
log "libcuda stub exports $count symbols"

"$ROOT/bin/nvcc" --version >&2 || die "nvcc at $ROOT/bin/nvcc does not run"
echo "$STAMP_TEXT" >"$STAMP"
log "done"
print_env
