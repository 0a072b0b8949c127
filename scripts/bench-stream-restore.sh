#!/usr/bin/env bash
# bench-stream-restore.sh -- restore from a stream (`capture | ... | serve`)
# against `criu restore -D` on tmpfs (docs/bench-log/2026-11.md, "Restore from a
# stream while it is read"). Each round dumps a fresh thirds target of
# BENCH_MB MiB with criu dump -D and times criu restore -D; dumps another
# through `capture --codec none` into a stream file on tmpfs; then restores
# that stream, each time from `cat FILE |`, three ways, their order turned
# round by round:
#   serve          criu-image-streamer's order: the whole stream read, then
#                  the statistics line, then socket-init (and criu)
#   serve --early  socket-init at once, criu restores while the stream is read
#   restore        gpucr-stream restore --from - (runs criu itself; early)
#   pipe-restore   cat STREAM | restore --from -
#   late-early     serve --early of a stream captured with --pages-last
#                  (CRIU's page images sent after every other file)
#   late-restore   restore --from - of that stream
#   late-pipe-restore  cat STREAM | restore --from - of that stream
# and prints how long each capture took, from criu dump's start to the
# capture's exit (--pages-last ends later by the time to send the pages).
# With BENCH_BEFORE=PATH (another build), its `restore --from -` is timed
# too. Times run from the start of the pipeline to criu's and serve's exit.
# Run as root from the repository root after make build; without Go there,
# give GCS, CRIU and BENCH_TARGET (CGO_ENABLED=0 go build ./e2e/target).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" != 0 ]; then
	echo "bench-stream-restore: run as root (CRIU needs it)" >&2
	exit 1
fi
CRIU=${CRIU:-$(bash scripts/install-criu.sh)}
GCS=${GCS:-$PWD/bin/gpucr-stream}
BEFORE=${BENCH_BEFORE:-}
MB=${BENCH_MB:-1024}
ROUNDS=${BENCH_ROUNDS:-3}
W=$(mktemp -d "${BENCH_DIR:-/dev/shm}/gcs-srestore-XXXX")
# The target: BENCH_TARGET (a machine without Go), else built here.
TARGET=$W/target
if [ -n "${BENCH_TARGET:-}" ]; then cp "$BENCH_TARGET" "$TARGET"; else go build -o "$TARGET" ./e2e/target; fi
. scripts/bench-target.sh
wait_init() { for _ in $(seq 60000); do grep -qx socket-init "$1" 2>/dev/null && return; sleep 0.001; done; echo "bench-stream-restore: no socket-init in $1" >&2; exit 1; }
fresh() { rm -rf "$W/rimg" && mkdir -p "$W/rimg"; }

# serve_through STREAM ARGS...: cat the stream into serve, criu restore --stream
# once socket-init is out; prints the milliseconds.
serve_through() {
	local stream=$1
	shift
	fresh
	rm -f "$W/srv.progress"
	local t0 t1
	t0=$(ns)
	cat "$stream" | "$GCS" --images-dir "$W/rimg" --progress-fd 3 serve "$@" 3>"$W/srv.progress" 2>>"$W/srv.err" &
	local srv=$!
	wait_init "$W/srv.progress"
	"$CRIU" restore --stream -D "$W/rimg" --restore-detached -o restore.log
	wait "$srv"
	t1=$(ns)
	ms "$t0" "$t1"
}
restore_from() { # BIN STREAM [pipe]
	local t0 t1
	t0=$(ns)
	if [ -n "${3:-}" ]; then
		cat "$2" | "$1" restore --from - --criu "$CRIU" --no-progress >/dev/null 2>>"$W/restore.err"
	else
		"$1" restore --from - --criu "$CRIU" --no-progress <"$2" >/dev/null 2>>"$W/restore.err"
	fi
	t1=$(ns)
	ms "$t0" "$t1"
}

# capture_to FILE ARGS...: dumps a fresh target through capture ARGS into
# FILE; sets CAP_MS to the milliseconds from criu dump's start to capture's
# exit, DUMP_MS to criu dump's own time, and PID to the target's (the PID a restore of FILE brings back).
capture_to() {
	local f=$1
	shift
	start
	rm -rf "$W/img" "$W/cap.progress" && mkdir -p "$W/img"
	"$GCS" --images-dir "$W/img" --progress-fd 3 capture --codec none "$@" >"$f" 3>"$W/cap.progress" &
	local cap=$! t0 t1
	wait_init "$W/cap.progress"
	t0=$(ns)
	"$CRIU" dump --stream -D "$W/img" -t "$PID" -o dump.log
	td=$(ns)
	wait "$cap"
	t1=$(ns)
	gone
	CAP_MS=$(ms "$t0" "$t1")
	DUMP_MS=$(ms "$t0" "$td")
}

