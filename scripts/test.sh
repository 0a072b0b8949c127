#!/usr/bin/env bash
# test.sh [STAGE...] -- `make test`: every stage (deps, lint, unit, fuzz,
# e2e; or those named), each run to its end whatever the others did, then
# a summary of what failed, with its failed tests, and how long each
# stage took. Exits 1 if any stage failed. $MAKE runs a stage (make
# passes its own).
set -uo pipefail
cd "$(dirname "$0")/.."
stages=("$@")
[ ${#stages[@]} -gt 0 ] || stages=(deps lint unit fuzz e2e)
make=${MAKE:-make}
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
fmt_time() { printf '%dm%02ds' $(($1 / 60)) $(($1 % 60)); }

begin=$(date +%s)
results=()
failed=()
for s in "${stages[@]}"; do
	printf '\n== make %s\n' "$s"
	start=$(date +%s)
	"$make" --no-print-directory "$s" 2>&1 | tee "$logs/$s"
	rc=${PIPESTATUS[0]}
	took=$(fmt_time $(($(date +%s) - start)))
	if [ "$rc" = 0 ]; then
		results+=("  ok      $s ($took)")
	else
		results+=("  FAILED  $s ($took, exit $rc)")
		failed+=("$s")
	fi
done

printf '\n== make test: %s in %s\n' "${stages[*]}" "$(fmt_time $(($(date +%s) - begin)))"
printf '%s\n' "${results[@]}"
for s in "${failed[@]}"; do
	# Go's failed tests and packages where there are any, else the end
	# of what the stage printed.
	lines=$(grep -E -e '--- FAIL|^FAIL' "$logs/$s" | sort -u)
	[ -n "$lines" ] || lines=$(tail -15 "$logs/$s")
	printf '\n== %s failed:\n%s\n' "$s" "$lines"
done
[ ${#failed[@]} = 0 ]
