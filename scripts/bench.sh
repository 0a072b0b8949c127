#!/usr/bin/env bash
# bench.sh -- checkpoint and restore timings and capture CPU of gpucr-stream
# against plain `criu dump -D` / `criu restore -D` on tmpfs and against the
# plain command-line tools, measured in one run: a fresh target process for
# every measurement, the variants interleaved round by round, medians and
# ratios printed at the end.
#
# Variants (BENCH_VARIANTS, space-separated):
#   plain            criu dump -D / criu restore -D on tmpfs: the baseline
#   plain+lz4        criu dump -D, then tar | lz4 -1 (restore: lz4 -d | tar, criu restore -D);
#                    its CPU column is tar | lz4 -1's, the plain tools' cost of what
#                    gcs-lz4's capture does
#   gcs-CODEC        capture --codec CODEC --to ARCHIVE, serve --from ARCHIVE
#   gcs-CODEC+key    the same encrypted: --key-file on both (AES-256-GCM)
#   gcs-stdout       capture --codec none | cat > FILE, cat FILE | serve
#   gcs-stdout|lz4   capture --codec none | lz4 -1 > FILE, lz4 -d FILE | serve
#                    (the criu-image-streamer way)
#
# Run as root (`make bench`). Tunables: BENCH_MB (target size, default 1024),
# BENCH_MIX (the target's memory: thirds = a third random, zeros, text, the
# default; model = weights-like, zeros, random, text), BENCH_ROUNDS
# (default 3), BENCH_VARIANTS, BENCH_COMPARE="NAME=BINARY ..." (every gcs-*
# variant once per gpucr-stream build, interleaved, named VARIANT@NAME),
# BENCH_CODECS=0 / BENCH_S3=0 / BENCH_DEDUP=0 / BENCH_FILES=0 (skip the per-core
# codec table / the S3 part / dedup / images as files; all need Go, S3 also
# MinIO), BENCH_DIR (default /dev/shm).
#
# Without Go (e.g. on the GPU machine): GCS=/path/gpucr-stream
# CRIU=/path/gpucr-criu/bin/criu BENCH_TARGET=/path/e2e-target bash scripts/bench.sh
# (BENCH_TARGET defaults to e2e-target next to GCS; build both with
# `CGO_ENABLED=0 go build -o bin/gpucr-stream ./cmd/gpucr-stream` and
# `CGO_ENABLED=0 go build -o bin/e2e-target ./e2e/target`). With OUT set, the
# result table and the raw measurements are also written to
# $OUT/bench-results.txt and $OUT/bench-results.tsv.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/target-proof.sh
if [ "$(id -u)" != 0 ]; then
	echo "bench: run as root (CRIU needs it)" >&2
	exit 1
