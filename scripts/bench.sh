#!/usr/bin/env bash
# bench.sh -- checkpoint and restore timings of gpucr-stream against plain
# `criu dump -D` / `criu restore -D` on tmpfs and against the plain CLI tools,
# measured in one run: a fresh target process for every measurement, the
# variants interleaved round by round, medians and ratios printed at the end.
# Run as root (`make bench`). Tunables: BENCH_MB (target size, default 1024),
# BENCH_ROUNDS (default 3), BENCH_VARIANTS (space-separated subset).
set -euo pipefail
cd "$(dirname "$0")/.."
CRIU=${CRIU:-$(bash scripts/install-criu.sh)}
GCS=$PWD/${GCS:-bin/gpucr-stream}
MB=${BENCH_MB:-1024}
ROUNDS=${BENCH_ROUNDS:-3}
VARIANTS=${BENCH_VARIANTS:-"plain plain+lz4 gcs-none gcs-lz4 gcs-lz4+key gcs-zstd gcs-auto gcs-stdout|lz4"}
SHM=${BENCH_DIR:-/dev/shm}
WORK=$(mktemp -d "$SHM/gcs-bench-XXXX")
TARGET_BIN=$WORK/target
go build -o "$TARGET_BIN" ./e2e/target
[ -x "$GCS" ] || CGO_ENABLED=0 go build -o "$GCS" ./cmd/gpucr-stream
RESULTS=$WORK/results.tsv
KEY=$WORK/key # gcs-CODEC+key variants encrypt with it (AES-256-GCM)
(umask 077 && "$GCS" keygen >"$KEY")
: >"$RESULTS"
trap 'pkill -9 -f "$TARGET_BIN" 2>/dev/null || true; rm -rf "$WORK"' EXIT

now() { date +%s.%N; }
elapsed() { echo "$(now) - $1" | bc -l; }
record() { printf '%s\t%s\t%s\n' "$1" "$2" "$3" >>"$RESULTS"; } # variant metric value

