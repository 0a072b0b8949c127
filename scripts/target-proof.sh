# target-proof.sh -- sourced by the benchmarks that restore the e2e target
# (bench.sh, bench-s3.sh, bench-dedup.sh). memory_proven PID DIR asks the
# target for a proof (SIGUSR1; it writes DIR/proof.json) and succeeds when
# the memory checksum it computed is the one it expects.
memory_proven() {
	rm -f "$2/proof.json"
	kill -USR1 "$1"
	for _ in $(seq 200); do [ -s "$2/proof.json" ] && break; sleep 0.05; done
	local a e
	a=$(sed -n 's/.*"checksum_actual": *"\([0-9a-f]*\)".*/\1/p' "$2/proof.json")
	e=$(sed -n 's/.*"checksum_expected": *"\([0-9a-f]*\)".*/\1/p' "$2/proof.json")
	[ -n "$a" ] && [ "$a" = "$e" ]
}
