#!/usr/bin/env bash
# bench-containers.sh -- a runc container checkpointed and restored through
# gpucr-stream (checkpoint/restore --container: runc runs gpucr-stream as its
# criu, whose swrk streams CRIU's images) against plain `runc checkpoint` /
# `runc restore` with the same CRIU, both into the same tmpfs (BENCH_DIR,
# /dev/shm by default). A fresh container for each dump and restore (a
# restore through gpucr-stream leaves zero pages untouched, so a restored
# container would dump less), the variants interleaved round by round
# (their order alternating), every restore proved by the target's memory
# checksum. Each round then takes two --dedup --leave-running checkpoints
# of a fresh, unchanged container into one location: "same" is what the
# second added (ls --json new_bytes) against the first. Times are the
# commands' wall time; medians and ratios are printed at the end.
#
# The container runs the e2e target (BENCH_MB MiB, default 1024, of
# BENCH_MIX, default thirds: a third random, zeros, text, as scripts/bench.sh)
# with its work dir bind-mounted. Run as root (`make bench-containers`).
# Tunables: BENCH_ROUNDS (default 3), BENCH_CODEC (gpucr-stream's --codec;
# its default if unset), CRIU, GCS, RUNC, BENCH_TARGET (a prebuilt
# e2e/target). Needs runc and jq. Besides the wall times, each variant's
# time outside CRIU (wall less CRIU's own, from its log) is printed.
#
# GCS_BASE=BINARY measures a second gpucr-stream beside GCS in every round
# (an A/B of two builds, e.g. main's: its dump and restore interleaved
# with the others', order alternating; the dedup pair is GCS's only), and
# prints its row and its ratios to runc and to GCS.
#
# BENCH_NETWORK_LOCK=METHOD (skip, nftables, iptables) sets CRIU's
# network lock for both paths alike, plain runc's and gpucr-stream's: a
# CRIU configuration file with `network-lock METHOD`, named by the
# bundle's org.criu.config annotation, which runc hands CRIU (and
# gpucr-stream's swrk passes on). Unset, CRIU locks the container's
# network namespace with iptables-restore, and on a host without iptables
# plain `runc checkpoint` fails ("criu failed: type NOTIFY"; dump.log:
# "Locking network failed"). The container has no connections to lock.
set -euo pipefail
cd "$(dirname "$0")/.."
. scripts/target-proof.sh
if [ "$(id -u)" != 0 ]; then
	echo "bench-containers: run as root (CRIU needs it)" >&2
	exit 1
