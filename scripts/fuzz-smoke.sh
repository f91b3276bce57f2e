#!/usr/bin/env bash
# Runs every native fuzz target in the module for a short time each.
# Usage: scripts/fuzz-smoke.sh [duration]   (default 10s)
#
# A run fails when the fuzzer finds a failing input (it is written under the
# package's testdata/fuzz, commit it as a regression test). Go's fuzzer can also
# end a clean run with "context deadline exceeded" when -fuzztime expires while
# it is still minimising a new interesting input on a busy machine; no input is
# written then. Such a run is retried once and, if it happens again, reported
# as a warning rather than a failure.
set -euo pipefail
fuzztime="${1:-10s}"
cd "$(dirname "$0")/.."
found=0
failed=0
run_one() {
	local dir="$1" target="$2" out
	if out="$(go test -run '^$' -fuzz "^${target}\$" -fuzztime "$fuzztime" -fuzzminimizetime 10x "$dir" 2>&1)"; then
		printf '%s\n' "$out" | tail -n 2
		return 0
	fi
	if grep -q 'context deadline exceeded' <<<"$out" && ! grep -q 'Failing input written' <<<"$out"; then
		return 2
	fi
	printf '%s\n' "$out"
	return 1
}
while IFS= read -r file; do
	dir="./$(dirname "$file")"
	for target in $(grep -hoE '^func (Fuzz[A-Za-z0-9_]+)' "$file" | awk '{print $2}'); do
		found=$((found + 1))
		echo "== fuzz $dir $target ($fuzztime)"
		rc=0
		run_one "$dir" "$target" || rc=$?
		if [ "$rc" -eq 2 ]; then
			echo "-- $target: fuzzer deadline while minimising; retrying once"
			rc=0
			run_one "$dir" "$target" || rc=$?
			if [ "$rc" -eq 2 ]; then
				echo "WARNING: $target ended on the fuzzer's own deadline twice (no failing input)"
				rc=0
			fi
		fi
		if [ "$rc" -ne 0 ]; then
			failed=$((failed + 1))
		fi
	done
done < <(grep -rlE '^func Fuzz' --include='*_test.go' . | sort)
echo "fuzz-smoke: $((found - failed)) passed, $failed failed"
[ "$failed" -eq 0 ]