fi
have() { command -v "$1" >/dev/null 2>&1; }
CRIU=${CRIU:-$(bash scripts/install-criu.sh)}
GCS=${GCS:-bin/gpucr-stream}
case $GCS in /*) ;; *) GCS=$PWD/$GCS ;; esac
MB=${BENCH_MB:-1024}
MIX=${BENCH_MIX:-thirds}
ROUNDS=${BENCH_ROUNDS:-3}
VARIANTS=${BENCH_VARIANTS:-"plain plain+lz4 gcs-none gcs-lz4 gcs-lz4+key gcs-zstd gcs-auto gcs-stdout gcs-stdout|lz4"}
SHM=${BENCH_DIR:-/dev/shm}
WORK=$(mktemp -d "$SHM/gcs-bench-XXXX")
RESULTS=$WORK/results.tsv
: >"$RESULTS"
TARGETS=$WORK/targets # PIDs of every target started, for the cleanup
: >"$TARGETS"
cleanup() {
	while read -r p; do kill -9 "$p" 2>/dev/null || true; done <"$TARGETS"
	rm -rf "$WORK"
}
trap cleanup EXIT

if [ ! -x "$GCS" ]; then
	have go || { echo "bench: no $GCS and no Go to build it" >&2; exit 1; }
	CGO_ENABLED=0 go build -o "$GCS" ./cmd/gpucr-stream
fi
KEY=$WORK/key # gcs-CODEC+key variants encrypt with it (AES-256-GCM)
(umask 077 && "$GCS" keygen >"$KEY")
TARGET_BIN=${BENCH_TARGET:-$(dirname "$GCS")/e2e-target}
if [ ! -x "$TARGET_BIN" ] || { have go && [ -z "${BENCH_TARGET:-}" ]; }; then
	have go || { echo "bench: no target binary at $TARGET_BIN (BENCH_TARGET) and no Go to build it" >&2; exit 1; }
	TARGET_BIN=$WORK/e2e-target
	CGO_ENABLED=0 go build -o "$TARGET_BIN" ./e2e/target
fi
case $TARGET_BIN in /*) ;; *) TARGET_BIN=$PWD/$TARGET_BIN ;; esac # started from its run directory

# builds: NAME=BINARY pairs; the gcs-* variants run once per build.
declare -A BUILD
BUILD_NAMES=()
if [ -n "${BENCH_COMPARE:-}" ]; then
	for nb in $BENCH_COMPARE; do
		b=${nb#*=}
		case $b in /*) ;; *) b=$PWD/$b ;; esac
		[ -x "$b" ] || { echo "bench: BENCH_COMPARE: $b is not executable" >&2; exit 1; }
		BUILD[${nb%%=*}]=$b
		BUILD_NAMES+=("${nb%%=*}")
	done
fi
RUNS=()
for v in $VARIANTS; do
	# plain+lz4 and gcs-stdout|lz4 pipe through the lz4 command; gcs-lz4
	# is gpucr-stream's own codec and needs none.
	if [[ $v == *+lz4* || $v == *'|lz4'* ]] && ! have lz4; then
		echo "bench: no lz4 command: skipping $v" >&2
		continue
	fi
	if [[ $v == gcs-* ]] && [ ${#BUILD_NAMES[@]} -gt 0 ]; then
		for n in "${BUILD_NAMES[@]}"; do RUNS+=("$v@$n"); done
	else
		RUNS+=("$v")
	fi
done

now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$(now)" 'BEGIN {printf "%.4f", b - a}'; }
record() { printf '%s\t%s\t%s\n' "$1" "$2" "$3" >>"$RESULTS"; } # variant metric value

# timed FILE CMD...: runs CMD, then FILE holds "user sys maxrss_kb" of it
# (maxrss "-" without GNU time).
if [ -x /usr/bin/time ]; then
	timed() { local f=$1; shift; /usr/bin/time -f '%U %S %M' -o "$f" "$@"; }
else
	timed() {
		local f=$1 rc=0; shift
		local TIMEFORMAT='%U %S -'
		{ time "$@" 2>&4; } 4>&2 2>"$f" || rc=$?
		return $rc
	}
fi
record_cpu() { # variant metric-prefix timefile
	local u s m
	read -r u s m <"$3"
	record "$1" "${2}_cpu_s" "$(awk -v u="$u" -v s="$s" 'BEGIN {print u + s}')"
	[ "$m" = - ] || record "$1" "${2}_rss_kb" "$m"
}

start_target() { # -> PID, CHILD, RUN
	RUN=$(mktemp -d "$WORK/run-XXXX")
	(cd "$RUN" && exec setsid -f "$TARGET_BIN" --dir "$RUN" --mb "$MB" --mix "$MIX" </dev/null >"$RUN/out.log" 2>&1)
	for _ in $(seq 1200); do [ -s "$RUN/ready" ] && break; sleep 0.05; done
	PID=$(cat "$RUN/ready")
	echo "$PID" >>"$TARGETS"
	CHILD=$(cat /proc/"$PID"/task/*/children | tr ' ' '\n' | grep -m1 . || true)
	[ -z "$CHILD" ] || echo "$CHILD" >>"$TARGETS"
}
wait_gone() { while [ -e "/proc/$PID" ] || { [ -n "$CHILD" ] && [ -e "/proc/$CHILD" ]; }; do sleep 0.02; done; }
check_restored() { # the restored target proves its memory checksum
	memory_proven "$PID" "$RUN" || { echo "bench: restored target's memory is wrong in $RUN" >&2; exit 1; }
	kill -9 "$PID" "$CHILD" 2>/dev/null || true
	wait_gone
}
wait_line() { # file line
	for _ in $(seq 2000); do grep -qx "$2" "$1" 2>/dev/null && return 0; sleep 0.005; done
	echo "bench: no '$2' in $1" >&2
	exit 1
}
raw_bytes() { grep -ho '"raw_bytes": *[0-9]*' "$@" 2>/dev/null | grep -o '[0-9]*$' | head -1; }