start_target() { # -> PID, CHILD, RUN
	RUN=$(mktemp -d "$WORK/run-XXXX")
	(cd "$RUN" && setsid "$TARGET_BIN" --dir "$RUN" --mb "$MB" </dev/null >"$RUN/out.log" 2>&1 &)
	for _ in $(seq 1200); do [ -s "$RUN/ready" ] && break; sleep 0.05; done
	PID=$(cat "$RUN/ready")
	CHILD=$(cat /proc/"$PID"/task/*/children | tr ' ' '\n' | grep -m1 . || true)
}
wait_gone() { while [ -e "/proc/$PID" ] || { [ -n "$CHILD" ] && [ -e "/proc/$CHILD" ]; }; do sleep 0.02; done; }
check_restored() { # the restored target proves its memory checksum
	rm -f "$RUN/proof.json"
	kill -USR1 "$PID"
	for _ in $(seq 200); do [ -s "$RUN/proof.json" ] && break; sleep 0.05; done
	local a e
	a=$(sed -n 's/.*"checksum_actual": *"\([0-9a-f]*\)".*/\1/p' "$RUN/proof.json")
	e=$(sed -n 's/.*"checksum_expected": *"\([0-9a-f]*\)".*/\1/p' "$RUN/proof.json")
	[ -n "$a" ] && [ "$a" = "$e" ] || { echo "bench: restored target's memory is wrong in $RUN" >&2; exit 1; }
	kill -9 "$PID" "$CHILD" 2>/dev/null || true
	wait_gone
}
wait_line() { # file line
	for _ in $(seq 2000); do grep -qx "$2" "$1" 2>/dev/null && return 0; sleep 0.005; done
	echo "bench: no '$2' in $1" >&2
	exit 1
}
peak_kb() { sed -n 's/^\tMaximum resident set size (kbytes): //p' "$1"; }

run_variant() {
	local v=$1 d img t0 codec
	start_target
	d=$(mktemp -d "$WORK/v-XXXX")
	img=$d/img
	mkdir -p "$img" "$d/rimg"
	case $v in
	plain | plain+lz4)
		t0=$(now)
		"$CRIU" dump -D "$img" -t "$PID" -o dump.log
		if [ "$v" = plain+lz4 ]; then
			tar -C "$img" -cf - . | lz4 -1 -q >"$d/images.tar.lz4"
			record "$v" size "$(stat -c %s "$d/images.tar.lz4")"
		fi
		record "$v" dump "$(elapsed "$t0")"
		record "$v" size_raw "$(du -sb "$img" | cut -f1)"
		wait_gone
		t0=$(now)
		if [ "$v" = plain+lz4 ]; then
			rm -rf "$img" && mkdir -p "$img"
			lz4 -d -q <"$d/images.tar.lz4" | tar -C "$img" -xf -
		fi
		"$CRIU" restore -D "$img" --restore-detached -o restore.log
		record "$v" restore "$(elapsed "$t0")"
		;;
	gcs-stdout\|lz4)
		# the criu-image-streamer way: raw stream piped through the lz4 CLI
		( /usr/bin/time -v -o "$d/cap.time" "$GCS" --images-dir "$img" --progress-fd 3 capture --codec none 3>"$d/cap.progress" | lz4 -1 -q >"$d/stream.lz4" ) &
		local cap=$!
		wait_line "$d/cap.progress" socket-init
		t0=$(now)
		"$CRIU" dump --stream -D "$img" -t "$PID" -o dump.log
		wait $cap
		record "$v" dump "$(elapsed "$t0")"
		record "$v" size "$(stat -c %s "$d/stream.lz4")"
		record "$v" capture_rss_kb "$(peak_kb "$d/cap.time")"
		wait_gone
		t0=$(now)
		( lz4 -d -q <"$d/stream.lz4" | "$GCS" --images-dir "$d/rimg" --progress-fd 3 serve 3>"$d/srv.progress" ) &
		local srv=$!
		wait_line "$d/srv.progress" socket-init
		"$CRIU" restore --stream -D "$d/rimg" --restore-detached -o restore.log
		wait $srv
		record "$v" restore "$(elapsed "$t0")"
		;;
	gcs-*)
		codec=${v#gcs-}
		local key=()
		if [[ $codec == *+key ]]; then
			codec=${codec%+key}
			key=(--key-file "$KEY")
		fi
		/usr/bin/time -v -o "$d/cap.time" "$GCS" --images-dir "$img" --progress-fd 3 capture --codec "$codec" "${key[@]}" --to "$d/archive" 3>"$d/cap.progress" &
		local cap=$!
		wait_line "$d/cap.progress" socket-init
		t0=$(now)
		"$CRIU" dump --stream -D "$img" -t "$PID" -o dump.log
		wait $cap
		record "$v" dump "$(elapsed "$t0")"
		record "$v" size "$(du -sb "$d/archive" | cut -f1)"
		record "$v" capture_rss_kb "$(peak_kb "$d/cap.time")"
		wait_gone
		t0=$(now)
		/usr/bin/time -v -o "$d/srv.time" "$GCS" --images-dir "$d/rimg" --progress-fd 3 serve "${key[@]}" --from "$d/archive" 3>"$d/srv.progress" &
		local srv=$!
		wait_line "$d/srv.progress" socket-init
		"$CRIU" restore --stream -D "$d/rimg" --restore-detached -o restore.log
		wait $srv
		record "$v" restore "$(elapsed "$t0")"
		record "$v" serve_rss_kb "$(peak_kb "$d/srv.time")"
		;;
	*)
		echo "bench: unknown variant $v" >&2
		exit 2
		;;
	esac
	check_restored
	rm -rf "$d"
}

echo "bench: target ${MB} MiB, ${ROUNDS} rounds, variants: $VARIANTS; $(nproc) cores; $(uname -r); criu $("$CRIU" --version | sed -n 's/Version: //p')" >&2
for r in $(seq "$ROUNDS"); do
	for v in $VARIANTS; do
		echo "bench: round $r $v" >&2
		run_variant "$v"
	done
