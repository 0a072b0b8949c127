#!/usr/bin/env bash
# bench-s3.sh -- gpucr-stream with S3 (a MinIO server on loopback, started
# by scripts/minio.sh with random credentials), measured in one run:
#
#   put       criu dump -D to tmpfs, then ONE plain minio-go PutObject of the
#             image bytes (e2e/cmd/s3bench put): the baseline
#   push      the same image files pushed through `capture --to s3://`
#             (as criu dump --stream sends them): same bytes, compressed
#   gcs-s3    criu dump --stream into `capture --to s3://`, then
#             `serve --from s3://` into criu restore --stream
#   gcs-local the same through a local archive on tmpfs
#
# and for each archive the time until a reader that asks as criu restore
# does (inventory first, pages last) gets the first byte of pages. Then the
# peak RSS of capture and serve for synthetic images of BENCH_S3_SIZES GiB
# (default "1 4 8"), pushed and read without CRIU, with the default
# --memory-limit (or each of BENCH_S3_LIMITS, e.g. "default 256MiB").
#
# A fresh target for every measurement, variants interleaved round by
# round, medians at the end. Run as root. Tunables: BENCH_MB (target size,
# default 1024), BENCH_ROUNDS (default 3), BENCH_S3_SIZES, BENCH_S3_DATA
# (MinIO's data dir parent, default /var/tmp: a disk), BENCH_OUT (also
# write the result table there, markdown), BENCH_S3_SYNTH_ONLY=1 (only the
# synthetic images), BENCH_S3_COMPARE="NAME=BINARY ..." (the synthetic
# images through each of these gpucr-stream builds, interleaved run by run,
# e.g. "before=/tmp/gcs-main after=bin/gpucr-stream"), BENCH_S3_BASE (an
# images dir whose small files the synthetic images take; default: a criu
# dump of a 64 MiB target; with BENCH_S3_SYNTH_ONLY=1 no CRIU is needed).
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/target-proof.sh
if [ "$(id -u)" != 0 ]; then
	echo "bench-s3: run as root (CRIU needs it)" >&2
	exit 1
fi
SYNTH_ONLY=${BENCH_S3_SYNTH_ONLY:-0}
BASE=${BENCH_S3_BASE:-}
if [ "$SYNTH_ONLY" != 1 ] || [ -z "$BASE" ]; then
	CRIU=${CRIU:-$(bash scripts/install-criu.sh)}
fi
GCS=${GCS:-bin/gpucr-stream}
case $GCS in /*) ;; *) GCS=$PWD/$GCS ;; esac
MB=${BENCH_MB:-1024}
ROUNDS=${BENCH_ROUNDS:-3}
SIZES=${BENCH_S3_SIZES:-"1 4 8"}
LIMITS=${BENCH_S3_LIMITS:-default} # --memory-limit of the synthetic runs
BUILDS=() NAMES=()
for nb in ${BENCH_S3_COMPARE:-"gpucr-stream=$GCS"}; do
	b=${nb#*=}
	case $b in /*) ;; *) b=$PWD/$b ;; esac
	[ -x "$b" ] || { echo "bench-s3: $b is not an executable (BENCH_S3_COMPARE wants NAME=BINARY ...)" >&2; exit 1; }
	NAMES+=("${nb%%=*}") BUILDS+=("$b")
done
SHM=${BENCH_DIR:-/dev/shm}
WORK=$(mktemp -d "$SHM/gcs-bench-s3-XXXX")
TARGET_BIN=$WORK/target
S3BENCH=$WORK/s3bench
go build -o "$TARGET_BIN" ./e2e/target
go build -o "$S3BENCH" ./e2e/cmd/s3bench
[ -x "$GCS" ] || CGO_ENABLED=0 go build -o "$GCS" ./cmd/gpucr-stream
RESULTS=$WORK/results.tsv
: >"$RESULTS"
MINIO_DIR=
PIDS=()
# kill_ours kills the given pids that still run one of our binaries (a pid
# recorded long ago may belong to someone else by now).
kill_ours() {
	local p exe
	for p in "$@"; do
		exe=$(readlink "/proc/$p/exe" 2>/dev/null) || continue
		case ${exe% (deleted)} in
		"$TARGET_BIN" | "$GCS" | "$S3BENCH" | /usr/bin/time) kill -9 "$p" 2>/dev/null || true ;;
		*) for b in "${BUILDS[@]}"; do if [ "${exe% (deleted)}" = "$b" ]; then kill -9 "$p" 2>/dev/null || true; fi; done ;;
		esac
	done
}
cleanup() {
	local p
	for p in "${PIDS[@]}"; do kill_ours $(pgrep -P "$p" 2>/dev/null) "$p"; done
	[ -z "$MINIO_DIR" ] || bash scripts/minio.sh stop "$MINIO_DIR" 2>/dev/null || true
	rm -rf "$WORK"
}
trap cleanup EXIT

now() { date +%s.%N; }
elapsed() { echo "$(now) - $1" | bc -l; }
record() { printf '%s\t%s\t%s\n' "$1" "$2" "$3" >>"$RESULTS"; } # variant metric value
json() { sed -n "s/.*\"$2\":\([0-9.e+-]*\).*/\1/p" "$1"; }        # file key -> number
peak_kb() { sed -n 's/^\tMaximum resident set size (kbytes): //p' "$1"; }