run_variant() {
	local run=$1 v=${1%@*} gcs=$GCS d img t0 codec filt unfilt
	[[ $run == *@* ]] && gcs=${BUILD[${run#*@}]}
	start_target
	d=$(mktemp -d "$WORK/v-XXXX")
	img=$d/img
	mkdir -p "$img" "$d/rimg"
	case $v in
	plain | plain+lz4)
		t0=$(now)
		"$CRIU" dump -D "$img" -t "$PID" -o dump.log
		if [ "$v" = plain+lz4 ]; then
			# its CPU beside gcs-lz4's capture: both move the image and
			# compress it with LZ4 at its fastest level
			timed "$d/cap.time" sh -c 'tar -C "$1" -cf - . | lz4 -1 -q >"$2"' sh "$img" "$d/images.tar.lz4"
			record "$run" size "$(stat -c %s "$d/images.tar.lz4")"
			record_cpu "$run" capture "$d/cap.time"
		fi
		record "$run" dump "$(elapsed "$t0")"
		record "$run" size_raw "$(du -sb "$img" | cut -f1)"
		wait_gone
		t0=$(now)
		if [ "$v" = plain+lz4 ]; then
			rm -rf "$img" && mkdir -p "$img"
			lz4 -d -q <"$d/images.tar.lz4" | tar -C "$img" -xf -
		fi
		"$CRIU" restore -D "$img" --restore-detached -o restore.log
		record "$run" restore "$(elapsed "$t0")"
		;;
	gcs-stdout | gcs-stdout\|lz4)
		# the raw stream into a pipe, stored by a plain tool
		filt=(cat) unfilt=(cat)
		[ "$v" = gcs-stdout ] || filt=(lz4 -1 -q) unfilt=(lz4 -d -q)
		(timed "$d/cap.time" "$gcs" --images-dir "$img" --progress-fd 3 capture --codec none 3>"$d/cap.progress" 2>"$d/cap.err" | "${filt[@]}" >"$d/stream") &
		local cap=$!
		wait_line "$d/cap.progress" socket-init
		t0=$(now)
		"$CRIU" dump --stream -D "$img" -t "$PID" -o dump.log
		wait $cap
		record "$run" dump "$(elapsed "$t0")"
		record "$run" size "$(stat -c %s "$d/stream")"
		record "$run" raw_bytes "$(raw_bytes "$d/cap.err")"
		record_cpu "$run" capture "$d/cap.time"
		wait_gone
		t0=$(now)
		("${unfilt[@]}" <"$d/stream" | timed "$d/srv.time" "$gcs" --images-dir "$d/rimg" --progress-fd 3 serve 3>"$d/srv.progress") &
		local srv=$!
		wait_line "$d/srv.progress" socket-init
		"$CRIU" restore --stream -D "$d/rimg" --restore-detached -o restore.log
		wait $srv
		record "$run" restore "$(elapsed "$t0")"
		record_cpu "$run" serve "$d/srv.time"
		;;
	gcs-*)
		codec=${v#gcs-}
		local key=()
		if [[ $codec == *+key ]]; then
			codec=${codec%+key}
			key=(--key-file "$KEY")
		fi
		timed "$d/cap.time" "$gcs" --images-dir "$img" --progress-fd 3 capture --codec "$codec" "${key[@]}" --to "$d/archive" 3>"$d/cap.progress" >"$d/cap.out" 2>&1 &
		local cap=$!
		wait_line "$d/cap.progress" socket-init
		t0=$(now)
		"$CRIU" dump --stream -D "$img" -t "$PID" -o dump.log
		wait $cap
		record "$run" dump "$(elapsed "$t0")"
		record "$run" size "$(du -sb "$d/archive" | cut -f1)"
		record "$run" raw_bytes "$(raw_bytes "$d/cap.out")"
		record_cpu "$run" capture "$d/cap.time"
		wait_gone
		t0=$(now)
		timed "$d/srv.time" "$gcs" --images-dir "$d/rimg" --progress-fd 3 serve "${key[@]}" --from "$d/archive" 3>"$d/srv.progress" &
		local srv=$!
		wait_line "$d/srv.progress" socket-init
		"$CRIU" restore --stream -D "$d/rimg" --restore-detached -o restore.log
		wait $srv
		record "$run" restore "$(elapsed "$t0")"
		record_cpu "$run" serve "$d/srv.time"
		;;
	*)
		echo "bench: unknown variant $v" >&2
		exit 2
		;;
	esac
	check_restored
	rm -rf "$d"
}