done

median() { sort -g | awk '{a[NR]=$1} END {if (NR==0) print ""; else if (NR%2) print a[(NR+1)/2]; else print (a[NR/2]+a[NR/2+1])/2}'; }
get() { awk -F'\t' -v v="$1" -v m="$2" '$1==v && $2==m {print $3}' "$RESULTS" | median; }
base_dump=$(get plain dump)
base_restore=$(get plain restore)
raw=$(get plain size_raw)
printf '\n%-14s %9s %7s %9s %7s %10s %7s %10s %10s\n' variant dump_s ratio restore_s ratio size_MiB of_raw cap_RSS serve_RSS
for v in $VARIANTS; do
	d=$(get "$v" dump)
	rs=$(get "$v" restore)
	s=$(get "$v" size)
	[ -z "$s" ] && s=$(get "$v" size_raw)
	cr=$(get "$v" capture_rss_kb)
	sr=$(get "$v" serve_rss_kb)
	printf '%-14s %9.3f %6.2fx %9.3f %6.2fx %10.1f %6.2f %9s %9s\n' "$v" "$d" "$(echo "$d/$base_dump" | bc -l)" "$rs" "$(echo "$rs/$base_restore" | bc -l)" \
		"$(echo "$s/1048576" | bc -l)" "$(echo "$s/$raw" | bc -l)" "${cr:+$((cr / 1024))MiB}" "${sr:+$((sr / 1024))MiB}"
done
echo
echo "medians of $ROUNDS; ratios against plain criu dump -D / restore -D on $SHM; restore counts from the start of serve (or decompression) to the end of criu restore"

# Per-core codec throughput on the target's own memory: the pages image of
# one more fresh target, encoded chunk by chunk on one goroutine.
if [ "${BENCH_CODECS:-1}" = 1 ]; then
	start_target
	img=$WORK/codec-img
	mkdir -p "$img"
	"$CRIU" dump -D "$img" -t "$PID" -o dump.log
	wait_gone
	pages=$(ls -S "$img"/pages-*.img | head -1)
	echo
	echo "per-core codec throughput on $(basename "$pages") ($(( $(stat -c %s "$pages") >> 20 )) MiB of the target's memory):"
	GPUCR_BENCH_IMAGE=$pages go test -run '^$' -bench '^BenchmarkImage$' -benchtime 3x -cpu 1 ./codec/ |
		awk '/^BenchmarkImage/ {name=$1; sub(/^BenchmarkImage\//, "", name); sub(/-1$/, "", name); mbs=""; ratio="";
			for (i=1;i<=NF;i++) { if ($i=="MB/s") mbs=$(i-1); if ($i=="ratio") ratio=$(i-1) }
			printf "  %-16s %9s MB/s %s\n", name, mbs, (ratio=="" ? "" : "ratio " ratio) }'
	# Encryption (gcs-*+key) adds a seal after encoding and an open before
	# decoding, per 4 MiB chunk, whatever the content.
	go test -run '^$' -bench '^Benchmark(Seal|Open)$' -benchtime 3s -cpu 1 ./crypt/ |
		awk '/^Benchmark/ {name=$1; sub(/^Benchmark/, "", name); sub(/-1$/, "", name); mbs="";
			for (i=1;i<=NF;i++) if ($i=="MB/s") mbs=$(i-1)
			printf "  %-16s %9s MB/s\n", "aes-256-gcm/" tolower(name), mbs }'
fi

# S3: checkpoint into and restore from MinIO on loopback, against one plain
# PutObject and a local archive (scripts/bench-s3.sh; BENCH_S3=0 skips it).
if [ "${BENCH_S3:-1}" = 1 ]; then
	echo
	echo "S3 (scripts/bench-s3.sh):"
	BENCH_MB=$MB BENCH_ROUNDS=$ROUNDS GCS=$GCS CRIU=$CRIU bash scripts/bench-s3.sh
fi
