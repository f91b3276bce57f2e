#!/usr/bin/env bash
# Runs every native fuzz target in the module for a short time each.
# Usage: scripts/fuzz-smoke.sh [duration]   (default 10s)
set -euo pipefail
fuzztime="${1:-10s}"
cd "$(dirname "$0")/.."
found=0
while IFS= read -r file; do
	dir="./$(dirname "$file")"
	for target in $(grep -hoE '^func (Fuzz[A-Za-z0-9_]+)' "$file" | awk '{print $2}'); do
		found=$((found + 1))
		echo "== fuzz $dir $target ($fuzztime)"
		go test -run '^$' -fuzz "^${target}\$" -fuzztime "$fuzztime" "$dir"
	done
done < <(grep -rlE '^func Fuzz' --include='*_test.go' . | sort)
echo "fuzz-smoke: ran $found targets"
