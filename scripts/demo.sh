#!/usr/bin/env bash
# demo.sh -- checkpoint a running process into a local archive through
# gpucr-stream, let CRIU kill it, restore it from the archive, and show that
# it carries on with its memory intact. Run as root (`make demo`).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -z "${CRIU:-}" ] && ! CRIU=$(bash scripts/install-criu.sh --check "${CRIU_PREFIX:-/opt/gpucr-criu}" 2>/dev/null); then
	echo "demo: no usable criu; run make deps-demo (or make demo, which runs it)" >&2
	exit 1
fi
GCS=${GCS:-bin/gpucr-stream}
[ -x "$GCS" ] || CGO_ENABLED=0 go build -o "$GCS" ./cmd/gpucr-stream
WORK=$(mktemp -d /tmp/gcs-demo-XXXX)
TARGET_BIN=$WORK/target
echo "demo: building the target program (e2e/target)"
go build -o "$TARGET_BIN" ./e2e/target
mkdir -p "$WORK/run" "$WORK/dump" "$WORK/restore"
ARCHIVE=$WORK/archive
say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
# The work dir (the archive is most of it) goes at the end, unless the demo
# failed (CRIU's logs are there) or DEMO_KEEP=1.
cleanup() {
	local code=$?
	[ -n "${PID:-}" ] && kill -9 "$PID" 2>/dev/null || true
	[ -f "$WORK/run/proof.json" ] && kill -9 "$(sed -n 's/.*"child_pid": *\([0-9]*\).*/\1/p' "$WORK/run/proof.json")" 2>/dev/null || true
	if [ "$code" -ne 0 ]; then
		echo "demo failed; its files (CRIU's logs in $WORK/dump and $WORK/restore) are kept in $WORK" >&2
	elif [ "${DEMO_KEEP:-}" != 1 ]; then
		rm -rf "$WORK"
	fi
}
trap cleanup EXIT
# CRIU's own run, timed and labelled.
TIMEFORMAT='%Rs'
timed() { # timed LABEL CMD...: run CMD, then say how long it took
	local label=$1 t
	shift
	{ t=$( { time "$@" >&3 2>&4; } 2>&1 ); } 3>&1 4>&2
	echo "$label took $t"
}
mib() { awk -v b="$1" 'BEGIN { printf "%.1f MiB", b / 1048576 }'; }

prove() { # ask the target to check its memory; print its proof
	rm -f "$WORK/run/proof.json"
	kill -USR1 "$PID"
	for _ in $(seq 100); do [ -s "$WORK/run/proof.json" ] && break; sleep 0.05; done
	local f=$WORK/run/proof.json
	field() { sed -n "s/.*\"$1\": *\"\{0,1\}\([^\",]*\).*/\1/p" "$f" | head -1; }
	local ok=MISMATCH
	[ "$(field checksum_actual)" = "$(field checksum_expected)" ] && ok=OK
	echo "pid $(field pid)  counter $(field counter)  child alive $(field child_alive)  memory checksum $ok ($(field checksum_actual | cut -c1-16)...)"
}

say "start a target holding ${DEMO_MB:=256} MiB of model-like weights, zeros, random bytes and text"
# setsid -f: not a job of this shell, whose "Killed" notice would only confuse
(cd "$WORK/run" && setsid -f "$TARGET_BIN" --dir "$WORK/run" --mb "$DEMO_MB" </dev/null >"$WORK/run/out.log" 2>&1)
for _ in $(seq 600); do [ -s "$WORK/run/ready" ] && break; sleep 0.05; done
PID=$(cat "$WORK/run/ready")
prove

say "checkpoint: criu dump --stream -> gpucr-stream capture --to $ARCHIVE"
"$GCS" --images-dir "$WORK/dump" --progress-fd 3 capture --to "$ARCHIVE" 3>"$WORK/capture.progress" &
CAP=$!
while ! grep -q socket-init "$WORK/capture.progress" 2>/dev/null; do sleep 0.02; done
timed "criu dump --stream" "$CRIU" dump --stream -D "$WORK/dump" -t "$PID" -o dump.log
wait $CAP
# capture's statistics line (JSON, criu-image-streamer's), in words
stats=$(tail -1 "$WORK/capture.progress")
stat() { sed -n "s/.*\"$1\": *\([0-9.]*\).*/\1/p" <<<"$stats" | head -1; }
echo "gpucr-stream capture: $(stat files) files, $(mib "$(stat raw_bytes)") raw -> $(mib "$(stat stored_bytes)") stored" \
	"($(printf %.2f "$(stat ratio)")x), written in $(stat duration_ms) ms"
CHILD=$(sed -n 's/.*"child_pid": *\([0-9]*\).*/\1/p' "$WORK/run/proof.json")
# restore needs the same pids free: wait until the dumped tree is reaped
while [ -e "/proc/$PID" ] || [ -e "/proc/$CHILD" ]; do sleep 0.05; done
echo "process $PID and its child $CHILD are gone"

say "what the archive holds"
shown() { echo "\$ gpucr-stream $*"; "$GCS" "$@"; }
shown inspect "$ARCHIVE"
echo
shown verify "$ARCHIVE"

say "restore: gpucr-stream serve --from $ARCHIVE -> criu restore --stream"
"$GCS" --images-dir "$WORK/restore" --progress-fd 3 serve --from "$ARCHIVE" 3>"$WORK/serve.progress" &
SRV=$!
while ! grep -q socket-init "$WORK/serve.progress" 2>/dev/null; do sleep 0.02; done
timed "criu restore --stream" "$CRIU" restore --stream -D "$WORK/restore" --restore-detached -o restore.log
wait $SRV
sleep 0.5
say "the restored process carries on"
prove
sleep 0.5
prove
say "done"
echo "the restored process $PID and its child $CHILD are killed now that the demo ends"
if [ "${DEMO_KEEP:-}" = 1 ]; then
	echo "files (archive, CRIU's logs) kept in $WORK (DEMO_KEEP=1)"
else
	echo "its files in $WORK ($(du -sh "$WORK" | cut -f1): the archive, CRIU's logs) are removed too (DEMO_KEEP=1 keeps them)"
fi
