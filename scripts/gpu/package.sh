#!/usr/bin/env bash
# Build, here (no GPU needed), every GPU test and benchmark binary of the workspace in release
# mode, strip them and put them in .gpu/bin/ (ignored by git) for the GPU machine, where
# scripts/gpu/run-all.sh runs them.
#
# What is packaged (found with `cargo metadata`, in every workspace package):
#   * [[test]] targets named gpu_*      -> .gpu/bin/<name>
#   * bin / example / bench targets named bench* -> .gpu/bin/<name>
# each built with its `required-features` (e.g. `cuda`). Executables are located through
# cargo's `--message-format=json` artifacts.
#
# Usage: scripts/gpu/package.sh [package...]   (default: every workspace package)
# Env:   EP_GPU_TEST_PATTERN (regex, default ^gpu_), EP_GPU_BENCH_PATTERN (default ^bench),
#        EP_GPU_FEATURES (features added to every build, e.g. `ep-kernels/nvshmem`)
set -euo pipefail

log() { printf '[gpu-package] %s\n' "$*" >&2; }
die() {
    log "error: $*"
    exit 1
}

REPO_ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
cd "$REPO_ROOT"
command -v python3 >/dev/null || die "python3 is needed to read cargo's JSON output"
eval "$(scripts/cuda-toolchain.sh)"

DEST="$REPO_ROOT/.gpu/bin"
TMP="$(mktemp -d)"
trap 'rm -rf "$TMP"' EXIT

# One line per build: "<package> <cargo target flag> <target name> <features,comma,separated>".
cargo metadata --format-version 1 --no-deps >"$TMP/metadata.json"
python3 - "$TMP/metadata.json" "$@" >"$TMP/plan.txt" <<'PY'
import json, os, re, sys
meta = json.load(open(sys.argv[1]))
wanted = set(sys.argv[2:])
test_re = re.compile(os.environ.get("EP_GPU_TEST_PATTERN", r"^gpu_"))
bench_re = re.compile(os.environ.get("EP_GPU_BENCH_PATTERN", r"^bench"))
members = set(meta["workspace_members"])
flag = {"test": "--test", "bin": "--bin", "example": "--example", "bench": "--bench"}
for pkg in meta["packages"]:
    if pkg["id"] not in members or (wanted and pkg["name"] not in wanted):
        continue
    for t in pkg["targets"]:
        kinds = set(t["kind"])
        if "test" in kinds and test_re.search(t["name"]):
            kind = "test"
        elif kinds & {"bin", "example", "bench"} and bench_re.search(t["name"]):
            kind = sorted(kinds & {"bin", "example", "bench"})[0]
        else:
            continue
        feats = ",".join(t.get("required-features") or []) or "-"
        print(pkg["name"], flag[kind], t["name"], feats)
PY
[[ -s "$TMP/plan.txt" ]] || die "no gpu_* test or bench* target found in the workspace"

rm -rf "$DEST"
mkdir -p "$DEST"
while read -r pkg flag name feats; do
    features=()
    [[ "$feats" != "-" ]] && features=(--features "$feats")
    if [[ -n "${EP_GPU_FEATURES:-}" ]]; then
        [[ "$feats" != "-" ]] && features=(--features "$feats,$EP_GPU_FEATURES") ||
            features=(--features "$EP_GPU_FEATURES")
    fi
    if [[ "$flag" == "--test" ]]; then
        cmd=(cargo test --release --no-run -p "$pkg" "${features[@]}" "$flag" "$name")
    else
        cmd=(cargo build --release -p "$pkg" "${features[@]}" "$flag" "$name")
    fi
    log "${cmd[*]}"
    "${cmd[@]}" --message-format=json-render-diagnostics >"$TMP/build.json"
    exe="$(python3 - "$TMP/build.json" "$name" <<'PY'
import json, sys
name = sys.argv[2]
found = None
for line in open(sys.argv[1]):
    try:
        msg = json.loads(line)
    except ValueError:
        continue
    if msg.get("reason") == "compiler-artifact" and msg["target"]["name"] == name and msg.get("executable"):
        found = msg["executable"]
print(found or "")
PY
)"
    [[ -n "$exe" && -x "$exe" ]] || die "cargo produced no executable for $pkg $flag $name"
    cp "$exe" "$DEST/$name"
    strip --strip-unneeded "$DEST/$name"
    log "packaged $name ($(du -h "$DEST/$name" | cut -f1))"
done <"$TMP/plan.txt"

cp scripts/gpu/run-all.sh "$DEST/../run-all.sh"
total_kib="$(du -sk "$DEST" | cut -f1)"
if ((total_kib > 64 * 1024)); then
    log "warning: .gpu/bin is ${total_kib} KiB, over the 64 MiB that can travel to the GPU machine"
fi
log "done: $(ls "$DEST" | wc -l) binaries, ${total_kib} KiB in $DEST"
log "on the GPU machine: bash scripts/gpu/run-all.sh   (logs into \$OUT)"
