# bench-target.sh -- sourced by the restore benchmarks (bench-restore.sh,
# bench-stream-restore.sh): the life of the e2e target they dump, in their
# scratch directory W. The caller sets W, TARGET (the target's binary in W)
# and MB; PID is the running target's. start runs a fresh thirds target of
# MB MiB in W/run, stop kills it and waits until it is gone (CRIU restores
# into its PID), and the EXIT trap removes W and whatever still runs there.
PID=
cleanup() {
	[ -z "$PID" ] || kill -9 "$PID" 2>/dev/null || true
	pkill -9 -f "$TARGET --dir $W" 2>/dev/null || true
	rm -rf "$W"
}
trap cleanup EXIT

start() {
	rm -rf "$W/run" && mkdir -p "$W/run"
	(cd "$W/run" && exec setsid -f "$TARGET" --dir "$W/run" --mb "$MB" --mix thirds </dev/null >out.log 2>&1)
	for _ in $(seq 2400); do [ -s "$W/run/ready" ] && break; sleep 0.05; done
	PID=$(cat "$W/run/ready")
}
gone() { while [ -e "/proc/$PID" ]; do sleep 0.02; done; }
stop() {
	kill -9 "$PID" 2>/dev/null || true
	pkill -9 -f "$TARGET --dir $W/run" 2>/dev/null || true
	gone
}
ns() { date +%s%N; }
ms() { echo $((($2 - $1) / 1000000)); }
