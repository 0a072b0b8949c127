#!/usr/bin/env bash
# bench-dedup.sh -- deduplicated checkpoints (format 4, issue 22) against
# today's full checkpoint, in one run: per round a fresh target, then
#   full    checkpoint --leave-running into its own archive (no --dedup)
#   first   checkpoint --dedup --leave-running into a location (empty)
#   same    the same again, nothing changed
#   tenth   after the target rewrote a tenth of its memory (SIGUSR2)
# then restores the process from full and from first (the same memory) in
# turn, each proved by the target's memory checksum,
# into a directory (BENCH_DIR, tmpfs by default) and into MinIO on loopback
# (scripts/minio.sh, its data in BENCH_S3_DATA, default /var/tmp: a disk;
# BENCH_DEDUP_S3=0 skips). Times are the checkpoint command's wall time;
# "new" is what each checkpoint added to its location (ls --json new_bytes).
# Printed as medians and ratios. Tunables as scripts/bench.sh: BENCH_MB,
# BENCH_MIX, BENCH_ROUNDS, CRIU, GCS, MINIO; BENCH_TARGET (a prebuilt
# e2e/target); BENCH_CODEC (every checkpoint's --codec; the tool's default,
# lz4, if unset).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/target-proof.sh
if [ "$(id -u)" != 0 ]; then
	echo "bench-dedup: run as root (CRIU needs it)" >&2
	exit 1