HEAD="bench: target ${MB} MiB ($MIX), ${ROUNDS} rounds, variants: ${RUNS[*]}; $(nproc) cores; $(uname -r); criu $("$CRIU" --version | sed -n 's/Version: //p'); $(date -u +%FT%TZ)"
echo "$HEAD" >&2
for r in $(seq "$ROUNDS"); do
	for v in "${RUNS[@]}"; do
		echo "bench: round $r $v" >&2
		run_variant "$v"
	done
done

median() { sort -g | awk '{a[NR]=$1} END {if (NR==0) print ""; else if (NR%2) print a[(NR+1)/2]; else print (a[NR/2]+a[NR/2+1])/2}'; }
get() { awk -F'\t' -v v="$1" -v m="$2" '$1==v && $2==m {print $3}' "$RESULTS" | median; }
all() { awk -F'\t' -v v="$1" -v m="$2" '$1==v && $2==m {printf "%s%s", s, $3; s=" "}' "$RESULTS"; }
div() { awk -v a="$1" -v b="$2" -v f="$3" 'BEGIN {if (a == "" || b == "" || b == 0) print "-"; else printf f, a / b}'; }
table() {
	local base_dump base_restore raw
	base_dump=$(get plain dump)
	base_restore=$(get plain restore)
	raw=$(get plain size_raw)
	echo "$HEAD"
	printf '\n%-22s %8s %7s %9s %7s %9s %6s %10s %8s %8s %8s\n' variant dump_s ratio restore_s ratio size_MiB of_raw cpu_s/GiB cap_RSS serve_RSS serve_cpu
	for v in "${RUNS[@]}"; do
		local d rs s cr sr cpu rb sc
		d=$(get "$v" dump)
		rs=$(get "$v" restore)
		s=$(get "$v" size)
		[ -n "$s" ] || s=$(get "$v" size_raw)
		cr=$(get "$v" capture_rss_kb)
		sr=$(get "$v" serve_rss_kb)
		cpu=$(get "$v" capture_cpu_s)
		sc=$(get "$v" serve_cpu_s)
		rb=$(get "$v" raw_bytes)
		[ -n "$rb" ] || rb=$raw
		printf '%-22s %8.3f %6sx %9.3f %6sx %9s %6s %10s %8s %8s %8s\n' "$v" "$d" "$(div "$d" "$base_dump" %.2f)" "$rs" "$(div "$rs" "$base_restore" %.2f)" \
			"$(div "$s" 1048576 %.1f)" "$(div "$s" "$raw" %.2f)" "$(div "$cpu" "$(div "$rb" 1073741824 %.6f)" %.3f)" \
			"${cr:+$((cr / 1024))MiB}" "${sr:+$((sr / 1024))MiB}" "${sc:-}"
	done
	echo
	echo "medians of $ROUNDS; ratios against plain criu dump -D / restore -D on $SHM; restore counts from the start of serve"
	echo "(or decompression) to the end of criu restore; cpu_s/GiB = user+sys of the capture process (plain+lz4: of"
	echo "tar | lz4 -1 after the dump) per GiB of raw image;"
	echo "serve_cpu = user+sys seconds of serve (or of the serve behind the pipe)"
	echo
	echo "every run (dump s / restore s / capture cpu s):"
	for v in "${RUNS[@]}"; do
		printf '  %-22s %s / %s / %s\n' "$v" "$(all "$v" dump)" "$(all "$v" restore)" "$(all "$v" capture_cpu_s)"
	done
}
table | tee "$WORK/table.txt"
if [ -n "${OUT:-}" ]; then
	mkdir -p "$OUT"
	cp "$WORK/table.txt" "$OUT/bench-results.txt"
	cp "$RESULTS" "$OUT/bench-results.tsv"