# MinIO on loopback (scripts/minio.sh: a free port, random credentials),
# its data in BENCH_S3_DATA.
for k in AWS_SESSION_TOKEN AWS_PROFILE AWS_DEFAULT_REGION AWS_ENDPOINT_URL_S3; do unset "$k"; done
minio=$(MINIO_BINARY=${MINIO:-} TMPDIR=${BENCH_S3_DATA:-/var/tmp} bash scripts/minio.sh) # its exports
eval "$minio"
MINIO_DIR=$GPUCR_MINIO_DIR
"$S3BENCH" mb bench
S3=s3://bench

start_target() { # [MB] -> PID, CHILD, RUN
	RUN=$(mktemp -d "$WORK/run-XXXX")
	(cd "$RUN" && setsid "$TARGET_BIN" --dir "$RUN" --mb "${1:-$MB}" </dev/null >"$RUN/out.log" 2>&1 &)
	for _ in $(seq 1200); do [ -s "$RUN/ready" ] && break; sleep 0.05; done
	PID=$(cat "$RUN/ready")
	CHILD=$(cat /proc/"$PID"/task/*/children | tr ' ' '\n' | grep -m1 . || true)
	PIDS+=("$PID" "$CHILD")
}
wait_gone() { while [ -e "/proc/$PID" ] || { [ -n "$CHILD" ] && [ -e "/proc/$CHILD" ]; }; do sleep 0.02; done; }
check_restored() {
	memory_proven "$PID" "$RUN" || { echo "bench-s3: restored target's memory is wrong in $RUN" >&2; exit 1; }
	kill -9 "$PID" "$CHILD" 2>/dev/null || true
	wait_gone
}
wait_line() {
	for _ in $(seq 2000); do grep -qx "$2" "$1" 2>/dev/null && return 0; sleep 0.005; done
	echo "bench-s3: no '$2' in $1" >&2
	exit 1
}
names_of() { "$GCS" inspect "$1" | awk 'p {print $NF} /^ *SIZE/ {p=1}' >"$2"; }

# start_capture BIN DIR DEST [FLAGS...]: BIN capture --to DEST on DIR/a,
# under time -v (DIR/cap.time), progress in DIR/cap.progress; returns once
# it listens, with its pid in CAP and the time in T0.
start_capture() {
	local bin=$1 d=$2 dest=$3
	shift 3
	/usr/bin/time -v -o "$d/cap.time" "$bin" --images-dir "$d/a" --progress-fd 3 "$@" capture --to "$dest" 3>"$d/cap.progress" &
	CAP=$!
	PIDS+=("$CAP")
	wait_line "$d/cap.progress" socket-init
	T0=$(now)
}

# read_ttfb VARIANT SRC: time to the first byte of pages, serving SRC to a
# reader that asks as criu restore does.
read_ttfb() {
	local v=$1 src=$2 d
	d=$(mktemp -d "$WORK/r-XXXX")
	names_of "$src" "$d/names"
	"$S3BENCH" read -images-dir "$d" -files "$d/names" -- "$GCS" --images-dir "$d" --progress-fd 9 serve --from "$src" >"$d/read.json"
	record "$v" ttfb "$(json "$d/read.json" first_page_byte_s)"
	record "$v" ttfb_req "$(json "$d/read.json" first_page_byte_after_request_s)"
	record "$v" read_s "$(json "$d/read.json" seconds)"
	rm -rf "$d"
}

run_variant() { # variant round
	local v=$1 r=$2 d t0 srv
	d=$(mktemp -d "$WORK/v-XXXX")
	mkdir -p "$d/a" "$d/b"
	case $v in
	put+push)
		start_target
		mkdir -p "$d/img"
		t0=$(now)
		"$CRIU" dump -D "$d/img" -t "$PID" -o dump.log
		record put criu_dump "$(elapsed "$t0")"
		wait_gone
		"$S3BENCH" put -bucket bench -key "r$r/put" "$d"/img/*.img >"$d/put.json"
		record put seconds "$(json "$d/put.json" seconds)"
		record put bytes "$(json "$d/put.json" bytes)"
		start_capture "$GCS" "$d" "$S3/r$r/push"
		"$S3BENCH" push -images-dir "$d/a" "$d/img" >/dev/null
		wait "$CAP"
		record push seconds "$(elapsed "$T0")"
		record push bytes "$(json "$d/cap.progress" raw_bytes)"
		record push stored "$(json "$d/cap.progress" stored_bytes)"
		record push capture_rss_kb "$(peak_kb "$d/cap.time")"
		;;
	gcs-s3 | gcs-local)
		local dest=$S3/r$r/gcs
		[ "$v" = gcs-local ] && dest=$d/archive
		start_target
		start_capture "$GCS" "$d" "$dest"
		"$CRIU" dump --stream -D "$d/a" -t "$PID" -o dump.log
		wait "$CAP"
		record "$v" seconds "$(elapsed "$T0")"
		record "$v" bytes "$(json "$d/cap.progress" raw_bytes)"
		record "$v" stored "$(json "$d/cap.progress" stored_bytes)"
		record "$v" capture_rss_kb "$(peak_kb "$d/cap.time")"
		wait_gone
		t0=$(now)
		/usr/bin/time -v -o "$d/srv.time" "$GCS" --images-dir "$d/b" --progress-fd 3 serve --from "$dest" 3>"$d/srv.progress" &
		srv=$!
		PIDS+=("$srv")
		wait_line "$d/srv.progress" socket-init
		"$CRIU" restore --stream -D "$d/b" --restore-detached -o restore.log
		wait $srv
		record "$v" restore "$(elapsed "$t0")"
		record "$v" serve_rss_kb "$(peak_kb "$d/srv.time")"
		check_restored
		read_ttfb "$v" "$dest"
		;;
	esac
	rm -rf "$d"
}

echo "bench-s3: target ${MB} MiB, ${ROUNDS} rounds; MinIO on $AWS_ENDPOINT_URL, data in $MINIO_DIR; $(nproc) cores; $(uname -r)" >&2
[ "$SYNTH_ONLY" = 1 ] || for r in $(seq "$ROUNDS"); do
	for v in put+push gcs-s3 gcs-local; do
		echo "bench-s3: round $r $v" >&2
		run_variant "$v" "$r"
	done
done

# Peak RSS against image size: synthetic images (the small files of a real
# dump, one pages file of N GiB), pushed into capture --to s3:// and read
# back through serve --from s3://, no CRIU involved.
base=${BASE:-$WORK/base}
if [ -z "$BASE" ]; then
	start_target 64
	mkdir -p "$base"
	"$CRIU" dump -D "$base" -t "$PID" -o dump.log
	wait_gone
fi
for g in $SIZES; do
	echo "bench-s3: synthetic ${g} GiB" >&2
	img=$WORK/synth-$g
	"$S3BENCH" synth -dir "$img" -size "${g}GiB" -from "$base"
	for r in $(seq "$ROUNDS"); do
		for lim in $LIMITS; do
			for i in "${!BUILDS[@]}"; do
				bin=${BUILDS[$i]} k=big-$g-$lim-${NAMES[$i]}
				key=$k-r$r
				echo "bench-s3: synthetic ${g} GiB, round $r, ${NAMES[$i]}" >&2
				d=$(mktemp -d "$WORK/big-XXXX")
				mkdir -p "$d/a" "$d/b"
				mem=()
				[ "$lim" = default ] || mem=(--memory-limit "$lim")
				start_capture "$bin" "$d" "$S3/$key" "${mem[@]}"
				"$S3BENCH" push -images-dir "$d/a" "$img" >/dev/null
				wait "$CAP"
				record "$k" push_s "$(elapsed "$T0")"
				record "$k" capture_rss_kb "$(peak_kb "$d/cap.time")"
				names_of "$S3/$key" "$d/names"
				/usr/bin/time -v -o "$d/srv.time" "$S3BENCH" read -images-dir "$d/b" -files "$d/names" -- \
					"$bin" --images-dir "$d/b" --progress-fd 9 "${mem[@]}" serve --from "$S3/$key" >"$d/read.json"
				record "$k" read_s "$(json "$d/read.json" seconds)"
				record "$k" ttfb "$(json "$d/read.json" first_page_byte_s)"
				# time -v measures s3bench with its child, the serve: the larger of the two.
				record "$k" serve_rss_kb "$(peak_kb "$d/srv.time")"
				"$GCS" rm "$S3/$key" >/dev/null # MinIO's disk holds one at a time
				rm -rf "$d"
			done
		done
	done
	rm -rf "$img"
done

median() { sort -g | awk '{a[NR]=$1} END {if (NR==0) print ""; else if (NR%2) print a[(NR+1)/2]; else print (a[NR/2]+a[NR/2+1])/2}'; }
get() { awk -F'\t' -v v="$1" -v m="$2" '$1==v && $2==m {print $3}' "$RESULTS" | median; }
mibs() { echo "$1 / $2 / 1048576" | bc -l; }

# every VARIANT METRIC: its values in run order, MiB for *_rss_kb.
every() {
	awk -F'\t' -v v="$1" -v m="$2" '$1==v && $2==m {if (m ~ /_rss_kb$/) printf "%d ", $3/1024; else printf "%.2f ", $3}' "$RESULTS"
}

report_synth() {
	echo "Synthetic images (the small files of a real dump and one pages file of N GiB), pushed into capture --to s3:// and read back through serve --from s3://, no CRIU; medians of ${ROUNDS}, builds interleaved run by run."
	echo
	echo "| synthetic image | build | --memory-limit | push into capture --to s3:// | capture peak RSS | read back through serve --from s3:// | first byte of pages | serve peak RSS |"
	echo "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |"
	for lim in $LIMITS; do
		for g in $SIZES; do
			for name in "${NAMES[@]}"; do
				local k=big-$g-$lim-$name
				printf '| %s GiB | %s | %s | %.2f s | %d MiB | %.2f s | %.0f ms | %d MiB |\n' "$g" "$name" "$lim" "$(get "$k" push_s)" "$(($(get "$k" capture_rss_kb | cut -d. -f1) / 1024))" \
					"$(get "$k" read_s)" "$(echo "$(get "$k" ttfb)*1000" | bc -l)" "$(($(get "$k" serve_rss_kb | cut -d. -f1) / 1024))"
			done
		done
	done
	echo
	echo "Every run (push s, capture peak RSS MiB):"
	echo
	for lim in $LIMITS; do
		for g in $SIZES; do
			for name in "${NAMES[@]}"; do
				local k=big-$g-$lim-$name
				printf -- '- %s GiB %s %s: push %s; RSS %s\n' "$g" "$name" "$lim" "$(every "$k" push_s)" "$(every "$k" capture_rss_kb)"
			done
		done
	done
}

report() {
	local put_bps push_bps s3_bps
	put_bps=$(mibs "$(get put bytes)" "$(get put seconds)")
	push_bps=$(mibs "$(get push bytes)" "$(get push seconds)")
	s3_bps=$(mibs "$(get gcs-s3 bytes)" "$(get gcs-s3 seconds)")
	echo "Target ${MB} MiB, $(nproc) cores, MinIO on loopback (data on $(df --output=fstype "$MINIO_DIR" | tail -1)), medians of ${ROUNDS}, a fresh target for every measurement."
	echo
	echo "| what | seconds | MiB/s (raw) | vs one PutObject | stored MiB | capture RSS | serve RSS |"
	echo "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"
	printf '| one minio-go PutObject of the criu -D image (%d MiB) | %.2f | %.0f | 1.00x | %.0f | | |\n' \
		"$(($(get put bytes | cut -d. -f1) >> 20))" "$(get put seconds)" "$put_bps" "$(echo "$(get put bytes)/1048576" | bc -l)"
	printf '| same files through capture --to s3:// (lz4) | %.2f | %.0f | %.2fx | %.0f | %d MiB | |\n' \
		"$(get push seconds)" "$push_bps" "$(echo "$push_bps/$put_bps" | bc -l)" "$(echo "$(get push stored)/1048576" | bc -l)" "$(($(get push capture_rss_kb | cut -d. -f1) / 1024))"
	printf '| criu dump --stream into capture --to s3:// | %.2f | %.0f | %.2fx | %.0f | %d MiB | |\n' \
		"$(get gcs-s3 seconds)" "$s3_bps" "$(echo "$s3_bps/$put_bps" | bc -l)" "$(echo "$(get gcs-s3 stored)/1048576" | bc -l)" "$(($(get gcs-s3 capture_rss_kb | cut -d. -f1) / 1024))"
	printf '| criu dump --stream into capture --to DIR (tmpfs) | %.2f | %.0f | %.2fx | %.0f | %d MiB | |\n' \
		"$(get gcs-local seconds)" "$(mibs "$(get gcs-local bytes)" "$(get gcs-local seconds)")" \
		"$(echo "$(mibs "$(get gcs-local bytes)" "$(get gcs-local seconds)")/$put_bps" | bc -l)" "$(echo "$(get gcs-local stored)/1048576" | bc -l)" "$(($(get gcs-local capture_rss_kb | cut -d. -f1) / 1024))"
	echo
	echo "(criu dump -D to tmpfs before the PutObject took $(printf %.2f "$(get put criu_dump)") s, not counted above.)"
	echo
	echo "| restore | serve + criu restore s | ratio | first byte of pages (from serve start) | (from the request) | whole image read, no CRIU | serve RSS |"
	echo "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"
	printf '| serve --from DIR (tmpfs) | %.2f | 1.00x | %.0f ms | %.1f ms | %.2f s | %d MiB |\n' \
		"$(get gcs-local restore)" "$(echo "$(get gcs-local ttfb)*1000" | bc -l)" "$(echo "$(get gcs-local ttfb_req)*1000" | bc -l)" "$(get gcs-local read_s)" "$(($(get gcs-local serve_rss_kb | cut -d. -f1) / 1024))"
	printf '| serve --from s3:// | %.2f | %.2fx | %.0f ms | %.1f ms | %.2f s | %d MiB |\n' \
		"$(get gcs-s3 restore)" "$(echo "$(get gcs-s3 restore)/$(get gcs-local restore)" | bc -l)" "$(echo "$(get gcs-s3 ttfb)*1000" | bc -l)" "$(echo "$(get gcs-s3 ttfb_req)*1000" | bc -l)" "$(get gcs-s3 read_s)" "$(($(get gcs-s3 serve_rss_kb | cut -d. -f1) / 1024))"
	echo
	echo "Every run (seconds, in round order):"
	echo
	for vm in "put seconds" "push seconds" "gcs-s3 seconds" "gcs-local seconds" "gcs-s3 restore" "gcs-local restore" "gcs-s3 ttfb_req" "gcs-local ttfb_req"; do
		printf -- '- %s %s: %s\n' $vm "$(awk -F'\t' -v v="${vm% *}" -v m="${vm#* }" '$1==v && $2==m {printf "%.3f ", $3}' "$RESULTS")"
	done
}
echo >&2
{
	[ "$SYNTH_ONLY" = 1 ] || { report && echo; }
	report_synth
} | tee ${BENCH_OUT:+"$BENCH_OUT"}
