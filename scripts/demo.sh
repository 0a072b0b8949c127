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
go build -o "$TARGET_BIN" ./e2e/target
mkdir -p "$WORK/run" "$WORK/dump" "$WORK/restore"
ARCHIVE=$WORK/archive
say() { printf '\n\033[1m== %s\033[0m\n' "$*"; }
cleanup() {
	[ -n "${PID:-}" ] && kill -9 "$PID" 2>/dev/null || true
	[ -f "$WORK/run/proof.json" ] && kill -9 "$(sed -n 's/.*"child_pid": *\([0-9]*\).*/\1/p' "$WORK/run/proof.json")" 2>/dev/null || true
}
trap cleanup EXIT

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
time "$CRIU" dump --stream -D "$WORK/dump" -t "$PID" -o dump.log
wait $CAP
tail -1 "$WORK/capture.progress"
CHILD=$(sed -n 's/.*"child_pid": *\([0-9]*\).*/\1/p' "$WORK/run/proof.json")
# restore needs the same pids free: wait until the dumped tree is reaped
while [ -e "/proc/$PID" ] || [ -e "/proc/$CHILD" ]; do sleep 0.05; done
echo "process $PID and its child $CHILD are gone"

say "what the archive holds"
"$GCS" inspect "$ARCHIVE"
"$GCS" verify "$ARCHIVE"

say "restore: gpucr-stream serve --from $ARCHIVE -> criu restore --stream"
"$GCS" --images-dir "$WORK/restore" --progress-fd 3 serve --from "$ARCHIVE" 3>"$WORK/serve.progress" &
SRV=$!
while ! grep -q socket-init "$WORK/serve.progress" 2>/dev/null; do sleep 0.02; done
time "$CRIU" restore --stream -D "$WORK/restore" --restore-detached -o restore.log
wait $SRV
sleep 0.5
say "the restored process carries on"
prove
sleep 0.5
prove
say "done; files in $WORK"