# restored V: fails the run unless variant V's restore brought its target
# back (its PID runs), then kills it; a variant that failed would be timed
# as fast as it gave up.
restored() {
	if [ ! -e "/proc/$PID" ]; then
		echo "bench-stream-restore: $1 did not restore pid $PID:" >&2
		tail -5 "$W/restore.err" "$W/srv.err" >&2 2>/dev/null || true
		exit 1
	fi
	stop
}

variants="serve early restore pipe-restore late-early late-restore late-pipe-restore"
[ -z "$BEFORE" ] || variants="$variants before"
declare -A res
res[plain]=""
res[cap]=""
res[cap-late]=""
res[dump]=""
res[dump-late]=""
for v in $variants; do res[$v]=""; done
echo "bench-stream-restore: ${MB} MiB thirds target, $ROUNDS rounds, $(nproc) cores, load $(cut -d' ' -f1-3 /proc/loadavg)" >&2
for r in $(seq "$ROUNDS"); do
	start
	rm -rf "$W/d" && mkdir "$W/d"
	"$CRIU" dump -D "$W/d" -t "$PID" -o dump.log
	gone
	t0=$(ns)
	"$CRIU" restore -D "$W/d" --restore-detached -o restore.log
	t1=$(ns)
	stop
	rm -rf "$W/d"
	res[plain]+=" $(ms "$t0" "$t1")"
	capture_to "$W/s.stream"
	res[cap]+=" $CAP_MS"
	res[dump]+=" $DUMP_MS"
	spid=$PID
	capture_to "$W/late.stream" --pages-last
	res[cap-late]+=" $CAP_MS"
	res[dump-late]+=" $DUMP_MS"
	lpid=$PID
	# Turn the order round by round.
	order=$variants
	for _ in $(seq $(((r - 1) % $(echo $variants | wc -w)))); do order="$(echo $order | cut -d' ' -f2-) $(echo $order | cut -d' ' -f1)"; done
	line="round $r: criu restore -D ${res[plain]##* } ms"
	for v in $order; do
		case $v in
		serve) t=$(serve_through "$W/s.stream") ;;
		early) t=$(serve_through "$W/s.stream" --early) ;;
		restore) t=$(restore_from "$GCS" "$W/s.stream") ;;
		pipe-restore) t=$(restore_from "$GCS" "$W/s.stream" pipe) ;;
		late-early) t=$(serve_through "$W/late.stream" --early) ;;
		late-pipe-restore) t=$(restore_from "$GCS" "$W/late.stream" pipe) ;;
		late-restore) t=$(restore_from "$GCS" "$W/late.stream") ;;
		before) t=$(restore_from "$BEFORE" "$W/s.stream") ;;
		esac
		case $v in late-*) PID=$lpid ;; *) PID=$spid ;; esac
		restored "$v"
		res[$v]+=" $t"
		line+="; $v $t ms"
	done
	echo "$line" >&2
done
median() { tr ' ' '\n' | sed '/^$/d' | sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }
base=$(echo "${res[plain]}" | median)
printf '| variant | restore (median) | vs criu restore -D | runs (ms) |\n|---|---|---|---|\n'
printf '| criu restore -D (tmpfs) | %d ms | 1.00x | %s |\n' "$base" "${res[plain]# }"
for v in $variants; do
	m=$(echo "${res[$v]}" | median)
	case $v in
	serve) label='`cat STREAM \| serve` (criu-image-streamer order: read whole, then socket-init)' ;;
	early) label='`cat STREAM \| serve --early`' ;;
	restore) label='`restore --from - < STREAM`' ;;
	pipe-restore) label='`cat STREAM \| restore --from -`' ;;
	late-early) label='`cat STREAM \| serve --early`, captured with `--pages-last`' ;;
	late-pipe-restore) label='`cat STREAM \| restore --from -`, captured with `--pages-last`' ;;
	late-restore) label='`restore --from - < STREAM`, captured with `--pages-last`' ;;
	before) label="\`restore --from - < STREAM\`, $BEFORE" ;;
	esac
	printf '| %s | %d ms | %s | %s |\n' "$label" "$m" "$(awk -v a="$m" -v b="$base" 'BEGIN{printf "%.2fx", a/b}')" "${res[$v]# }"
done
printf '\ncapture (criu dump --stream to capture exit), median: %d ms; with --pages-last %d ms (runs: %s; %s)\n' \
	"$(echo "${res[cap]}" | median)" "$(echo "${res[cap-late]}" | median)" "${res[cap]# }" "${res[cap-late]# }"
printf 'of which criu dump, median: %d ms; with --pages-last %d ms (runs: %s; %s)\n' \
	"$(echo "${res[dump]}" | median)" "$(echo "${res[dump-late]}" | median)" "${res[dump]# }" "${res[dump-late]# }"
grep -o 'criu asked for its first file[^;]*' "$W/srv.err" | sed 's/^/serve --early: /' >&2 || true