fi
CRIU=${CRIU:-$(bash scripts/install-criu.sh)}
GCS=${GCS:-bin/gpucr-stream}
case $GCS in /*) ;; *) GCS=$PWD/$GCS ;; esac
BASE=${GCS_BASE:-}
case $BASE in /* | '') ;; *) BASE=$PWD/$BASE ;; esac
[ -z "$BASE" ] || [ -x "$BASE" ] || { echo "bench-containers: GCS_BASE=$BASE is not an executable" >&2; exit 1; }
RUNC=${RUNC:-runc}
MB=${BENCH_MB:-1024}
MIX=${BENCH_MIX:-thirds}
CODEC=(${BENCH_CODEC:+--codec "$BENCH_CODEC"})
ROUNDS=${BENCH_ROUNDS:-3}
SHM=${BENCH_DIR:-/dev/shm}
for tool in "$RUNC" jq; do
	command -v "$tool" >/dev/null || { echo "bench-containers: $tool is not installed (make deps)" >&2; exit 1; }
done
WORK=$(mktemp -d "$SHM/gcs-bench-ctr-XXXX")
ROOT=$WORK/runc-root BUNDLE=$WORK/bundle DATA=$WORK/data
ID=gcs-bench-$$
RESULTS=$WORK/results.tsv
: >"$RESULTS"
cleanup() {
	"$RUNC" --root "$ROOT" delete --force "$ID" >/dev/null 2>&1 || true
	rm -rf "$WORK"
}
trap cleanup EXIT
[ -x "$GCS" ] || CGO_ENABLED=0 go build -o "$GCS" ./cmd/gpucr-stream
mkdir -p "$ROOT" "$DATA" "$BUNDLE/rootfs/data"
TARGET_BIN=${BENCH_TARGET:-}
if [ -n "$TARGET_BIN" ]; then cp "$TARGET_BIN" "$BUNDLE/rootfs/target"; else CGO_ENABLED=0 go build -o "$BUNDLE/rootfs/target" ./e2e/target; fi
"$RUNC" spec --bundle "$BUNDLE"
jq --arg data "$DATA" --arg mb "$MB" --arg mix "$MIX" '.process.terminal = false |
	.process.args = ["/target", "--dir", "/data", "--mb", $mb, "--mix", $mix] | .root.readonly = false |
	.mounts += [{"destination": "/data", "type": "bind", "source": $data, "options": ["rbind", "rw"]}]' \
	"$BUNDLE/config.json" >"$BUNDLE/config.json.new"
mv "$BUNDLE/config.json.new" "$BUNDLE/config.json"
if [ -n "${BENCH_NETWORK_LOCK:-}" ]; then
	echo "network-lock $BENCH_NETWORK_LOCK" >"$WORK/criu.conf"
	jq --arg conf "$WORK/criu.conf" '.annotations["org.criu.config"] = $conf' "$BUNDLE/config.json" >"$BUNDLE/config.json.new"
	mv "$BUNDLE/config.json.new" "$BUNDLE/config.json"
fi

now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$(now)" 'BEGIN {printf "%.4f", b - a}'; }
record() { printf '%s\t%s\n' "$1" "$2" >>"$RESULTS"; }
runc_() { "$RUNC" --root "$ROOT" --log "$WORK/runc.log" --log-format text "$@" </dev/null >/dev/null 2>&1 || { cat "$WORK/runc.log" >&2; exit 1; }; }
pid() { "$RUNC" --root "$ROOT" state "$ID" | jq -r .pid; }
gone() { while [ -e "/proc/$1" ]; do sleep 0.02; done; }
proven() { # the container's target still has its memory
	memory_proven "$(pid)" "$DATA" || { echo "bench-containers: the restored container's memory is wrong ($1)" >&2; exit 1; }
}
timed() { # metric COMMAND...: runs it, records its wall time
	local t0
	t0=$(now)
	"${@:2}"
	record "$1" "$(elapsed "$t0")"
}
gcs() { gcs_with "$GCS" "$@"; }
gcs_with() { # BINARY ARGS...
	"$1" "${@:2}" --criu "$CRIU" --runtime-root "$ROOT" >"$WORK/gcs.out" 2>&1 || { cat "$WORK/gcs.out" >&2; exit 1; }
}

fresh() { # a new container, its target's memory filled
	"$RUNC" --root "$ROOT" delete --force "$ID" >/dev/null 2>&1 || true
	rm -f "$DATA"/*
	runc_ run --detach --bundle "$BUNDLE" "$ID"
	for _ in $(seq 2400); do [ -s "$DATA/ready" ] && break; sleep 0.05; done
	[ -s "$DATA/ready" ] || { echo "bench-containers: the container's target is not ready" >&2; exit 1; }
}
criu_took() { # METRIC LOG: CRIU's own time, its log's last timestamp
	record "$1_criu" "$(tail -1 "$2" | sed -n 's/^(\([0-9.]*\)).*/\1/p')"
}
plain() {
	local p
	fresh
	p=$(pid)
	timed plain_dump runc_ --criu "$CRIU" checkpoint --image-path "$WORK/img" "$ID"
	criu_took plain_dump "$WORK/img/dump.log"
	gone "$p"
	timed plain_restore runc_ --criu "$CRIU" restore --detach --image-path "$WORK/img" --bundle "$BUNDLE" "$ID"
	criu_took plain_restore "$WORK/img/restore.log"
	proven plain
	rm -rf "$WORK/img"
}
streamed() { # [NAME BINARY]: GCS's dump and restore (recorded as gcs_*), or BINARY's (NAME_*)
	local p name=${1:-gcs} bin=${2:-$GCS}
	fresh
	p=$(pid)
	mkdir "$WORK/w"
	timed "${name}_dump" gcs_with "$bin" checkpoint --container "$ID" --to "$WORK/ck" --work-dir "$WORK/w" "${CODEC[@]}"
	criu_took "${name}_dump" "$WORK/w/dump.log"
	gone "$p"
	rm -rf "$WORK/w" && mkdir "$WORK/w"
	timed "${name}_restore" gcs_with "$bin" restore --container "$ID" --from "$WORK/ck" --work-dir "$WORK/w"
	criu_took "${name}_restore" "$WORK/w/restore.log"
	proven "$bin"
	rm -rf "$WORK/ck" "$WORK/w"
}
based() { [ -z "$BASE" ] || streamed base "$BASE"; }
new_bytes() { "$GCS" ls --json "$WORK/loc" | jq -r --arg n "$1" '.[] | select(.name == $n) | .new_bytes'; }

