#!/usr/bin/env bash
# bench-files.sh -- what handing CRIU an image as a file (a sealed memfd put
# in place of its pipe, criusock/asfile.go) costs against the pipe, measured
# two ways:
#
#   per file   BenchmarkServeFileKind: a CRIU-like client in a process of its
#              own asks for one image over and over, as a pipe or as a
#              memfd, by size (ns per file, connection to last byte)
#   criu       `criu restore --stream` of one target from one captured
#              stream, through serve with every image a pipe (small files as
#              shipped) and with every image under BENCH_FILES_SMALL bytes
#              (default 65536) a memfd (a build with -tags gpucr_bench,
#              GPUCR_BENCH_SMALL_FILES), interleaved round by round; the
#              restored target proves its memory each time
#
# Run as root, with Go (`make bench` runs it; BENCH_FILES=0 skips it there).
# Tunables: BENCH_MB (target size, default 64), BENCH_ROUNDS (default 5),
# BENCH_FILES_SMALL, BENCH_FILES_N (the per-file benchmark's requests per
# size and kind, default 300).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/target-proof.sh
if [ "$(id -u)" != 0 ]; then
	echo "bench-files: run as root (CRIU needs it, and the memfd path traces CRIU)" >&2
	exit 1
fi
CRIU=${CRIU:-$(bash scripts/install-criu.sh)}
MB=${BENCH_MB:-64}
ROUNDS=${BENCH_ROUNDS:-5}
SMALL=${BENCH_FILES_SMALL:-65536}
WORK=$(mktemp -d "${BENCH_DIR:-/dev/shm}/gcs-bench-files-XXXX")
PIDS=$WORK/pids
: >"$PIDS"
cleanup() {
	while read -r p; do kill -9 "$p" 2>/dev/null || true; done <"$PIDS"
	rm -rf "$WORK"
}
trap cleanup EXIT

echo "per file, a CRIU-like client (BenchmarkServeFileKind, ${BENCH_FILES_N:-300} requests each):"
go test -run '^$' -bench '^BenchmarkServeFileKind$' -benchtime "${BENCH_FILES_N:-300}x" ./criusock/ |
	awk '/^BenchmarkServeFileKind/ {name=$1; sub(/^BenchmarkServeFileKind\//, "", name); sub(/-[0-9]+$/, "", name);
		for (i=1;i<=NF;i++) if ($i=="ns/file") v=$(i-1)
		split(name, p, "/"); printf "  %-6s %-7s %9.1f us/file\n", p[1], p[2], v/1000 }'

GCS=$WORK/gpucr-stream-bench
CGO_ENABLED=0 go build -tags gpucr_bench -o "$GCS" ./cmd/gpucr-stream
TARGET=$WORK/e2e-target
CGO_ENABLED=0 go build -o "$TARGET" ./e2e/target

wait_socket() { for _ in $(seq 2000); do [ -S "$1" ] && return 0; sleep 0.005; done; echo "bench-files: no socket $1" >&2; exit 1; }
RUN=$WORK/run
mkdir -p "$RUN" "$WORK/dump"
(cd "$RUN" && exec setsid -f "$TARGET" --dir "$RUN" --mb "$MB" </dev/null >"$RUN/out.log" 2>&1)
for _ in $(seq 1200); do [ -s "$RUN/ready" ] && break; sleep 0.05; done
PID=$(cat "$RUN/ready")
CHILD=$(cat /proc/"$PID"/task/*/children | tr ' ' '\n' | grep -m1 .)
echo "$PID $CHILD" | tr ' ' '\n' >>"$PIDS"
gone() { while [ -e "/proc/$PID" ] || [ -e "/proc/$CHILD" ]; do sleep 0.02; done; }
"$GCS" --images-dir "$WORK/dump" capture >"$WORK/stream" 2>"$WORK/capture.err" &
cap=$!
wait_socket "$WORK/dump/streamer-capture.sock"
"$CRIU" dump --stream -D "$WORK/dump" -t "$PID" -o dump.log
wait $cap
gone

: >"$WORK/results"
for r in $(seq "$ROUNDS"); do
	for mode in pipe memfd; do
		d=$WORK/r$r-$mode
		mkdir -p "$d"
		n=0
		[ $mode = pipe ] || n=$SMALL
		GPUCR_BENCH_SMALL_FILES=$n "$GCS" --images-dir "$d" serve <"$WORK/stream" 2>"$d/serve.err" &
		srv=$!
		wait_socket "$d/streamer-serve.sock"
		t0=$(date +%s.%N)
		"$CRIU" restore --stream -D "$d" --restore-detached -o restore.log
		t1=$(date +%s.%N)
		wait $srv
		memory_proven "$PID" "$RUN" || { echo "bench-files: restored target's memory is wrong ($mode, round $r)" >&2; exit 1; }
		kill -9 "$PID" "$CHILD"
		gone
		printf '%s\t%s\t%s\n' "$mode" "$(awk -v a="$t0" -v b="$t1" 'BEGIN {print b - a}')" "$(grep -c 'served as a file' "$d/serve.err" || true)" >>"$WORK/results"
		rm -rf "$d"
	done
done
echo
files=$(sed -n 's/.*"files":\([0-9]*\).*/\1/p' "$WORK/capture.err" | tail -1)
echo "criu restore --stream of a ${MB} MiB target ($files images), median of $ROUNDS rounds:"
for mode in pipe memfd; do
	awk -F'\t' -v m=$mode '$1 == m {print $2, $3}' "$WORK/results" | sort -n |
		awk -v m=$mode -v small=$SMALL '{t[NR]=$1; f=$2} END {
			label = (m == "pipe") ? "every image a pipe" : "images < " small " B as memfds"
			printf "  %-32s %7.1f ms  (%d files as memfds)\n", label, t[int((NR+1)/2)]*1000, f }'
done