fi

# Per-core codec throughput on the target's own memory: the pages image of
# one more fresh target, encoded chunk by chunk on one goroutine.
if [ "${BENCH_CODECS:-1}" = 1 ] && have go; then
	start_target
	img=$WORK/codec-img
	mkdir -p "$img"
	"$CRIU" dump -D "$img" -t "$PID" -o dump.log
	wait_gone
	pages=$(ls -S "$img"/pages-*.img | head -1)
	echo
	echo "per-core codec throughput on $(basename "$pages") ($(($(stat -c %s "$pages") >> 20)) MiB of the target's memory):"
	GPUCR_BENCH_IMAGE=$pages go test -run '^$' -bench '^BenchmarkImage$' -benchtime 3x -cpu 1 ./codec/ |
		awk '/^BenchmarkImage/ {name=$1; sub(/^BenchmarkImage\//, "", name); sub(/-1$/, "", name); mbs=""; ratio="";
			for (i=1;i<=NF;i++) { if ($i=="MB/s") mbs=$(i-1); if ($i=="ratio") ratio=$(i-1) }
			printf "  %-16s %9s MB/s %s\n", name, mbs, (ratio=="" ? "" : "ratio " ratio) }'
	# The C reference on the same image in the same 4 MiB blocks: what
	# the codec's own LZ4 encoder is measured against (lz4 -b reads at
	# most 2016 MiB of it: past BENCH_MB=1900 or so, a prefix).
	if have lz4; then
		lz4 -b1 -B7 -i3 "$pages" 2>&1 | tr '\r' '\n' | grep 'MB/s' | tail -1 |
			sed -n 's/.*(\([0-9.]*\)), *\([0-9.]*\) MB\/s.*/\2 \1/p' |
			awk '{printf "  %-16s %9s MB/s ratio %s\n", "lz4 -1 (command)", $1, $2}'
	fi
	# Encryption (gcs-*+key) adds a seal after encoding and an open before
	# decoding, per 4 MiB chunk, whatever the content.
	go test -run '^$' -bench '^Benchmark(Seal|Open)$' -benchtime 3s -cpu 1 ./crypt/ |
		awk '/^Benchmark/ {name=$1; sub(/^Benchmark/, "", name); sub(/-1$/, "", name); mbs="";
			for (i=1;i<=NF;i++) if ($i=="MB/s") mbs=$(i-1)
			printf "  %-16s %9s MB/s\n", "aes-256-gcm/" tolower(name), mbs }'
fi

# S3: checkpoint into and restore from MinIO on loopback, against one plain
# PutObject and a local archive (scripts/bench-s3.sh; BENCH_S3=0 skips it).
if [ "${BENCH_S3:-1}" = 1 ] && have go; then
	echo
	echo "S3 (scripts/bench-s3.sh):"
	BENCH_MB=$MB BENCH_ROUNDS=$ROUNDS GCS=$GCS CRIU=$CRIU bash scripts/bench-s3.sh
fi

# Deduplicated checkpoints (issue 22): first, unchanged and a tenth
# rewritten, against a full checkpoint, into a directory and MinIO
# (scripts/bench-dedup.sh; BENCH_DEDUP=0 skips it).
if [ "${BENCH_DEDUP:-1}" = 1 ] && have go; then
	echo
	echo "dedup (scripts/bench-dedup.sh):"
	BENCH_MB=$MB BENCH_ROUNDS=$ROUNDS GCS=$GCS CRIU=$CRIU bash scripts/bench-dedup.sh
fi

# Images handed to CRIU as files (issue 39): a memfd in place of CRIU's
# pipe against the pipe, per file and through CRIU's restore
# (scripts/bench-files.sh; BENCH_FILES=0 skips it).
if [ "${BENCH_FILES:-1}" = 1 ] && have go; then
	echo
	echo "images as files (scripts/bench-files.sh):"
	BENCH_ROUNDS=$ROUNDS CRIU=$CRIU bash scripts/bench-files.sh
fi