fi
have() { command -v "$1" >/dev/null 2>&1; }
CRIU=${CRIU:-$(bash scripts/install-criu.sh)}
GCS=${GCS:-bin/gpucr-stream}
case $GCS in /*) ;; *) GCS=$PWD/$GCS ;; esac
MB=${BENCH_MB:-1024}
MIX=${BENCH_MIX:-model}
CODEC=(${BENCH_CODEC:+--codec "$BENCH_CODEC"})
ROUNDS=${BENCH_ROUNDS:-3}
SHM=${BENCH_DIR:-/dev/shm}
WORK=$(mktemp -d "$SHM/gcs-bench-dedup-XXXX")
MINIO_DIR=
TARGETS=$WORK/targets
: >"$TARGETS"
RESULTS=$WORK/results.tsv
: >"$RESULTS"
cleanup() {
	while read -r p; do kill -9 "$p" 2>/dev/null || true; done <"$TARGETS"
	[ -z "$MINIO_DIR" ] || bash scripts/minio.sh stop "$MINIO_DIR" 2>/dev/null || true
	rm -rf "$WORK"
}
trap cleanup EXIT
[ -x "$GCS" ] || CGO_ENABLED=0 go build -o "$GCS" ./cmd/gpucr-stream
# BENCH_TARGET: an e2e/target built elsewhere (a machine without Go).
TARGET_BIN=${BENCH_TARGET:-$WORK/target}
case $TARGET_BIN in /*) ;; *) TARGET_BIN=$PWD/$TARGET_BIN ;; esac # started from its run directory
[ -n "${BENCH_TARGET:-}" ] || CGO_ENABLED=0 go build -o "$TARGET_BIN" ./e2e/target

STORES="dir"
if [ "${BENCH_DEDUP_S3:-1}" = 1 ]; then
	for k in AWS_SESSION_TOKEN AWS_PROFILE AWS_DEFAULT_REGION AWS_ENDPOINT_URL_S3; do unset "$k"; done
	minio=$(MINIO_BINARY=${MINIO:-} TMPDIR=${BENCH_S3_DATA:-/var/tmp} bash scripts/minio.sh) # its exports
	eval "$minio"
	MINIO_DIR=$GPUCR_MINIO_DIR
	STORES="dir s3"
fi

now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$(now)" 'BEGIN {printf "%.4f", b - a}'; }
record() { printf '%s\t%s\t%s\n' "$1" "$2" "$3" >>"$RESULTS"; } # store metric value

start_target() { # -> PID, RUN
	RUN=$(mktemp -d "$WORK/run-XXXX")
	(cd "$RUN" && exec setsid -f "$TARGET_BIN" --dir "$RUN" --mb "$MB" --mix "$MIX" </dev/null >"$RUN/out.log" 2>&1)
	for _ in $(seq 1200); do [ -s "$RUN/ready" ] && break; sleep 0.05; done
	PID=$(cat "$RUN/ready")
	echo "$PID" >>"$TARGETS"
	cat /proc/"$PID"/task/*/children | tr ' ' '\n' | grep . >>"$TARGETS" || true
}
rewrite() {
	rm -f "$RUN/rewritten"
	kill -USR2 "$PID"
	for _ in $(seq 1200); do [ -s "$RUN/rewritten" ] && break; sleep 0.05; done
	[ -s "$RUN/rewritten" ] || { echo "bench-dedup: the target did not rewrite its memory" >&2; exit 1; }
}
ck() { # store metric DEST [--dedup]
	local t0
	t0=$(now)
	"$GCS" checkpoint --criu "$CRIU" --leave-running --create-bucket --pid "$PID" --to "$3" "${CODEC[@]}" "${@:4}" >"$WORK/ck.out" 2>&1 ||
		{ cat "$WORK/ck.out" >&2; exit 1; }
	record "$1" "$2" "$(elapsed "$t0")"
}
gone() { while [ -e "/proc/$1" ]; do sleep 0.02; done; }
restore_from() { # store metric SRC: kills the target, restores it from SRC, proves and kills it
	local t0 kids
	kids=$(cat /proc/"$PID"/task/*/children 2>/dev/null || true)
	kill -9 $kids "$PID" 2>/dev/null || true
	gone "$PID"
	for k in $kids; do gone "$k"; done
	t0=$(now)
	"$GCS" restore --criu "$CRIU" --from "$3" >"$WORK/rs.out" 2>&1 || { cat "$WORK/rs.out" >&2; exit 1; }
	record "$1" "$2" "$(elapsed "$t0")"
	memory_proven "$PID" "$RUN" || { echo "bench-dedup: the target restored from $3 is wrong ($RUN)" >&2; exit 1; }
}
new_bytes() { # LOCATION NAME -> new_bytes of that checkpoint
	"$GCS" ls --json "$1" | awk -v n="\"$2\"," '$1 == "\"name\":" {cur = $2} cur == n && $1 == "\"new_bytes\":" {gsub(",", "", $2); print $2}'
}

echo "bench-dedup: target ${MB} MiB ($MIX), ${ROUNDS} rounds, stores: $STORES, codec ${BENCH_CODEC:-default}; $(nproc) cores; $(date -u +%FT%TZ)" >&2
for r in $(seq "$ROUNDS"); do
	for s in $STORES; do
		echo "bench-dedup: round $r $s" >&2
		start_target
		if [ "$s" = dir ]; then loc=$WORK/loc-$r full=$WORK/full-$r; else loc=s3://bench/loc-$r full=s3://bench/full-$r; fi
		ck "$s" full "$full/ck"
		record "$s" full_bytes "$("$GCS" ls --json "$full" | awk '$1 == "\"new_bytes\":" {gsub(",", "", $2); print $2; exit}')"
		ck "$s" first "$loc/first" --dedup
		ck "$s" same "$loc/same" --dedup
		rewrite
		ck "$s" tenth "$loc/tenth" --dedup
		for n in first same tenth; do record "$s" "${n}_new" "$(new_bytes "$loc" "$n")"; done
		restore_from "$s" restore_full "$full/ck"
		restore_from "$s" restore_first "$loc/first"
		kill -9 $(cat /proc/"$PID"/task/*/children 2>/dev/null) "$PID" 2>/dev/null || true
		[ "$s" = dir ] && rm -rf "$loc" "$full"
	done
done

median() { sort -g | awk '{a[NR]=$1} END {if (NR==0) print ""; else if (NR%2) print a[(NR+1)/2]; else print (a[NR/2]+a[NR/2+1])/2}'; }
get() { awk -F'\t' -v s="$1" -v m="$2" '$1==s && $2==m {print $3}' "$RESULTS" | median; }
div() { awk -v a="$1" -v b="$2" -v f="$3" 'BEGIN {if (a == "" || b == "" || b == 0) print "-"; else printf f, a / b}'; }
pct() { awk -v a="$1" -v b="$2" 'BEGIN {if (a == "" || b == "" || b == 0) print "-"; else printf "%.2f%%", 100 * a / b}'; }
echo
printf '%-5s %9s %9s %9s %9s  %9s %9s  %10s %10s %10s\n' store full_s first_s same_s tenth_s first/full same/first new_first new_same new_tenth
for s in $STORES; do
	f=$(get "$s" full) a=$(get "$s" first) b=$(get "$s" same) c=$(get "$s" tenth)
	n1=$(get "$s" first_new) n2=$(get "$s" same_new) n3=$(get "$s" tenth_new)
	printf '%-5s %9.3f %9.3f %9.3f %9.3f  %9s %9s  %10s %10s %10s\n' "$s" "$f" "$a" "$b" "$c" \
		"$(div "$a" "$f" %.2fx)" "$(div "$b" "$a" %.2fx)" "$n1" "$(pct "$n2" "$n1")" "$(pct "$n3" "$n1")"
	echo "  tenth/first time $(div "$c" "$a" %.2fx); full checkpoint's bytes $(get "$s" full_bytes), first dedup's $n1"
	echo "  restore: from full $(get "$s" restore_full) s, from first (dedup) $(get "$s" restore_first) s: $(div "$(get "$s" restore_first)" "$(get "$s" restore_full)" %.2fx)"
done