echo "bench-containers: runc container of the target, ${MB} MiB ($MIX), ${ROUNDS} rounds, codec ${BENCH_CODEC:-default}, into $SHM; $(nproc) cores; network lock ${BENCH_NETWORK_LOCK:-as CRIU picks it}; $GCS${BASE:+ against $BASE}; $(date -u +%FT%TZ); load $(cut -d' ' -f1-3 /proc/loadavg)" >&2
for r in $(seq "$ROUNDS"); do
	echo "bench-containers: round $r" >&2
	if [ $((r % 2)) = 1 ]; then plain; streamed; based; else based; streamed; plain; fi
	fresh
	timed dedup_first gcs checkpoint --container "$ID" --leave-running --dedup --to "$WORK/loc/first" "${CODEC[@]}"
	timed dedup_same gcs checkpoint --container "$ID" --leave-running --dedup --to "$WORK/loc/same" "${CODEC[@]}"
	record first_new "$(new_bytes first)"
	record same_new "$(new_bytes same)"
	rm -rf "$WORK/loc"
done

median() { sort -g | awk '{a[NR]=$1} END {if (NR==0) print ""; else if (NR%2) print a[(NR+1)/2]; else print (a[NR/2]+a[NR/2+1])/2}'; }
get() { awk -F'\t' -v m="$1" '$1==m {print $2}' "$RESULTS" | median; }
all() { awk -F'\t' -v m="$1" '$1==m {printf "%s ", $2}' "$RESULTS"; }
div() { awk -v a="$1" -v b="$2" 'BEGIN {if (a == "" || b == "" || b == 0) print "-"; else printf "%.2fx", a / b}'; }
echo
printf '%-12s %12s %12s %8s   %s\n' step "runc (s)" "gpucr (s)" ratio "runs: runc | gpucr-stream"
for s in dump restore; do
	printf '%-12s %12.3f %12.3f %8s   %s| %s\n' "$s" "$(get plain_$s)" "$(get gcs_$s)" "$(div "$(get gcs_$s)" "$(get plain_$s)")" "$(all plain_$s)" "$(all gcs_$s)"
done
if [ -n "$BASE" ]; then
	for s in dump restore; do
		printf '%-12s %12.3f %12.3f %8s   %s(to runc; GCS/base %s)\n' "base $s" "$(get plain_$s)" "$(get base_$s)" "$(div "$(get base_$s)" "$(get plain_$s)")" "$(all base_$s)" "$(div "$(get gcs_$s)" "$(get base_$s)")"
	done
fi
# Outside CRIU: each run's wall time less CRIU's own (its log's last
# timestamp): the process starts and waits around CRIU, which CRIU's
# freezer wait (100 ms steps) and page work do not blur.
outside() { awk -F'\t' -v m="$1" '$1==m {w[++n]=$2} $1==m"_criu" {c[++k]=$2} END {for (i = 1; i <= n && i <= k; i++) print (w[i] - c[i]) * 1000}' "$RESULTS" | median; }
printf '%-12s %12s %12s%s   %s\n' "outside CRIU" "runc (ms)" "gpucr (ms)" "${BASE:+   base (ms)}" "(wall less CRIU's own time, medians)"
for s in dump restore; do
	printf '%-12s %12.1f %12.1f%s\n' "$s" "$(outside plain_$s)" "$(outside gcs_$s)" "${BASE:+$(printf ' %12.1f' "$(outside base_$s)")}"
done
echo "load at the end: $(cut -d' ' -f1-3 /proc/loadavg)"
f=$(get first_new) s=$(get same_new)
echo "dedup: first checkpoint $(get dedup_first) s adding $f bytes, the unchanged second $(get dedup_same) s adding $s bytes ($(awk -v a="$s" -v b="$f" 'BEGIN {printf "%.2f%%", 100 * a / b}'))"
