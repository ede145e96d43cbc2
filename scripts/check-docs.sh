#!/usr/bin/env bash
# Checks that the docs stay one current house, not a diary of the work that produced them:
#   - docs/benchmarks.md holds at most 400 lines (one current table per benchmark);
#   - docs/bench-results/ holds at most 60 files (the JSON behind those tables; raw device
#     outputs, logs and run scripts belong outside the repository, and history is git's);
#   - no markdown heading in docs/*.md, README.md or examples/*/README.md is numbered or named
#     by the sitting that produced it ("session", "sitting", "fifth session", "call 3", ...);
#   - docs/benchmarks.md never mentions a session or a device call number ("call 7", "calls 2-4").
# Prints one line per problem on stderr and exits 1, or prints "check-docs: ok".
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."

max_bench_lines=400
max_result_files=60
fail=0
problem() {
    echo "check-docs: $*" >&2
    fail=1
}

lines=$(wc -l <docs/benchmarks.md)
if [ "$lines" -gt "$max_bench_lines" ]; then
    problem "docs/benchmarks.md has $lines lines (at most $max_bench_lines)"
fi

files=$(find docs/bench-results -type f | wc -l)
if [ "$files" -gt "$max_result_files" ]; then
    problem "docs/bench-results/ holds $files files (at most $max_result_files; raw outputs belong outside the repository)"
fi

# Words that name a sitting: "session", "sitting", "first session".."twentieth session",
# "call 3", "calls 2-4", "call12".
ordinals='first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|fourteenth|fifteenth|sixteenth|seventeenth|eighteenth|nineteenth|twentieth'
sitting="sessions?|sittings?|($ordinals)[- ]session|\bcalls? ?[0-9]"
call_number='\bcalls? ?[0-9]'

docs=(docs/*.md README.md)
for readme in examples/*/README.md; do
    [ -e "$readme" ] && docs+=("$readme")
done
for doc in "${docs[@]}"; do
    while IFS= read -r hit; do
        problem "$doc:${hit%%:*}: heading named by a sitting: ${hit#*:}"
    done < <(grep -niE '^#' "$doc" | grep -iE "^[0-9]+:#.*($sitting)" || true)
done

while IFS= read -r hit; do
    problem "docs/benchmarks.md:${hit%%:*}: mentions a session: ${hit#*:}"
done < <(grep -niE 'session' docs/benchmarks.md || true)
while IFS= read -r hit; do
    problem "docs/benchmarks.md:${hit%%:*}: device call number: ${hit#*:}"
done < <(grep -niE "$call_number" docs/benchmarks.md || true)

if [ "$fail" -ne 0 ]; then
    exit 1
fi
echo "check-docs: ok"
