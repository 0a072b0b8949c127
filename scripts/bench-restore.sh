#!/usr/bin/env bash
# bench-restore.sh -- where a restore through serve spends its time, next to
# criu restore -D on the same target (docs/bench-log/2026-11.md, "Restore: inside
# CRIU or around it"). For each of BENCH_ROUNDS rounds, a fresh thirds
# target of BENCH_MB MiB is dumped with criu dump -D and restored with
# criu restore -D; another is captured with --codec none into an archive
# on tmpfs and restored through serve. Printed per round: the plain
# restore, and the served one split into serve's start (to socket-init),
# criu restore --stream, and serve's exit after CRIU is done. Both
# restores log at -v4 into BENCH_OUT (default: a temporary directory), so
# that CRIU's own clock ("Restore finished" and the page reads) can be
# compared too. Run as root from the repository root after make build.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ "$(id -u)" != 0 ]; then
	echo "bench-restore: run as root (CRIU needs it)" >&2
	exit 1
fi
CRIU=${CRIU:-$(bash scripts/install-criu.sh)}
GCS=${GCS:-$PWD/bin/gpucr-stream}
MB=${BENCH_MB:-2048}
ROUNDS=${BENCH_ROUNDS:-3}
OUT=${BENCH_OUT:-$(mktemp -d)}
W=$(mktemp -d "${BENCH_DIR:-/dev/shm}/gcs-restore-XXXX")
TARGET=$W/target
go build -o "$TARGET" ./e2e/target
. scripts/bench-target.sh
wait_init() { for _ in $(seq 20000); do grep -qx socket-init "$1" 2>/dev/null && return; sleep 0.001; done; echo "bench-restore: no socket-init in $1" >&2; exit 1; }

echo "bench-restore: ${MB} MiB thirds target, $ROUNDS rounds, $(nproc) cores; CRIU logs in $OUT" >&2
for r in $(seq "$ROUNDS"); do
	start
	rm -rf "$W/d" && mkdir "$W/d"
	"$CRIU" dump -D "$W/d" -t "$PID" -o dump.log
	gone
	t0=$(ns)
	"$CRIU" restore -D "$W/d" --restore-detached -v4 -o "$OUT/plain-restore-$r.log"
	t1=$(ns)
	stop
	rm -rf "$W/d" "$W/a" "$W/img" "$W/rimg" && mkdir -p "$W/img" "$W/rimg"
	start
	"$GCS" --images-dir "$W/img" --progress-fd 3 capture --codec none --to "$W/a" 3>"$W/cap.progress" &
	cap=$!
	wait_init "$W/cap.progress"
	"$CRIU" dump --stream -D "$W/img" -t "$PID" -o dump.log
	wait "$cap"
	gone
	s0=$(ns)
	"$GCS" --images-dir "$W/rimg" --progress-fd 3 serve --from "$W/a" 3>"$W/srv.progress" &
	srv=$!
	wait_init "$W/srv.progress"
	s1=$(ns)
	"$CRIU" restore --stream -D "$W/rimg" --restore-detached -v4 -o "$OUT/stream-restore-$r.log"
	s2=$(ns)
	wait "$srv"
	s3=$(ns)
	stop
	fin() { sed -n 's/^(\([0-9.]*\)) Restore finished.*/\1/p' "$1"; }
	echo "round $r: criu restore -D $(ms "$t0" "$t1") ms (CRIU's clock $(fin "$OUT/plain-restore-$r.log") s);" \
		"through serve $(ms "$s0" "$s3") ms = start $(ms "$s0" "$s1") + criu restore --stream $(ms "$s1" "$s2")" \
		"(CRIU's clock $(fin "$OUT/stream-restore-$r.log") s) + exit $(ms "$s2" "$s3")"
done
