#!/bin/bash
# GPU end-to-end test and benchmark: run it on a machine with an NVIDIA GPU
# (driver >= 570), PyTorch and root, from the repository root:
#
#   make build build-testhooks && e2e/gpu/run.sh
#
# The rounds that inject faults (fastfault, ncclfault, ncclp2pfault) run
# GCS_HOOKS, gpucr-stream built with its test hooks (GPUCR_TEST_FAULT,
# GPUCR_TEST_PAUSE: package testhook), which the shipped binary lacks;
# `make build-testhooks` builds it as bin/gpucr-stream-testhooks.
#
# It starts e2e/gpu/torch_target.py (a PyTorch process holding GIB_RANDOM GiB
# of float32 random tensors and GIB_WEIGHTS GiB of bf16 model-like weights,
# all checksummed), then, for every round in ROUNDS, with a fresh target:
#
#   baseline   gpucr-stream gpu suspend (CUDA lock + checkpoint),
#              criu dump -D to local disk; criu restore -D,
#              gpucr-stream gpu resume (CUDA restore + unlock)
#   auto, lz4, none, zstd, ...
#              gpucr-stream checkpoint --codec CODEC into a local archive,
#              gpucr-stream restore from it
#   leave      gpucr-stream checkpoint --leave-running (codec auto): the
#              target must run on, unchanged
#   tree, tree-2, ...
#              the auto round on a process tree: the target starts
#              TREE_CHILDREN CUDA children of TREE_CHILD_MIB MiB each (same
#              session); the checkpoint must have suspended 1 + TREE_CHILDREN
#              CUDA processes, and every child proves itself too
#   fast, fastexp, fastleave
#              the GPU fast path: the target runs under gpucr-stream run
#              (libgpucr-preload); checkpoint --codec FAST_CODEC moves its
#              device memory through the pipeline itself and releases it
#              before the driver's checkpoint; restore copies it back after
#              the driver's restore. fastexp: the same with
#              PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; fastleave:
#              with --leave-running. The round fails unless the checkpoint
#              took the fast path (its "vram copy out" phase).
#   fasttree   the tree round on the fast path (every process of the tree
#              runs with the library)
#   dedupfast  deduplicated checkpoints on the fast path (issue 22), into a
#              location on tmpfs (DEDUP_TMPFS, /dev/shm) and one on disk
#              ($WORK): checkpoint --dedup into LOC/one, restore, prove; the
#              target rewrites REWRITE_PCT percent of its tensor bytes
#              (SIGUSR2: new random values in place, checksums updated),
#              proves, checkpoint --dedup into LOC/two, restore, prove.
#              Reports both checkpoint times, the second's new bytes as a
#              share of the first's (ls --json LOC), and what the second
#              copied out and kept (the blocks changed since the first: its
#              --json vram.kept_bytes) as a share of the device memory
#              (issue 36: at most 15%). The round fails unless every
#              checkpoint took the fast path and every proof holds
#   devhash    the two ways of finding changed device memory (issue 22) on
#              the fast-path target: gpu hash --host-check (the device's
#              block hashes against the host's, every block; the copy out
#              and BLAKE3 on every core beside it), the target rewrites
#              REWRITE_PCT percent of its tensors, gpu hash twice more (what
#              changed: at least the rewritten bytes; then what the running
#              target changes by itself); it proves itself after each
#   dedupreplicas
#              REPLICAS fast-path targets with the same seed (same tensors)
#              checkpointed --dedup one after the other into one location
#              (DEDUP_TMPFS), each restored and proved: reports the bytes
#              all of them added over what the first added
#   fastsuspend
#              gpucr-stream gpu suspend --to ARCHIVE (the process stays alive
#              with no device memory), then gpu resume --from ARCHIVE
#   fastfault  faults after the fast path's release, one target: a failed
#              store, CRIU refusing its options, gpucr-stream killed after
#              the release; after each the target must run on intact
#   probe      e2e/gpu/quiesce_probe.py with the default allocator and with
#              expandable segments (the quiescence order, step by step)
#   migrate    live migration on this host over loopback: gpucr-stream
#              receive --restore on 127.0.0.1:PORT, gpucr-stream migrate
#              --to tcp://127.0.0.1:PORT; the process comes back with its PID
#              (same PID namespace); the downtime is what counts
#   infer, inferfast, inferfastcache
#              an inference-shaped target (e2e/gpu/infer_target.py): GIB_WEIGHTS
#              GiB of bf16 weights, a KV cache of torch.zeros filling
#              KV_FRACTION of the memory left (KV_GIB GiB instead, if set), of
#              which KV_WRITTEN_PCT percent of the blocks written by
#              "requests", and CUDA graphs. infer: the auto round (the
#              driver's checkpoint alone); inferfast: the fast round;
#              inferfastcache: the fast round with the KV cache marked as a
#              cache (gpucr_mark_cache), which must come back as zeros.
#              Every checkpoint is watched for the host memory it takes
#              (e2e/gpu/memwatch.py: the peak over the start, less what the
#              archive's file system gained); the target proves its weights,
#              its written blocks and zeros everywhere else
#   migratefast
#              the migrate round on the GPU fast path: the target runs under
#              gpucr-stream run; the VRAM files go in the migration stream
#              (--codec FAST_CODEC, the kept copy in VRAM_KEEP_DIR) and the
#              receiver copies them in after its driver restore. The round
#              fails unless migrate took the fast path ("vram copy out") and
#              the receiver copied in ("vram copy in").
#
# Two GPUs (issue 15; skipped, saying so, where nvidia-smi lists fewer):
#   remap, remapfast
#              the target on GPU 0, restored with --gpu-map GPU0=GPU1
#              (remapfast: on the fast path); nvidia-smi must then show its
#              memory on GPU 1 and none on GPU 0
#   span, spanfast
#              the target holds tensors on both GPUs (--devices 0,1: the
#              random tensors on 0, the weights on 1, a product on each),
#              restored in place; its memory must be on both again
#   spanswap, spanswapfast
#              the same, restored with --gpu-map GPU0=GPU1,GPU1=GPU0: what
#              each GPU held must now be on the other
#   migrateremap
#              the migrate round with a receiver that maps GPU 0 onto GPU 1
#   badmap     the target on GPU 0, checkpoint --leave-running; restore with
#              a map onto a GPU this host lacks, then onto GPU 1 while a
#              hog holds all but HOG_LEAVE_MIB of it, and a receiver with a
#              map onto a GPU this host lacks: each must fail before CRIU
#              with a message naming the GPU, and the target run on
#   nccl       e2e/gpu/nccl_pair.py: two processes (GPU 0 and 1) in one
#              NCCL communicator, all_reduce in a loop. The driver cannot
#              undo the checkpoint of an NCCL rank (issue 24), so
#              checkpoint (--tcp-established, the ranks' loopback
#              connections) and gpu suspend must refuse the pair before any
#              GPU step, naming the ranks; both must then still be running
#              for the driver and prove themselves: every tensor checksum,
#              all_reduce sums right, counters going on
#   ncclfault  the same pair, checkpoint with GPUCR_TEST_FAULT=gpu-checkpoint:
#              the refusal is skipped and the driver's checkpoint step fails
#              before it reaches the driver, so the tree's lock runs on real
#              ranks (locking one rank may stall the other's lock:
#              CUDA_ERROR_NOT_READY) and must be undone at once: the
#              checkpoint fails, both ranks run and prove themselves. If an
#              undo fails, the round logs each rank's state and the recovery
#              command from --json, runs it, and fails
#
#   ncclfast   the pair under `gpucr-stream run`, NCCL over sockets
#              (NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1: the ranks share no
#              device memory), stepping all_reduce: checkpoint on the fast
#              path (the collective barrier parks both ranks after the same
#              collective) into an archive, restore in place; both ranks
#              prove every tensor, the sums and their counters
#   ncclfastswap
#              the same, restored with the two GPUs swapped: each rank's
#              device memory must now be on the other GPU
#   ncclp2p, ncclp2pswap
#              ncclfast and ncclfastswap with NCCL's defaults: P2P over
#              shareable handles, each rank mapping buffers of the other
#              (released before the driver's checkpoint, mapped again from
#              the exporter's new handle after the refill)
#   ncclp2pmigrate
#              the ncclp2p pair migrated on loopback (migratefast's
#              receive --restore and migrate --pid)
#   ncclp2ptp  the ncclp2p round with the pair also a tensor-parallel model
#              (nccl_pair.py --tp-layers TP_LAYERS, default 4: d=4096 MLP
#              layers split Megatron-style, bf16): after the restore its
#              output must be bit-identical to the first one
#   ctr, ctrfast, ctrfastlib, ctrfastmigrate
#              the target in a runc container (RUNC, runc on PATH):
#              checkpoint --container and restore --container twice, the
#              second of the restored container, which must be running
#              in runc's list and in the cgroups the container had;
#              driver-only, the fast path through `gpucr-stream run` as
#              the entry point, and through the library mounted in;
#              ctrfastmigrate moves ctrfast's by migrate --container into
#              a second runc root first (e2e/gpu/ctr.sh)
#   ncclp2pfault
#              fastfault's three faults on the ncclp2p pair: the store
#              fails, CRIU refuses its options (both after the release:
#              the undo maps each rank's imports again), gpucr-stream is
#              killed after the release (each rank refills its own memory
#              and waits, parked, for `gpu resume --pid`, which the round
#              runs); the pair must run on intact after each
#
# One round alone: ROUNDS=nccl (or ROUNDS="nccl ncclfault") e2e/gpu/run.sh.
#
# A round name with a suffix (auto-2, tree-2) runs that round again; the
# suffix -nostage (fast-nostage) restores with --stage-memory none, and
# -precopy (migratefast-precopy) migrates with --precopy on, and -dense
# (ncclp2p-dense) restores with GPUCR_NO_SPARSE=1: CRIU is handed every
# zero page too, as before sparse pages (criusock/sparse.go), and -reaped
# (ncclp2pmigrate-reaped) starts the target under e2e/gpu/reaper.py, which
# reaps its orphans at once where this host's init takes 1.5-1.9 s, and
# -launched (ncclp2p-launched) starts an NCCL pair in torchrun's layout: a
# launcher that holds no GPU, both ranks its children (nccl_pair.py
# --launch; CRIU then restores the ranks side by side), and -lazy
# (migratefast-lazy) runs the receiver with --lazy-pages, CUDA processes
# included (GPUCR_LAZY_CUDA=1). After
# every restore the target proves itself: every tensor checksum matches
# and it keeps computing the same product. Results go to
# $OUT (or $WORK/out): run.log, results.jsonl, logs.tar.gz; the last lines
# printed are a summary table.
#
# Knobs (environment): GIB_RANDOM (4), GIB_WEIGHTS (6), ROUNDS
# ("auto baseline lz4 leave"), DEADLINE (seconds after which no new round
# starts, 420), WORK (scratch dir on local disk, short path), GCS (the
# gpucr-stream binary, bin/gpucr-stream), GCS_HOOKS (the same built with
# test hooks, bin/gpucr-stream-testhooks), CRIU (criu binary; else criu on
# PATH, .cache/criu/bin/criu, /opt/gpucr-criu/bin/criu), PYTHON (python3),
# DEVICE (cuda; "cpu" runs the same steps without a GPU, for testing the
# script), SIDE (8192), FAST_CODEC (codec of the fast rounds, none),
# VRAM_FILES (fast path: --vram-files, the copy threads and kept files;
# empty: the default), FULL_LOGS (set: keep CRIU's whole logs too, as
# LOG.full beside the digest, for their timestamps),
# VRAM_KEEP_DIR (fast path: the copy kept until the commit; empty:
# gpucr-stream's default, a tmpfs of huge pages of its own),
# GPU_MAP_ROUND (round whose restore remaps the GPU
# onto itself with --gpu-map, lz4; empty: none), TREE_CHILDREN (children of
# the target in tree rounds, 2), TREE_CHILD_MIB (device memory of each, 512),
# RECV_SPILL_DIR (migrate rounds: where the receiver spills what it holds
# beyond its memory limit until the restore; empty: its default, $TMPDIR),
# MIGRATE_STREAMS (migrate rounds: --streams of migrate; empty: its default),
# MIGRATE_REWRITE_EVERY (migrate rounds: the target rewrites REWRITE_PCT
# percent of its tensors every that many seconds while it migrates; empty:
# never),
# MIGRATE_KEEP_DIR (migrate rounds: the sender's local copy goes into a
# directory made in it, e.g. /dev/shm; empty: gpucr-stream's default, a
# tmpfs of huge pages of its own; none: no copy),
# HOG_LEAVE_MIB (badmap: what the hog leaves free on GPU 1, 512), NCCL_MIB
# (nccl: device memory of each rank, 1024), NCCL_PERIOD (seconds the pair
# sleeps between its all_reduce steps, 0: back to back), DEDUP_TMPFS (dedup rounds: the
# tmpfs that holds a location, /dev/shm), REWRITE_PCT (dedupfast: share of
# the tensor bytes rewritten between the checkpoints, 10), REPLICAS
# (dedupreplicas: targets, 4), KV_FRACTION (infer rounds: share of the free
# device memory the KV cache takes, 0.9), KV_WRITTEN_PCT (infer rounds: 5),
# KV_GIB (infer rounds: the KV cache's size in GiB instead of KV_FRACTION).
set -u -o pipefail
export PYTHONUNBUFFERED=1

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
GCS=${GCS:-$ROOT/bin/gpucr-stream}
GCS_HOOKS=${GCS_HOOKS:-$ROOT/bin/gpucr-stream-testhooks}
PY=${PYTHON:-python3}
DEVICE=${DEVICE:-cuda}
GIB_RANDOM=${GIB_RANDOM:-4}
GIB_WEIGHTS=${GIB_WEIGHTS:-6}
SIDE=${SIDE:-8192}
ROUNDS=${ROUNDS:-auto baseline lz4 leave}
DEADLINE=${DEADLINE:-420}
GPU_MAP_ROUND=${GPU_MAP_ROUND-lz4}
TREE_CHILDREN=${TREE_CHILDREN:-2}
TREE_CHILD_MIB=${TREE_CHILD_MIB:-512}
FAST_CODEC=${FAST_CODEC:-none}
VRAM_KEEP_DIR=${VRAM_KEEP_DIR:-}
HOG_LEAVE_MIB=${HOG_LEAVE_MIB:-512}
NCCL_MIB=${NCCL_MIB:-1024}
NCCL_PERIOD=${NCCL_PERIOD:-0}
PLACED1=
DEDUP_TMPFS=${DEDUP_TMPFS:-/dev/shm}
REWRITE_PCT=${REWRITE_PCT:-10}
REPLICAS=${REPLICAS:-4}
KV_FRACTION=${KV_FRACTION:-0.9}
KV_WRITTEN_PCT=${KV_WRITTEN_PCT:-5}
KV_GIB=${KV_GIB:-}
PROOF_KV=
HOG_PID=
TCHILDREN=0
RECV_SPILL_DIR=${RECV_SPILL_DIR:-}
MIGRATE_STREAMS=${MIGRATE_STREAMS:-}
MIGRATE_KEEP_DIR=${MIGRATE_KEEP_DIR:-}
RECV_PID=
T_START=$(date +%s.%N)

pick_work() {
	for d in /var/tmp /tmp "$ROOT/.cache"; do
		mkdir -p "$d" 2>/dev/null || continue
		avail=$(df --output=avail -B1G "$d" 2>/dev/null | tail -1 | tr -d ' ')
		if [ "${avail:-0}" -ge 40 ] || [ "$DEVICE" = cpu ]; then
			echo "$d/gg"
			return
		fi
	done
	echo /tmp/gg
}
WORK=${WORK:-$(pick_work)}
OUTDIR=${OUT:-$WORK/out}
rm -rf "$WORK"
mkdir -p "$WORK" "$OUTDIR" "$WORK/logs"
RUNLOG=$OUTDIR/run.log
RESULTS=$OUTDIR/results.jsonl
: >"$RESULTS"

now() { date +%s.%N; }
since() { awk -v a="$1" -v b="$(now)" 'BEGIN { printf "%.3f", b - a }'; }
log() { echo "[$(since "$T_START")s] $*" | tee -a "$RUNLOG"; }
die() {
	log "FATAL: $*"
	finish 1
}

# proc_ids PID: "PPID PGID SID" of a process, from /proc/PID/stat.
proc_ids() {
	local s
	s=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
	s=${s##*) }
	# shellcheck disable=SC2086 # split on purpose: state ppid pgrp session ...
	set -- $s
	echo "$2 $3 $4"
}
read -r _ MY_PGID MY_SID <<<"$(proc_ids $$)"

# is_target PID: the pid runs torch_target.py (a pid that was reused, or a
# zombie, is not ours to kill).
is_target() { tr '\0' ' ' 2>/dev/null <"/proc/$1/cmdline" | grep -q "torch_target\.py\|nccl_pair\.py\|infer_target\.py"; }

# tree_pids: the target (TPID) and the children listed in TDIR.
tree_pids() {
	local f
	echo "$TPID"
	for f in "$TDIR"/ready-child-*; do [ -s "$f" ] && cat "$f"; done
}

# kill_tree PID DIR [nowait]: SIGKILL a target and its children: its process
# group (kill -- -PGID: setsid made the target the leader of its session and
# group, the children share both, and CRIU restores both), its session
# (pkill -s, should the group not be the target's own any more), and every
# child listed in DIR; only processes running torch_target.py, never our
# own group or session. Then waits until they are gone, unless nowait.
kill_tree() {
	local pid=$1 dir=${2:-} nowait=${3:-} ids ppid pgid sid kids=() c f
	for f in "$dir"/ready-child-*; do [ -s "$f" ] && kids+=("$(cat "$f")"); done
	if is_target "$pid" && ids=$(proc_ids "$pid"); then
		read -r ppid pgid sid <<<"$ids"
		if [ "$pgid" != "$pid" ] || [ "$sid" != "$pid" ]; then
			log "kill: target $pid (parent $ppid) is in process group $pgid, session $sid: not its own; killing both"
		fi
		[ "$pgid" -gt 1 ] && [ "$pgid" != "$MY_PGID" ] && kill -9 -- "-$pgid" 2>/dev/null
		[ "$sid" -gt 1 ] && [ "$sid" != "$MY_SID" ] && pkill -9 -s "$sid" 2>/dev/null
		kill -9 "$pid" 2>/dev/null
	fi
	for c in "${kids[@]}"; do
		is_target "$c" && kill -9 "$c" 2>/dev/null
	done
	[ -n "$nowait" ] && return 0
	wait_gone "$pid" || log "kill: pid $pid still there"
	# The children only need to be dead (their GPU memory free); a zombie
	# waits for init.
	for c in "${kids[@]}"; do wait_dead "$c" || log "kill: child $c still alive"; done
}

if [ -z "${CRIU:-}" ]; then
	for c in "$(command -v criu 2>/dev/null)" "$ROOT/.cache/criu/bin/criu" /opt/gpucr-criu/bin/criu; do
		if [ -n "$c" ] && [ -x "$c" ]; then
			CRIU=$c
			break
		fi
	done
fi

# The container rounds (ctr, ctrfast, ctrfastlib, ctrfastmigrate).
# shellcheck source=e2e/gpu/ctr.sh
. "$ROOT/e2e/gpu/ctr.sh"

finish() {
	local rc=$1 t
	# Whatever is still running of ours goes.
	[ -n "$RECV_PID" ] && kill -9 "$RECV_PID" 2>/dev/null
	[ -n "$HOG_PID" ] && kill -9 "$HOG_PID" 2>/dev/null
	ctr_delete
	for t in "$WORK"/t-*; do
		[ -s "$t/ready" ] && kill_tree "$(cat "$t/ready")" "$t" nowait
	done
	rm -rf "$DEDUP_TMPFS"/gpucr-dedup-*
	for t in "$WORK"/t-*/child-*.out; do [ -f "$t" ] && tail -n 100 "$t" >"$WORK/logs/$(basename "$(dirname "$t")")-$(basename "$t")" 2>/dev/null; done
	for t in "$WORK"/t-*; do [ -d "$t" ] && tail -n 200 "$t/target.out" >"$WORK/logs/$(basename "$t")-target.out" 2>/dev/null; done
	(cd "$WORK/logs" && tar czf "$OUTDIR/logs.tar.gz" . 2>/dev/null)
	summary
	log "done (exit $rc) after $(since "$T_START")s"
	exit "$rc"
}

summary() {
	[ -s "$RESULTS" ] || return 0
	python3 - "$RESULTS" <<'EOF' | tee -a "$RUNLOG"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.strip()]
print()
print("%-15s %-4s %8s %8s %8s %8s %8s | %8s %8s %8s %8s | %9s %9s %6s" % (
    "round", "ok", "lock", "gpu-ckpt", "dump", "commit", "CKPT", "criu-rst", "gpu-rst", "unlock", "RESTORE", "raw GiB", "stored", "ratio"))
for r in rows:
    p = r.get("phases", {})
    g = lambda k: p.get(k, 0.0)
    print("%-15s %-4s %8.2f %8.2f %8.2f %8.2f %8.2f | %8.2f %8.2f %8.2f %8.2f | %9.2f %9.2f %6.2f" % (
        r["round"], "yes" if r.get("ok") else "NO", g("lock"), g("gpu_checkpoint"), g("dump"), g("commit"),
        r.get("checkpoint_total", 0), g("criu_restore"), g("gpu_restore"), g("unlock"), r.get("restore_total", 0),
        r.get("raw_bytes", 0) / 2**30, r.get("stored_bytes", 0) / 2**30,
        (r.get("raw_bytes", 0) / r["stored_bytes"]) if r.get("stored_bytes") else 0))
    if p.get("vram_copy_out"):
        print("          fast path: park %.2fs, copy out %.2fs, release %.2fs, store %.2fs (beside the dump) | remap %.2fs, copy in %.2fs, refill %.2fs" % (
            g("vram_park"), g("vram_copy_out"), g("vram_release"), g("vram_store"), g("vram_remap"), g("vram_copy_in"), g("vram_refill")))
    if r.get("vram_detail"):
        print("          " + ", ".join("%s %.3fs" % (k[5:], v) for k, v in r["vram_detail"].items()))
    if r.get("restore_steps"):
        # In the restore's order; what runs beside CRIU says so in its name
        # (docs/PRODUCERS.md, "What a restore overlaps").
        print("          restore steps: " + ", ".join("%s %.3fs" % (n, v) for n, v in r["restore_steps"]))
    if r.get("memory_released_seconds"):
        print("          gpu suspend: device memory released after %.2fs, device freed after %.2fs" % (
            r["memory_released_seconds"], r.get("device_freed_seconds", 0)))
    d = r.get("dedup")
    if d and "replicas" in d:
        print("          dedup: %d replicas added %s GiB, the first %.2f GiB: %.2fx of one (issue 22: at most 1.3x; location: %.2f GiB after one, %.2f after all)" % (
            d["replicas"], " + ".join("%.2f" % (b / 2**30) for b in d["new_bytes"]), d["new_bytes"][0] / 2**30, d["over_one"],
            d["location_bytes_one"] / 2**30, d["location_bytes_all"] / 2**30))
    elif d:
        print("          dedup (%s): first %.2fs, %.2f GiB new; %.1f%% of the tensor bytes rewritten; second %.2fs, %.3f GiB new = %.1f%% of the first's (issue 22: at most 12%%, 1.0s into tmpfs, 2.0s onto disk); restores %.2fs, %.2fs" % (
            d["location"], d["first_seconds"], d["first_new_bytes"] / 2**30, 100 * d["rewrite_share"], d["second_seconds"],
            d["second_new_bytes"] / 2**30, 100 * d["second_share"], d["first_restore_seconds"], d["second_restore_seconds"]))
        if d.get("second_allocated_bytes"):
            tm = d["location"].startswith("tmpfs ")
            met = d["second_kept_share"] <= 0.15 and (not tm or d["second_seconds"] <= 1.2)
            print("          dedup (%s): the second copied out and kept %.3f GiB = %.1f%% of the %.2f GiB of device memory, %.2f GiB taken from the first (by its chunks), in %.2fs (issue 36: at most 15%%%s): %s" % (
                d["location"], d["second_kept_bytes"] / 2**30, 100 * d["second_kept_share"], d["second_allocated_bytes"] / 2**30,
                d["second_earlier_bytes"] / 2**30, d["second_seconds"], ", 1.2s into tmpfs" if tm else "", "met" if met else "NOT MET"))
            print("          dedup (%s): the second's steps: %s" % (d["location"], ", ".join("%s %.3fs" % (k, v) for k, v in d.get("second_vram_phases", {}).items())))
    mw = r.get("memwatch") or {}
    if mw:
        wb = r.get("written_bytes", 0)
        dw = r.get("device_written_bytes", 0)
        print("          host memory: peak +%.2f GiB, +%.2f GiB less the archive's file system%s%s" % (
            mw.get("peak_used_delta", 0) / 2**30, mw.get("peak_used_less_dest_delta", 0) / 2**30,
            (" = %.2fx the written %.2f GiB; stored %.2fx the written" % (mw.get("peak_used_less_dest_delta", 0) / wb, wb / 2**30,
             r.get("stored_bytes", 0) / wb)) if wb else "",
            # The zero scan's count: every non-zero block of device
            # memory, the framework's own (workspaces, graphs) too.
            ("; stored %.2fx the %.2f GiB of device memory the scan found written" % (r.get("stored_bytes", 0) / dw, dw / 2**30)) if dw else ""))
    if r.get("note"):
        print("          note: " + r["note"])
    if r.get("pull_pages_seconds"):
        print("          pages read + decoded into a pipe to /dev/null (no CRIU): %.2fs" % r["pull_pages_seconds"])
import statistics
def med(kind, key):
    v = [r[key] for r in rows if r.get("ok") and r["round"].split("-")[0] == kind and r.get(key)]
    return (statistics.median(v), len(v)) if v else (0, 0)
print()
for kind in ("baseline", "auto", "lz4", "none", "fast", "fastexp", "fastleave", "fasttree", "fastsuspend", "tree", "migrate",
             "remap", "remapfast", "span", "spanfast", "spanswap", "spanswapfast", "migrateremap", "nccl"):
    (c, n), (rs, _) = med(kind, "checkpoint_total"), med(kind, "restore_total")
    if n and kind.startswith("migrate"):
        print("median of %d %-8s: downtime   %6.2fs (checkpoint to restored, GPU included)" % (n, kind, c))
    elif n:
        print("median of %d %-8s: checkpoint %6.2fs  restore %6.2fs" % (n, kind, c, rs))
EOF
}
trap 'log "interrupted"; finish 130' INT TERM

log "gpucr-stream GPU e2e: rounds [$ROUNDS], $GIB_RANDOM GiB random fp32 + $GIB_WEIGHTS GiB bf16 weights on $DEVICE, work $WORK"
[ -x "$GCS" ] || die "no gpucr-stream binary at $GCS (make build)"
[ -n "${CRIU:-}" ] || die "no criu (set CRIU, or put the prefix from scripts/install-criu.sh in .cache/criu)"
{
	uname -a
	"$GCS" version
	"$CRIU" --version
	"$CRIU" check 2>&1 | tail -3
	nproc
	free -g | head -2
	df -h "$WORK" | tail -1
	if [ "$DEVICE" = cuda ]; then
		nvidia-smi --query-gpu=name,uuid,driver_version,memory.total,memory.used --format=csv,noheader
		"$GCS" gpu info
	fi
	"$PY" -c 'import torch; print("torch", torch.__version__, "cuda devices", torch.cuda.device_count() if torch.cuda.is_available() else 0)'
} 2>&1 | tee -a "$RUNLOG"
GPU_UUIDS=()
[ "$DEVICE" = cuda ] && mapfile -t GPU_UUIDS < <(nvidia-smi --query-gpu=uuid --format=csv,noheader)
NGPU=${#GPU_UUIDS[@]}
log "GPUs: $NGPU${NGPU:+ (${GPU_UUIDS[*]})}"

# two_gpu ROUND: whether the round needs two GPUs.
two_gpu() {
	case ${1%%-*} in remap | remapfast | span | spanfast | spanswap | spanswapfast | migrateremap | badmap | nccl | ncclfault | ncclfast | ncclfastswap | ncclp2p | ncclp2pswap | ncclp2pmigrate | ncclp2pfault | ncclp2ptp) return 0 ;; esac
	return 1
}

# gpu_mem PID: "MiB-on-GPU0 MiB-on-GPU1 ..." nvidia-smi shows for the
# process (0 where none).
gpu_mem() {
	local i out=() m
	for i in "${!GPU_UUIDS[@]}"; do
		m=$(nvidia-smi --query-compute-apps=pid,gpu_uuid,used_memory --format=csv,noheader,nounits |
			awk -F', ' -v p="$1" -v u="${GPU_UUIDS[$i]}" '$1 == p && $2 == u { s += $3 } END { print s + 0 }')
		out+=("$m")
	done
	echo "${out[*]}"
}

# check_placement LABEL BEFORE AFTER: the GPU memory of the target moved as
# the round says (remap: all of GPU 0's onto GPU 1; span: on both again;
# spanswap: each GPU's onto the other, within 10% or 600 MiB).
check_placement() {
	local label=$1 b=($2) a=($3)
	local verdict
	verdict=$(awk -v r="${ROUND%%-*}" -v b0="${b[0]}" -v b1="${b[1]}" -v a0="${a[0]}" -v a1="${a[1]}" 'function near(x, y) { d = x - y; if (d < 0) d = -d; return d <= 600 || d <= 0.1 * y }
	BEGIN {
		if (r ~ /^remap|^migrateremap/) ok = b0 > 0 && b1 == 0 && a0 == 0 && a1 > 0
		else if (r ~ /^spanswap/) ok = b0 > 0 && b1 > 0 && near(a0, b1) && near(a1, b0)
		else if (r ~ /^ncclfastswap|^ncclp2pswap/) ok = b0 + b1 > 0 && near(a0, b1) && near(a1, b0)
		else if (r ~ /^span/) ok = a0 > 0 && a1 > 0 && near(a0, b0) && near(a1, b1)
		else ok = 1
		print ok ? "ok" : "WRONG"
	}')
	log "$label: GPU memory of $TPID in MiB per GPU: before [${b[*]}], after [${a[*]}]: $verdict"
	[ "$verdict" = ok ]
}

# remap_spec: the --gpu-map of the round (empty: none).
remap_spec() {
	case ${ROUND%%-*} in
	remap | remapfast | migrateremap) echo "${GPU_UUIDS[0]}=${GPU_UUIDS[1]}" ;;
	spanswap | spanswapfast | ncclfastswap | ncclp2pswap) echo "${GPU_UUIDS[0]}=${GPU_UUIDS[1]},${GPU_UUIDS[1]}=${GPU_UUIDS[0]}" ;;
	esac
}

# start_target ROUND [CHILDREN]: a fresh target in its own session (with
# CHILDREN CUDA children in it); sets TPID, TDIR, TCHILDREN, TCUDA (the
# CUDA processes of the tree), TPGID, TSID.
start_target() {
	TDIR=$WORK/t-$1
	TCHILDREN=${2:-0}
	TCUDA=$((1 + TCHILDREN))
	rm -rf "$TDIR"
	mkdir -p "$TDIR"
	local t0 kids=() pre=()
	[ "$TCHILDREN" -gt 0 ] && kids=(--children "$TCHILDREN" --child-mib "$TREE_CHILD_MIB")
	# Fast rounds: the target runs with libgpucr-preload.
	case ${1%%-*} in
	fast | fastleave | fasttree | fastsuspend | fastfault | migratefast | remapfast | spanfast | spanswapfast | dedupfast | dedupreplicas | fastexit | devhash | inferfast | inferfastcache) pre=(env "$GCS" run --) ;;
	fastexp) pre=(env PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True "$GCS" run --) ;;
	ncclfast | ncclfastswap) pre=(env NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 "$GCS" run --) ;;
	ncclp2p | ncclp2pswap | ncclp2pmigrate | ncclp2pfault | ncclp2ptp) pre=(env "$GCS" run --) ;;
	esac
	local script=torch_target.py args=(--device "$DEVICE" --gib-random "$GIB_RANDOM" --gib-weights "$GIB_WEIGHTS" --side "$SIDE" --rewrite-pct "$REWRITE_PCT" "${kids[@]}")
	case ${1%%-*} in
	span | spanfast | spanswap | spanswapfast) args+=(--devices 0,1) ;;
	nccl | ncclfault | ncclfast | ncclfastswap | ncclp2p | ncclp2pswap | ncclp2pmigrate | ncclp2pfault | ncclp2ptp)
		script=nccl_pair.py args=(--mib "$NCCL_MIB" --period "$NCCL_PERIOD")
		[ "${1%%-*}" = ncclp2ptp ] && args+=(--tp-layers "${TP_LAYERS:-4}")
		TCHILDREN=1 TCUDA=2
		# X-launched: torchrun's layout, a launcher holding no GPU with both
		# ranks as its children (rank 1 child 0, rank 0 child 1).
		case $1 in *-launched*) args+=(--launch) TCHILDREN=2 ;; esac
		;;
	infer | inferfast | inferfastcache)
		script=infer_target.py args=(--device "$DEVICE" --gib-weights "$GIB_WEIGHTS" --side "$SIDE"
			--kv-fraction "$KV_FRACTION" --kv-written-pct "$KV_WRITTEN_PCT" ${KV_GIB:+--kv-gib "$KV_GIB"})
		[ "${1%%-*}" = inferfastcache ] && args+=(--cache-marked)
		;;
	esac
	case ${1%%-*} in
	ctr | ctrfast | ctrfastlib | ctrfastmigrate)
		start_container "$1" "$script" "${args[@]}"
		return
		;;
	esac
	t0=$(now)
	# A round named X-reaped starts the target under e2e/gpu/reaper.py,
	# which reaps its orphans at once (this host's init takes 1.5-1.9 s).
	local session=(setsid)
	case $1 in *-reaped*) session=("$PY" "$ROOT/e2e/gpu/reaper.py") ;; esac
	# oneDNN must not use AMX on the CPU side: CRIU 4.1 does not restore a
	# process's AMX permission (arch_prctl ARCH_REQ_XCOMP_PERM), and the
	# restored process dies of SIGILL at its next AMX instruction.
	ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 DNNL_MAX_CPU_ISA=AVX512_CORE_BF16 \
		NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
		"${session[@]}" "${pre[@]}" "$PY" "$ROOT/e2e/gpu/$script" --dir "$TDIR" "${args[@]}" \
		</dev/null >>"$TDIR/target.out" 2>&1 &
	TPID=$!
	local waited=0
	while [ ! -s "$TDIR/ready" ]; do
		sleep 0.2
		waited=$((waited + 1))
		if [ $waited -gt 1500 ] || ! kill -0 "$TPID" 2>/dev/null && [ ! -s "$TDIR/ready" ]; then
			tail -20 "$TDIR/target.out" | tee -a "$RUNLOG"
			kill_tree "$TPID" "$TDIR"
			return 1
		fi
	done
	TPID=$(cat "$TDIR/ready")
	read -r _ TPGID TSID <<<"$(proc_ids "$TPID")"
	log "target $TPID (process group $TPGID, session $TSID) ready in $(since "$t0")s: $(tail -1 "$TDIR/target.out")"
	if [ "$TCHILDREN" -gt 0 ]; then
		check_tree "start" || log "start: the tree is not one session and group led by the target"
	fi
	if [ "$DEVICE" = cuda ]; then
		nvidia-smi --query-compute-apps=pid,gpu_uuid,used_memory --format=csv,noheader | tee -a "$RUNLOG"
		[ "$NGPU" -ge 2 ] && PLACED=$(gpu_mem "$TPID")
		[ "$NGPU" -ge 2 ] && [ -s "$TDIR/ready-child-0" ] && PLACED1=$(gpu_mem "$(cat "$TDIR/ready-child-0")")
		local p
		for p in $(tree_pids); do
			log "cuda state of $p: $("$GCS" gpu state --pid "$p" 2>&1)"
		done
	fi
}

# check_tree LABEL: log the target tree (pid/parent/group/session) and
# check that it is whole and the one that was started: the target leads
# the same process group and session (CRIU restores both), every child is
# the target's child in them.
check_tree() {
	local label=$1 p ids ppid pgid sid line="" bad=""
	for p in $(tree_pids); do
		if ! ids=$(proc_ids "$p"); then
			line+=" $p:gone"
			bad+=" $p gone;"
			continue
		fi
		read -r ppid pgid sid <<<"$ids"
		line+=" $p/$ppid/$pgid/$sid"
		[ "$pgid" = "$TPGID" ] && [ "$sid" = "$TSID" ] || bad+=" $p in group $pgid, session $sid (not $TPGID, $TSID);"
		[ "$p" = "$TPID" ] || [ "$ppid" = "$TPID" ] || bad+=" $p has parent $ppid (not $TPID);"
	done
	log "$label: tree pid/parent/group/session:$line${bad:+; WRONG:$bad}"
	[ -z "$bad" ]
}

# prove LABEL: ask the target for a proof; sets COUNTER; fails if the proof
# is bad.
prove() {
	local label=$1 t0
	t0=$(now)
	rm -f "$TDIR/proof.json"
	kill -USR1 "$TPID" 2>/dev/null || {
		log "prove $label: target $TPID is gone"
		return 1
	}
	local waited=0
	while [ ! -s "$TDIR/proof.json" ]; do
		sleep 0.1
		waited=$((waited + 1))
		if [ $waited -gt 1800 ]; then
			log "prove $label: no proof after 180s"
			return 1
		fi
	done
	cp "$TDIR/proof.json" "$WORK/logs/proof-$ROUND-$label.json"
	local verdict
	verdict=$(python3 -c '
import json, sys
p = json.load(open(sys.argv[1]))
want = int(sys.argv[2])
ok = p["checksums_ok"] and p["matmul_ok"] and not p["error"]
d = {k: p[k] for k in ("tensors", "tensor_bytes", "mismatched", "error", "verify_seconds")}
if "kv" in p:
    d["kv"] = p["kv"]
kids = p.get("children", [])
if want or kids:
    # pid:counter:ok of every child
    d["children"] = " ".join("%d:%d:%s" % (c["pid"], c["counter"], "ok" if c["ok"] else "BAD") for c in kids)
    if len(kids) != want or not all(c["ok"] for c in kids):
        ok = False
        if len(kids) != want:
            d["error"] = (d["error"] + "; " if d["error"] else "") + "%d children in the proof, want %d" % (len(kids), want)
print("%s %d %s" % ("ok" if ok else "BAD", p["counter"], json.dumps(d)))
' "$TDIR/proof.json" "$TCHILDREN")
	COUNTER=$(echo "$verdict" | awk '{print $2}')
	PROOF_KV=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1])).get("kv", ""))' "$TDIR/proof.json")
	log "proof $label ($(since "$t0")s): $verdict"
	[ "${verdict%% *}" = ok ]
}

# wait_gone PID: until the pid has left /proc (criu restore needs it free).
wait_gone() {
	local i=0
	while [ -e "/proc/$1" ]; do
		wait "$1" 2>/dev/null
		sleep 0.05
		i=$((i + 1))
		[ $i -gt 1200 ] && return 1
	done
	return 0
}

# wait_dead PID: until the pid is dead (gone, or a zombie), at most 10s.
wait_dead() {
	local i=0 s
	while s=$(cat "/proc/$1/stat" 2>/dev/null); do
		s=${s##*) }
		case ${s:0:1} in Z | X) return 0 ;; esac
		sleep 0.05
		i=$((i + 1))
		[ $i -gt 200 ] && return 1
	done
	return 0
}

# wait_tree_gone LABEL: until the dumped tree has left /proc (criu restore
# needs all its pids free); says which pids are still there.
wait_tree_gone() {
	local p
	for p in $(tree_pids); do
		wait_gone "$p" || log "$1: pid $p still there$([ "$p" != "$TPID" ] && echo " (a child: reparented to init when the target died; not reaped yet)")"
	done
}

# cuda_count JSON: how many CUDA processes a checkpoint or migrate result
# lists (cuda_pids).
cuda_count() {
	python3 -c 'import json, sys; print(len(json.load(open(sys.argv[1])).get("cuda_pids") or []))' "$1" 2>/dev/null || echo 0
}

# keep_log SRC DST: CRIU's -v4 logs of a 10 GB process are large; keep
# every error line and the tail.
keep_log() {
	[ -f "$1" ] || return 0
	{
		grep -n "Error\|Warn" "$1" | tail -200
		echo "--- pages"
		grep -n "pages-\|pagemap\|nr_restored\|Restore finished\|Dumping finished\|Forking\|Opening image" "$1" | grep -v " Read \| pages$" | head -100
		echo "--- tail"
		tail -n 1500 "$1"
	} >"$2" 2>/dev/null
	[ -z "${FULL_LOGS:-}" ] || cp "$1" "$2.full"
}

crit_errors() { grep -h "Error" "$@" 2>/dev/null | grep -v RLIMIT_NOFILE | tail -8 | tee -a "$RUNLOG"; }

# result JSON fields, assembled per round
emit() { echo "$1" >>"$RESULTS"; }

round_baseline() {
	local img=$WORK/img t0 tl tc td tr tg note=""
	rm -rf "$img"
	mkdir -p "$img"
	local lock=0 ckpt=0 grst=0 unl=0
	if [ "$DEVICE" = cuda ]; then
		"$GCS" gpu suspend --pid "$TPID" --json >"$WORK/logs/baseline-suspend.json" 2>&1 || {
			cat "$WORK/logs/baseline-suspend.json" | tee -a "$RUNLOG"
			return 1
		}
		lock=$(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(sum(p["seconds"] for p in d.get("phases",[]) if p["name"]=="gpu lock"))' "$WORK/logs/baseline-suspend.json")
		ckpt=$(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(sum(p["seconds"] for p in d.get("phases",[]) if p["name"]=="gpu checkpoint"))' "$WORK/logs/baseline-suspend.json")
	fi
	t0=$(now)
	if ! "$CRIU" dump -D "$img" -t "$TPID" -o dump.log -v4 $CRIU_OPTS >"$WORK/logs/baseline-criu-dump.out" 2>&1; then
		keep_log "$img/dump.log" "$WORK/logs/baseline-dump.log"
		log "baseline: criu dump failed"
		DUMP_FAILED=1
		crit_errors "$img/dump.log"
		[ "$DEVICE" = cuda ] && "$GCS" gpu resume --pid "$TPID" 2>&1 | tee -a "$RUNLOG"
		return 1
	fi
	td=$(since "$t0")
	t0=$(now)
	sync
	local tsync
	tsync=$(since "$t0")
	local raw
	raw=$(du -sb "$img" | awk '{print $1}')
	keep_log "$img/dump.log" "$WORK/logs/baseline-dump.log"
	wait_gone "$TPID" || log "baseline: pid $TPID still there"
	t0=$(now)
	if ! "$CRIU" restore -D "$img" --restore-detached -o restore.log -v4 $CRIU_OPTS >"$WORK/logs/baseline-criu-restore.out" 2>&1; then
		keep_log "$img/restore.log" "$WORK/logs/baseline-restore.log"
		log "baseline: criu restore failed"
		crit_errors "$img/restore.log"
		return 1
	fi
	tr=$(since "$t0")
	keep_log "$img/restore.log" "$WORK/logs/baseline-restore.log"
	if [ "$DEVICE" = cuda ]; then
		"$GCS" gpu resume --pid "$TPID" --json >"$WORK/logs/baseline-resume.json" 2>&1 || {
			cat "$WORK/logs/baseline-resume.json" | tee -a "$RUNLOG"
			return 1
		}
		grst=$(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(sum(p["seconds"] for p in d.get("phases",[]) if p["name"]=="gpu restore"))' "$WORK/logs/baseline-resume.json")
		unl=$(python3 -c 'import json,sys; d=json.load(open(sys.argv[1])); print(sum(p["seconds"] for p in d.get("phases",[]) if p["name"]=="gpu unlock"))' "$WORK/logs/baseline-resume.json")
	fi
	local ok=false
	local before=$COUNTER
	if prove after && [ "$COUNTER" -gt "$before" ]; then
		sleep 1
		local c1=$COUNTER
		prove again && [ "$COUNTER" -gt "$c1" ] && ok=true
	fi
	rm -rf "$img"
	emit "$(python3 -c '
import json, sys
a = sys.argv
lock, ckpt, dump, sync, rst, grst, unl, raw = map(float, a[2:10])
print(json.dumps({"round": "baseline", "ok": a[1] == "true", "raw_bytes": int(raw), "stored_bytes": int(raw),
  "phases": {"lock": lock, "gpu_checkpoint": ckpt, "dump": dump, "sync": sync, "criu_restore": rst, "gpu_restore": grst, "unlock": unl},
  "checkpoint_total": lock + ckpt + dump, "restore_total": rst + grst + unl,
  "note": "criu dump -D to local disk (no fsync; a sync after it took %.2fs)" % sync}))
' "$ok" "$lock" "$ckpt" "$td" "$tsync" "$tr" "$grst" "$unl" "$raw")"
	$ok
}

# dense_env: the words that run a restore of a -dense round with every
# zero page handed to CRIU (nothing for other rounds).
dense_env() {
	case $ROUND in *-dense) echo env GPUCR_NO_SPARSE=1 ;; esac
}

# round_criu_opts: CRIU_OPTS, and for the nccl rounds --tcp-established
# (the ranks talk over loopback TCP, NCCL's bootstrap, inside the tree:
# CRIU refuses the connected sockets without it).
round_criu_opts() {
	local o=$CRIU_OPTS
	case ${ROUND%%-*} in nccl | ncclfault | ncclfast | ncclfastswap | ncclp2p*) o="${o:+$o }--tcp-established" ;; esac
	echo "$o"
}

# round_gcs CODEC [leave]: checkpoint into an archive, restore from it.
round_gcs() {
	local codec=$1 leave=${2:-} ar=$WORK/ar-$ROUND t0 tck trs
	rm -rf "$ar" "$WORK/w" "$WORK/w2"
	mkdir -p "$WORK/w" "$WORK/w2"
	local extra=()
	[ -n "$leave" ] && extra+=(--leave-running)
	local co
	co=$(round_criu_opts)
	[ -n "$co" ] && extra+=(--criu-opts "$co")
	case $ROUND in *fast* | ncclp2p*) extra+=(${VRAM_KEEP_DIR:+--vram-keep-dir "$VRAM_KEEP_DIR"} ${VRAM_FILES:+--vram-files "$VRAM_FILES"}) ;; esac
	# The host memory the checkpoint takes, less what the archive's file
	# system gains (memwatch.py).
	local mw=$WORK/logs/$ROUND-memwatch.json mwpid
	rm -f "$mw"
	"$PY" "$ROOT/e2e/gpu/memwatch.py" --out "$mw" --dest "$WORK" &
	mwpid=$!
	t0=$(now)
	"$GCS" checkpoint --pid "$TPID" --to "$ar" --codec "$codec" --work-dir "$WORK/w" --criu "$CRIU" \
		--json "${extra[@]}" >"$WORK/logs/$ROUND-checkpoint.json" 2>"$WORK/logs/$ROUND-checkpoint.err"
	local ckrc=$?
	kill -TERM "$mwpid" 2>/dev/null
	wait "$mwpid" 2>/dev/null
	[ -s "$mw" ] && log "$ROUND: host memory during the checkpoint: $(cat "$mw")"
	if [ $ckrc -ne 0 ]; then
		log "$ROUND: checkpoint failed (exit $ckrc): $(tail -c 3000 "$WORK/logs/$ROUND-checkpoint.err")"
		emit "$(python3 -c '
import json, sys
try:
    mw = json.load(open(sys.argv[3]))
except (OSError, ValueError):
    mw = {}
print(json.dumps({"round": sys.argv[1], "ok": False, "note": "checkpoint failed: " + open(sys.argv[2]).read()[-400:], "memwatch": mw}))
' "$ROUND" "$WORK/logs/$ROUND-checkpoint.err" "$mw")"
		DUMP_FAILED=1
		keep_log "$WORK/w/img/dump.log" "$WORK/logs/$ROUND-dump.log"
		crit_errors "$WORK/w/img/dump.log"
		if grep -q "undoing the GPU step of .* failed too" "$WORK/logs/$ROUND-checkpoint.err"; then
			# The driver did not give the processes their GPU back: they
			# stay checkpointed and would never answer a proof.
			log "$ROUND: the GPU step could not be undone: the target is stuck, no proof asked"
			return 1
		fi
		# The undo must have left the target running with its memory intact.
		prove after-failed-checkpoint
		return 1
	fi
	tck=$(since "$t0")
	keep_log "$WORK/w/img/dump.log" "$WORK/logs/$ROUND-dump.log"
	log "$ROUND: checkpoint in ${tck}s: $(cat "$WORK/logs/$ROUND-checkpoint.json")"
	"$GCS" inspect "$ar" >"$WORK/logs/$ROUND-inspect.txt" 2>&1
	head -12 "$WORK/logs/$ROUND-inspect.txt" | tee -a "$RUNLOG"
	# Every CUDA process of the tree must have been checkpointed.
	local ncuda want=$TCUDA cuda_ok=true
	ncuda=$(cuda_count "$WORK/logs/$ROUND-checkpoint.json")
	log "$ROUND: cuda_pids: $ncuda CUDA process(es) checkpointed, want $want (of the target and its $TCHILDREN children)"
	if [ "$DEVICE" = cuda ] && [ "$ncuda" != "$want" ]; then
		log "$ROUND: cuda_pids has $ncuda entries, want $want: the round fails"
		cuda_ok=false
	fi
	case $ROUND in *fast* | ncclp2p*)
		if [ "$DEVICE" = cuda ] && ! grep -q '"vram copy out"' "$WORK/logs/$ROUND-checkpoint.json"; then
			log "$ROUND: the checkpoint did not take the fast path: the round fails ($(tail -c 600 "$WORK/logs/$ROUND-checkpoint.err"))"
			cuda_ok=false
		fi
		;;
	esac
	local tpull=0
	if [ -z "$leave" ] && [ "${PULL_BENCH:-1}" = 1 ]; then
		# How fast the archive is read and decoded into a pipe whose reader
		# is quick (vram pull to /dev/null), next to criu restore reading
		# the same file: which side bounds the restore.
		local pb=$WORK/pb
		rm -rf "$pb"
		mkdir -p "$pb"
		"$GCS" --images-dir "$pb" serve --from "$ar" >/dev/null 2>"$WORK/logs/$ROUND-pullbench-serve.err" &
		local sp=$!
		local i=0
		while [ ! -S "$pb/streamer-serve.sock" ] && [ $i -lt 100 ]; do
			sleep 0.05
			i=$((i + 1))
		done
		local big
		big=$(awk '$NF ~ /^pages-.*\.img$/ { print $1, $NF }' "$WORK/logs/$ROUND-inspect.txt" | sort -n | tail -1 | awk '{print $2}')
		t0=$(now)
		if "$GCS" vram pull --images-dir "$pb" "${big:-pages-1.img}" - >/dev/null 2>"$WORK/logs/$ROUND-pullbench.err"; then
			tpull=$(since "$t0")
			log "$ROUND: read + decode of ${big:-pages-1.img} into a pipe (vram pull > /dev/null): ${tpull}s"
		else
			log "$ROUND: pull bench failed: $(cat "$WORK/logs/$ROUND-pullbench.err")"
		fi
		kill "$sp" 2>/dev/null
		wait "$sp" 2>/dev/null
		rm -rf "$pb"
	fi
	local stored
	stored=$(du -sb "$ar" | awk '{print $1}')
	local ok=false note="" restore_json="{}" trs=0
	if [ -n "$leave" ]; then
		# The process must have run on, its GPU state back.
		local before=$COUNTER
		if prove after-leave-running && [ "$COUNTER" -gt "$before" ]; then
			sleep 1
			local c1=$COUNTER
			prove again && [ "$COUNTER" -gt "$c1" ] && ok=true
		fi
		note="--leave-running: no restore; the target ran on"
	else
		wait_tree_gone "$ROUND"
		local rextra=()
		local spec
		spec=$(remap_spec)
		if [ -n "$spec" ]; then
			rextra+=(--gpu-map "$spec")
			note="restored with --gpu-map $spec"
		elif [ "$ROUND" = "$GPU_MAP_ROUND" ] && [ "$DEVICE" = cuda ]; then
			local uuid
			uuid=$(nvidia-smi --query-gpu=uuid --format=csv,noheader | head -1)
			rextra+=(--gpu-map "all=$uuid")
			note="restored with --gpu-map all=$uuid (onto the same GPU)"
		fi
		[ -n "$co" ] && rextra+=(--criu-opts "$co")
		# A round named X-nostage restores X's checkpoint with nothing
		# staged in memory while CRIU restores: the copy in reads the
		# archive, as before staging.
		case $ROUND in *-nostage) rextra+=(--stage-memory none) ;; esac
		t0=$(now)
		if ! $(dense_env) "$GCS" restore --from "$ar" --work-dir "$WORK/w2" --criu "$CRIU" --json "${rextra[@]}" \
			>"$WORK/logs/$ROUND-restore.json" 2>"$WORK/logs/$ROUND-restore.err"; then
			log "$ROUND: restore failed: $(tail -c 3000 "$WORK/logs/$ROUND-restore.err")"
			keep_log "$WORK/w2/img/restore.log" "$WORK/logs/$ROUND-restore.log"
			crit_errors "$WORK/w2/img/restore.log"
			if [ -e "/proc/$TPID" ] && [ "$DEVICE" = cuda ]; then
				# On the fast path the device memory comes from the archive too.
				local from=()
				case $ROUND in *fast* | ncclp2p*) from=(--from "$ar") ;; esac
				log "$ROUND: restored process $TPID is there; resuming its GPU state without --gpu-map"
				"$GCS" gpu resume --pid "$TPID" "${from[@]}" 2>&1 | tee -a "$RUNLOG"
				note="$note; RESTORE FAILED, resumed by gpu resume: $(tail -c 300 "$WORK/logs/$ROUND-restore.err" | tr '\n"' '  ')"
			else
				return 1
			fi
		fi
		trs=$(since "$t0")
		keep_log "$WORK/w2/img/restore.log" "$WORK/logs/$ROUND-restore.log"
		log "$ROUND: restore in ${trs}s: $(cat "$WORK/logs/$ROUND-restore.json")"
		restore_json=$(cat "$WORK/logs/$ROUND-restore.json")
		[ -n "$restore_json" ] || restore_json="{}"
		check_tree "$ROUND: after restore"
		local before=$COUNTER
		if prove after && [ "$COUNTER" -gt "$before" ]; then
			sleep 1
			local c1=$COUNTER
			prove again && [ "$COUNTER" -gt "$c1" ] && ok=true
		fi
		local want_kv=
		case ${ROUND%%-*} in
		inferfastcache) want_kv=dropped ;;
		infer*) want_kv=intact ;;
		esac
		if [ -n "$want_kv" ] && [ "$PROOF_KV" != "$want_kv" ]; then
			ok=false
			note="${note:+$note; }KV cache after the restore: ${PROOF_KV:-?}, want $want_kv"
		fi
		if two_gpu "$ROUND" && ! check_placement "$ROUND: after restore" "$PLACED" "$(gpu_mem "$TPID")"; then
			ok=false
			note="${note:+$note; }GPU memory not where the map puts it"
		fi
		if case ${ROUND%%-*} in ncclfastswap | ncclp2pswap) true ;; *) false ;; esac && ! check_placement "$ROUND: rank 1 after restore" "$PLACED1" "$(gpu_mem "$(cat "$TDIR/ready-child-0")")"; then
			ok=false
			note="${note:+$note; }rank 1's GPU memory not where the map puts it"
		fi
		[ -s "$TDIR/target.out" ] && grep -a "gpucr-preload" "$TDIR/target.out" | tail -5 | tee -a "$RUNLOG"
	fi
	if ! $cuda_ok; then
		ok=false
		note="${note:+$note; }cuda_pids has $ncuda entries, want $want"
	fi
	emit "$(python3 -c '
import json, sys
rnd, codec, ok, stored, note, tpull = sys.argv[1:6] + sys.argv[8:9]
ncuda, children = int(sys.argv[9]), int(sys.argv[10])
def load(path):
    try:
        return json.load(open(path))
    except (OSError, ValueError):
        return {}
mw, tinfo = load(sys.argv[11]), load(sys.argv[12]).get("info", {})
ck = json.load(open(sys.argv[6]))
rs = json.loads(sys.argv[7])
ph = {p["name"]: p["seconds"] for p in ck.get("phases", [])}
rp = {p["name"]: p["seconds"] for p in rs.get("phases", [])}
phases = {"lock": ph.get("gpu lock", 0), "gpu_checkpoint": ph.get("gpu checkpoint", 0),
  "dump": ph.get("criu dump + encode + write", 0), "commit": ph.get("commit", 0),
  "criu_restore": rp.get("criu restore + read + decode", 0), "gpu_restore": rp.get("gpu restore", 0) or ph.get("gpu restore", 0),
  "unlock": rp.get("gpu unlock", 0) or ph.get("gpu unlock", 0),
  "vram_park": ph.get("vram park", 0), "vram_zero_scan": ph.get("vram zero scan", 0), "vram_copy_out": ph.get("vram copy out", 0), "vram_release": ph.get("vram release", 0),
  "vram_store": ph.get("vram store (beside the dump)", 0),
  "vram_remap": rp.get("vram remap", 0), "vram_copy_in": rp.get("vram copy in", 0), "vram_refill": ph.get("vram refill", 0)}
print(json.dumps({"round": rnd, "codec": codec, "ok": ok == "true", "raw_bytes": ck.get("raw_bytes", 0),
  "stored_bytes": ck.get("stored_bytes", 0), "archive_bytes_on_disk": int(stored), "phases": phases,
  "checkpoint_total": ck.get("total_seconds", 0), "restore_total": rs.get("total_seconds", 0),
  "gpus": ck.get("gpus"), "cuda_pids": ck.get("cuda_pids"), "cuda_pids_count": ncuda, "children": children,
  "note": note, "pull_pages_seconds": float(tpull), "gpu_query": ph.get("gpu query (nvidia-smi)", 0),
  "vram_detail": {k: v for d in (ph, rp) for k, v in d.items() if k.startswith(("vram copy out:", "vram copy in:", "vram stage"))},
  "restore_steps": [[p["name"], p["seconds"]] for p in rs.get("phases", []) if ":" not in p["name"]],
  "memwatch": mw, "written_bytes": tinfo.get("written_bytes", 0), "weights_bytes": tinfo.get("weights_bytes", 0),
  "device_written_bytes": (ck.get("vram") or {}).get("written_bytes", 0),
  "kv_bytes": tinfo.get("kv_bytes", 0)}))
' "$ROUND" "$codec" "$ok" "$stored" "$note" "$WORK/logs/$ROUND-checkpoint.json" "$restore_json" "$tpull" "$ncuda" "$TCHILDREN" "$mw" "$TDIR/checksums.json")"
	rm -rf "$ar"
	$ok
}

# need_hooks says whether GCS_HOOKS is a build with test hooks (its env
# command lists GPUCR_TEST_FAULT); a fault round without one fails, saying
# so, rather than see no fault.
need_hooks() {
	local vars
	vars=$("$GCS_HOOKS" env 2>/dev/null)
	if grep -q '^GPUCR_TEST_FAULT' <<<"$vars"; then
		return 0
	fi
	log "$ROUND: $GCS_HOOKS is not gpucr-stream built with test hooks (make build-testhooks)"
	emit "$(python3 -c 'import json, sys; print(json.dumps({"round": sys.argv[1], "ok": False, "note": "no build with test hooks (make build-testhooks)"}))' "$ROUND")"
	return 1
}

# round_fault: faults after the fast path released the device memory, on
# one target: the store into the checkpoint fails (GPUCR_TEST_FAULT=store),
# CRIU refuses its options after the driver's checkpoint, and gpucr-stream
# is killed (SIGKILL) right after the release (GPUCR_TEST_PAUSE), leaving
# the library to refill on its own. After each the target must run on
# with every tensor intact.
round_fault() {
	local ar=$WORK/ar-$ROUND t0 step rc notes=() ok=true co
	need_hooks || return 1
	local args=(checkpoint --pid "$TPID" --to "$ar" --codec "$FAST_CODEC" --criu "$CRIU" --work-dir "$WORK/w" --json --no-progress)
	co=$(round_criu_opts)
	for step in store criu kill; do
		rm -rf "$ar" "$WORK/w" "$WORK/paused"
		t0=$(now)
		rc=0
		case $step in
		store) GPUCR_TEST_FAULT=store "$GCS_HOOKS" "${args[@]}" ${co:+--criu-opts "$co"} >/dev/null 2>"$WORK/logs/$ROUND-$step.err" || rc=$? ;;
		criu) "$GCS" "${args[@]}" --criu-opts "${co:+$co }--no-such-criu-option" >/dev/null 2>"$WORK/logs/$ROUND-$step.err" || rc=$? ;;
		kill)
			GPUCR_TEST_PAUSE=released:$WORK/paused "$GCS_HOOKS" "${args[@]}" ${co:+--criu-opts "$co"} >/dev/null 2>"$WORK/logs/$ROUND-$step.err" &
			local gp=$! i=0
			while [ ! -e "$WORK/paused" ] && kill -0 "$gp" 2>/dev/null && [ $i -lt 600 ]; do
				sleep 0.1
				i=$((i + 1))
			done
			kill -KILL "$gp" 2>/dev/null
			wait "$gp" 2>/dev/null || rc=$?
			[ -e "$WORK/paused" ] || rc=0 # it never paused: a failure below
			;;
		esac
		local tf
		tf=$(since "$t0")
		log "$ROUND: $step: exit $rc after ${tf}s: $(tail -c 600 "$WORK/logs/$ROUND-$step.err")"
		if [ "$step" = kill ] && [ "$TCHILDREN" -gt 0 ] && [ "${ROUND%%-*}" = ncclp2pfault ]; then
			# Ranks that map each other's memory cannot map it again on
			# their own: they wait for the recovery command they name.
			local p
			for p in $(tree_pids); do log "$ROUND: after kill: $p: $(cat "${GPUCR_PRELOAD_DIR:-/run/gpucr-stream}/preload-$p.status" 2>/dev/null | tail -c 400)"; done
			log "$ROUND: gpu resume --pid $TPID: $("$GCS" gpu resume --pid "$TPID" 2>&1 | tail -3 | tr '\n' ' ')"
		fi
		local before=$COUNTER sok=true
		if [ $rc -eq 0 ]; then
			notes+=("$step: the checkpoint did not fail")
			sok=false
		fi
		if ! prove "after-$step" || [ "$COUNTER" -le "$before" ]; then
			notes+=("$step: the target did not run on intact")
			sok=false
		fi
		$sok && notes+=("$step: failed after ${tf}s, the target ran on intact") || ok=false
	done
	emit "$(python3 -c '
import json, sys
print(json.dumps({"round": sys.argv[1], "ok": sys.argv[2] == "true", "note": sys.argv[3]}))
' "$ROUND" "$ok" "$(IFS=';'; echo "${notes[*]}")")"
	rm -rf "$ar"
	$ok
}

# round_suspend: gpu suspend --to an archive (device memory out, released,
# then the driver's lock + checkpoint), the device memory the process holds
# meanwhile, gpu resume --from it; the target proves itself after.
round_suspend() {
	local ar=$WORK/ar-$ROUND t0 ts tr used ok=false
	rm -rf "$ar"
	t0=$(now)
	if ! "$GCS" gpu suspend --pid "$TPID" --to "$ar" --codec "$FAST_CODEC" ${VRAM_KEEP_DIR:+--vram-keep-dir "$VRAM_KEEP_DIR"} ${VRAM_FILES:+--vram-files "$VRAM_FILES"} --json \
		>"$WORK/logs/$ROUND-suspend.json" 2>"$WORK/logs/$ROUND-suspend.err"; then
		log "$ROUND: gpu suspend failed: $(tail -c 2000 "$WORK/logs/$ROUND-suspend.err")"
		prove after-failed-suspend
		return 1
	fi
	ts=$(since "$t0")
	used=$(nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader | awk -F', ' -v p="$TPID" '$1 == p { print $2 }')
	log "$ROUND: suspended in ${ts}s: $(cat "$WORK/logs/$ROUND-suspend.json"); device memory of $TPID now: ${used:-none}"
	sleep 1
	t0=$(now)
	if ! "$GCS" gpu resume --pid "$TPID" --from "$ar" --json >"$WORK/logs/$ROUND-resume.json" 2>"$WORK/logs/$ROUND-resume.err"; then
		log "$ROUND: gpu resume failed: $(tail -c 2000 "$WORK/logs/$ROUND-resume.err")"
		return 1
	fi
	tr=$(since "$t0")
	log "$ROUND: resumed in ${tr}s: $(cat "$WORK/logs/$ROUND-resume.json")"
	local before=$COUNTER
	if prove after && [ "$COUNTER" -gt "$before" ]; then
		sleep 1
		local c1=$COUNTER
		prove again && [ "$COUNTER" -gt "$c1" ] && ok=true
	fi
	emit "$(python3 -c '
import json, sys
s, r = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
ph = {p["name"]: p["seconds"] for p in s.get("phases", [])}
rp = {p["name"]: p["seconds"] for p in r.get("phases", [])}
print(json.dumps({"round": sys.argv[3], "ok": sys.argv[4] == "true", "checkpoint_total": float(sys.argv[5]), "restore_total": float(sys.argv[6]),
  "phases": {"lock": ph.get("gpu lock", 0), "gpu_checkpoint": ph.get("gpu checkpoint", 0), "commit": ph.get("commit", 0),
    "vram_park": ph.get("vram park", 0), "vram_copy_out": ph.get("vram copy out", 0), "vram_release": ph.get("vram release", 0),
    "vram_store": ph.get("vram store (beside the dump)", 0),
    "gpu_restore": rp.get("gpu restore", 0), "unlock": rp.get("gpu unlock", 0), "vram_remap": rp.get("vram remap", 0), "vram_copy_in": rp.get("vram copy in", 0)},
  "memory_released_seconds": s.get("memory_released_seconds", 0), "device_freed_seconds": s.get("device_freed_seconds", 0),
  "note": "gpu suspend --to / resume --from; device memory of the process while suspended: %s" % sys.argv[7]}))
' "$WORK/logs/$ROUND-suspend.json" "$WORK/logs/$ROUND-resume.json" "$ROUND" "$ok" "$ts" "$tr" "${used:-none}")"
	rm -rf "$ar"
	$ok
}

# free_port: a TCP port on 127.0.0.1 that nothing listens on now.
free_port() {
	python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

# start_receiver OUT ERR CMD...: runs CMD, a gpucr-stream receive, in the
# background as RECV_PID, its output in OUT and ERR, and waits until it
# listens; if it does not, it is stopped and the round fails.
start_receiver() {
	local out=$1 err=$2 i=0
	shift 2
	"$@" >"$out" 2>"$err" &
	RECV_PID=$!
	until grep -q "receive: listening on" "$err" 2>/dev/null; do
		if ! kill -0 "$RECV_PID" 2>/dev/null || [ $i -gt 300 ]; then
			log "$ROUND: the receiver did not start listening: $(tail -c 2000 "$err")"
			stop_receiver 0
			return 1
		fi
		sleep 0.1
		i=$((i + 1))
	done
}

# stop_receiver SECONDS: wait that long for the receiver (RECV_PID) to
# finish, then kill it; sets RECV_RC.
stop_receiver() {
	local i=0
	RECV_RC=0
	[ -n "$RECV_PID" ] || return 0
	while kill -0 "$RECV_PID" 2>/dev/null && [ $i -lt $(($1 * 10)) ]; do
		sleep 0.1
		i=$((i + 1))
	done
	if kill -0 "$RECV_PID" 2>/dev/null; then
		log "$ROUND: receiver $RECV_PID still running after ${1}s: killing it"
		kill "$RECV_PID" 2>/dev/null
		sleep 1
		kill -9 "$RECV_PID" 2>/dev/null
	fi
	wait "$RECV_PID"
	RECV_RC=$?
	RECV_PID=
}

# round_migrate [fast]: live migration on this host over loopback. A
# receiver (receive --restore) listens on 127.0.0.1; migrate --pid sends the
# target to it; the receiver restores it with the same PID (one PID
# namespace). Downtime: from the start of the dump (the fast path's park, or
# the GPU lock) to the receiver's report that the process runs (GPU
# restored and unlocked, device memory copied in). fast: the target runs
# with the library and the migration must take the fast path.
round_migrate() {
	local fast=${1:-} tok=$WORK/token w=$WORK/w w2=$WORK/w2 keep=${MIGRATE_KEEP_DIR:-$WORK}/gpucr-migrate-keep port t0 tm mrc=0 rrc
	[ "$MIGRATE_KEEP_DIR" = none ] && keep=$WORK/gpucr-migrate-keep
	local mj=$WORK/logs/$ROUND-migrate.json me=$WORK/logs/$ROUND-migrate.err
	local rj=$WORK/logs/$ROUND-receive.json re=$WORK/logs/$ROUND-receive.err
	rm -rf "$w" "$w2" "$keep" "$tok"
	mkdir -p "$w" "$w2" "$keep"
	if ! (umask 077 && "$GCS" token >"$tok") || ! chmod 600 "$tok"; then
		log "$ROUND: gpucr-stream token failed"
		return 1
	fi
	port=$(free_port) || {
		log "$ROUND: no free port"
		return 1
	}
	local copts=() mopts=() ropts=() co
	co=$(round_criu_opts)
	[ -n "$co" ] && copts+=(--criu-opts "$co")
	[ -n "$fast" ] && mopts+=(--codec "$FAST_CODEC" ${VRAM_KEEP_DIR:+--vram-keep-dir "$VRAM_KEEP_DIR"} ${VRAM_FILES:+--vram-files "$VRAM_FILES"})
	[ -n "$RECV_SPILL_DIR" ] && ropts+=(--spill-dir "$RECV_SPILL_DIR")
	[ -n "$MIGRATE_STREAMS" ] && mopts+=(--streams "$MIGRATE_STREAMS")
	# X-precopy: migrate --precopy on (device memory sent ahead while the
	# target runs; the final dump sends what changed).
	case $ROUND in *-precopy*) mopts+=(--precopy on) ;; esac
	# X-lazy: the receiver restores with --lazy-pages, CUDA processes
	# included (GPUCR_LAZY_CUDA=1, an experiment).
	local lazy_env=()
	case $ROUND in *-lazy*) ropts+=(--lazy-pages) lazy_env=(env GPUCR_LAZY_CUDA=1) ;; esac
	# While it migrates, the target rewrites REWRITE_PCT percent of its
	# tensor bytes every MIGRATE_REWRITE_EVERY seconds (SIGUSR2), if set.
	local rewriter=
	if [ -n "${MIGRATE_REWRITE_EVERY:-}" ]; then
		(while kill -USR2 "$TPID" 2>/dev/null; do sleep "$MIGRATE_REWRITE_EVERY"; done) &
		rewriter=$!
	fi
	local spec
	spec=$(remap_spec)
	[ -n "$spec" ] && ropts+=(--gpu-map "$spec")
	# shellcheck disable=SC2046 # dense_env's words
	start_receiver "$rj" "$re" $(dense_env) "${lazy_env[@]}" "$GCS" receive --restore --listen "127.0.0.1:$port" --token-file "$tok" \
		--criu "$CRIU" --work-dir "$w2" --json "${copts[@]}" "${ropts[@]}" || return 1
	log "$ROUND: receiver $RECV_PID: $(grep -m1 "receive: listening on" "$re")"
	t0=$(now)
	"$GCS" migrate --pid "$TPID" --to "tcp://127.0.0.1:$port" --token-file "$tok" --criu "$CRIU" --work-dir "$w" \
		${MIGRATE_KEEP_DIR:+--keep-dir "$([ "$MIGRATE_KEEP_DIR" = none ] && echo none || echo "$keep")"} --json "${copts[@]}" "${mopts[@]}" >"$mj" 2>"$me" || mrc=$?
	tm=$(since "$t0")
	[ -n "$rewriter" ] && kill "$rewriter" 2>/dev/null
	# Once migrate has its report, the receiver is about done; after a
	# failed migrate it may still wait for a sender.
	stop_receiver "$([ $mrc -eq 0 ] && echo 120 || echo 15)"
	rrc=$RECV_RC
	keep_log "$w/img/dump.log" "$WORK/logs/$ROUND-dump.log"
	keep_log "$w2/img/restore.log" "$WORK/logs/$ROUND-restore.log"
	log "$ROUND: migrate (exit $mrc) in ${tm}s: $(cat "$mj")"
	log "$ROUND: receive (exit $rrc): $(cat "$rj")"
	if [ $mrc -ne 0 ] || [ $rrc -ne 0 ]; then
		log "$ROUND: migrate stderr: $(tail -c 3000 "$me")"
		log "$ROUND: receive stderr: $(tail -c 3000 "$re")"
		crit_errors "$w/img/dump.log" "$w2/img/restore.log"
	fi
	if [ $mrc -ne 0 ]; then
		if grep -q "keeps running here" "$me"; then
			# criu dump failed: the target must run on, its GPU state back.
			DUMP_FAILED=1
			prove after-failed-migrate
		fi
		log "$ROUND: kept image: $(find "$keep" -type f -printf "%p (%s bytes) " 2>&1)"
		return 1
	fi
	local rpid ncuda want=$TCUDA ok=false note=""
	rpid=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1])).get("restored_pid") or 0)' "$mj" 2>/dev/null || echo 0)
	ncuda=$(cuda_count "$mj")
	log "$ROUND: restored as pid $rpid (was $TPID); cuda_pids: $ncuda CUDA process(es) migrated, want $want"
	if [ "$rpid" != "$TPID" ]; then
		note="restored as pid $rpid, not $TPID"
		# Whatever runs now is what gets proved and killed.
		[ "$rpid" -gt 0 ] && TPID=$rpid
	fi
	if [ "$DEVICE" = cuda ] && [ "$ncuda" != "$want" ]; then
		note="${note:+$note; }cuda_pids has $ncuda entries, want $want"
	fi
	if [ -n "$fast" ] && [ "$DEVICE" = cuda ]; then
		grep -q '"vram copy out"' "$mj" || note="${note:+$note; }migrate did not take the fast path ($(grep -m1 "fast path" "$me"))"
		grep -q '"vram copy in"' "$rj" || note="${note:+$note; }the receiver copied no device memory in"
	fi
	check_tree "$ROUND: after migrate"
	local before=$COUNTER
	if prove after && [ "$COUNTER" -gt "$before" ]; then
		sleep 1
		local c1=$COUNTER
		prove again && [ "$COUNTER" -gt "$c1" ] && ok=true
	fi
	if two_gpu "$ROUND" && ! check_placement "$ROUND: after migrate" "$PLACED" "$(gpu_mem "$TPID")"; then
		note="${note:+$note; }GPU memory not where the receiver's map puts it"
	fi
	[ -n "$note" ] && ok=false
	emit "$(python3 -c '
import json, sys
rnd, ok, note, tm, ncuda, children = sys.argv[1], sys.argv[2] == "true", sys.argv[3], float(sys.argv[6]), int(sys.argv[7]), int(sys.argv[8])
def load(path):
    try:
        with open(path) as f:
            return json.loads(f.read().strip() or "{}")
    except (OSError, ValueError):
        return {}
m, r = load(sys.argv[4]), load(sys.argv[5])
mp = {p["name"]: p["seconds"] for p in m.get("phases") or []}
rp = {p["name"]: p["seconds"] for p in r.get("phases") or []}
phases = {}
for key, src, name in (("lock", mp, "gpu lock"), ("gpu_checkpoint", mp, "gpu checkpoint"),
                       ("dump", mp, "criu dump + transfer"), ("commit", mp, "receiver verifies (commit)"),
                       ("criu_restore", rp, "criu restore"), ("gpu_restore", rp, "gpu restore"), ("unlock", rp, "gpu unlock"),
                       ("vram_park", mp, "vram park"), ("vram_copy_out", mp, "vram copy out"), ("vram_release", mp, "vram release"),
                       ("vram_remap", rp, "vram remap"), ("vram_copy_in", rp, "vram copy in")):
    if name in src:
        phases[key] = src[name]
raw, wire, down = m.get("raw_bytes", 0), m.get("wire_bytes", 0), m.get("downtime_seconds", 0)
n = "downtime %.2fs, wire/raw %.3f" % (down, wire / raw if raw else 0)
print(json.dumps({"round": rnd, "ok": ok, "raw_bytes": raw, "stored_bytes": wire, "stream_bytes": m.get("stream_bytes", 0),
  "phases": phases, "checkpoint_total": down, "restore_total": 0, "downtime_seconds": down, "downtime_to": m.get("downtime_to"),
  "migrate_seconds": tm, "migrate_total": m.get("total_seconds", 0), "receive_total": r.get("total_seconds", 0),
  "migrate_phases": mp, "receive_phases": rp, "streams": m.get("streams"), "restored_pid": m.get("restored_pid"),
  "gpus": m.get("gpus"), "cuda_pids": m.get("cuda_pids"), "cuda_pids_count": ncuda, "children": children,
  "note": n + ("; " + note if note else "")}))
' "$ROUND" "$ok" "$note" "$mj" "$rj" "$tm" "$ncuda" "$TCHILDREN")"
	rm -rf "$keep" "$tok"
	$ok
}

# badmap_try LABEL WANT CMD...: gpucr-stream CMD must fail (within 60 s)
# with WANT and the GPU it names in its message; then the target must
# still prove itself. Counts failures in BADMAP_FAILS.
# nccl_running LABEL: both ranks are running for the driver (gpu state);
# logs each.
nccl_running() {
	local p st ok=0
	for p in $(tree_pids); do
		st=$("$GCS" gpu state --pid "$p" 2>&1)
		log "$ROUND: $1: cuda state of $p: $st"
		[ "$st" = running ] || ok=1
	done
	return $ok
}

# rank1_counter: rank 1's step counter in the last proof (0 if none).
rank1_counter() {
	python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["children"][0]["counter"])' "$TDIR/proof.json" 2>/dev/null || echo 0
}

# nccl_proves LABEL: the pair proves itself twice, both ranks' counters
# going on: every tensor checksum, the all_reduce sums (matmul_ok), rank
# 1's proof.
nccl_proves() {
	local before=$COUNTER c1 k0 k1
	prove "$1" && [ "$COUNTER" -gt "$before" ] || return 1
	k0=$(rank1_counter)
	sleep 1
	c1=$COUNTER
	prove "$1-again" && [ "$COUNTER" -gt "$c1" ] || return 1
	k1=$(rank1_counter)
	log "$ROUND: $1: rank 1 counted $k0, then $k1"
	[ "$k1" -gt "$k0" ]
}

# round_nccl: the NCCL pair must be refused before any GPU step
# (checkpoint, gpu suspend), and run on. fault: the ncclfault round (see
# the header).
round_nccl() {
	local fault=${1:-} ar=$WORK/ar-$ROUND notes=() ok=true rc t0 tr co gcs=$GCS
	if [ -n "$fault" ]; then
		need_hooks || return 1
		gcs=$GCS_HOOKS
	fi
	co=$(round_criu_opts)
	local steps=(checkpoint suspend)
	[ -n "$fault" ] && steps=(checkpoint)
	for step in "${steps[@]}"; do
		rm -rf "$ar" "$WORK/w"
		mkdir -p "$WORK/w"
		local err=$WORK/logs/$ROUND-$step.err js=$WORK/logs/$ROUND-$step.json
		local env=() args
		[ -n "$fault" ] && env=(GPUCR_TEST_FAULT=gpu-checkpoint)
		case $step in
		checkpoint) args=(checkpoint --pid "$TPID" --to "$ar" --codec auto --work-dir "$WORK/w" --criu "$CRIU" --criu-opts "$co" --json --no-progress) ;;
		suspend) args=(gpu suspend --pid "$TPID" --json) ;;
		esac
		t0=$(now)
		rc=0
		env "${env[@]}" timeout 300 "$gcs" "${args[@]}" >"$js" 2>"$err" || rc=$?
		tr=$(since "$t0")
		log "$ROUND: $step: exit $rc after ${tr}s: $(tail -c 1500 "$err")"
		if [ $rc -eq 0 ]; then
			notes+=("$step: did not fail")
			ok=false
		elif [ -z "$fault" ] && ! grep -q "is an NCCL rank" "$err"; then
			notes+=("$step: failed, but not with the refusal naming the NCCL ranks")
			ok=false
		elif [ -n "$fault" ] && ! grep -q "could not be locked\|injected gpu-checkpoint failure" "$err"; then
			notes+=("$step: failed, but neither at the lock nor at the injected checkpoint failure")
			ok=false
		else
			notes+=("$step: refused/failed in ${tr}s as it should")
		fi
		if [ -z "$fault" ] && [ -e "$WORK/w/img/dump.log" ]; then
			notes+=("$step: criu ran")
			ok=false
		fi
		if grep -q '"gpu_processes"' "$js" 2>/dev/null; then
			# The undo failed: the states and commands, then the commands.
			log "$ROUND: $step: the GPU step could not be undone: $(cat "$js")"
			notes+=("$step: UNDO FAILED: $(python3 -c 'import json,sys; print(", ".join("%d %s" % (p["pid"], p["state"]) for p in json.load(open(sys.argv[1]))["gpu_processes"]))' "$js")")
			ok=false
			python3 -c 'import json, re, sys
for p in json.load(open(sys.argv[1]))["gpu_processes"]:
    for c in re.findall(r"`gpucr-stream ([^`]*)`", p.get("recover", "")):
        print(c)' "$js" | while read -r c; do
				# shellcheck disable=SC2086 # the command's words
				log "$ROUND: recovery: gpucr-stream $c: $("$GCS" $c 2>&1 | tail -2)"
			done
		fi
		if ! nccl_running "after $step"; then
			notes+=("$step: a rank is not running for the driver")
			ok=false
		fi
		if ! nccl_proves "after-$step"; then
			notes+=("$step: the pair did not prove itself after")
			ok=false
		fi
	done
	emit "$(python3 -c '
import json, sys
print(json.dumps({"round": sys.argv[1], "ok": sys.argv[2] == "true", "note": sys.argv[3]}))
' "$ROUND" "$ok" "$(IFS=';'; echo "${notes[*]}")")"
	rm -rf "$ar"
	$ok
}

badmap_try() {
	local label=$1 want=$2 rc=0 err=$WORK/logs/$ROUND-${1// /_}.err t0
	shift 2
	t0=$(now)
	timeout 60 "$GCS" "$@" >/dev/null 2>"$err" || rc=$?
	local msg
	msg=$(grep -v "^$" "$err" | tail -3 | tr '\n' ' ')
	if [ $rc -ne 0 ] && [ $rc -ne 124 ] && grep -q "$want" "$err"; then
		log "$ROUND: $label: refused (exit $rc) in $(since "$t0")s: $msg"
	else
		log "$ROUND: $label: WRONG: exit $rc, want a failure saying \"$want\": $msg"
		BADMAP_FAILS=$((BADMAP_FAILS + 1))
	fi
	local before=$COUNTER
	prove "after-$label" && [ "$COUNTER" -gt "$before" ] || {
		log "$ROUND: $label: the target does not run on"
		BADMAP_FAILS=$((BADMAP_FAILS + 1))
	}
}

# round_badmap: maps that cannot work fail before CRIU, naming the GPU,
# and the target runs on. A checkpoint --leave-running gives the restores
# an archive (the target keeps its PID, so a restore that got as far as
# CRIU would fail there instead: the message tells which).
round_badmap() {
	local ar=$WORK/ar-$ROUND ghost=GPU-00000000-1111-2222-3333-444444444444 tok=$WORK/token
	BADMAP_FAILS=0
	rm -rf "$ar" "$WORK/w" "$WORK/w2" "$tok"
	mkdir -p "$WORK/w" "$WORK/w2"
	if ! "$GCS" checkpoint --pid "$TPID" --to "$ar" --leave-running --work-dir "$WORK/w" --criu "$CRIU" --json \
		>"$WORK/logs/$ROUND-checkpoint.json" 2>"$WORK/logs/$ROUND-checkpoint.err"; then
		log "$ROUND: checkpoint --leave-running failed: $(tail -c 2000 "$WORK/logs/$ROUND-checkpoint.err")"
		return 1
	fi
	log "$ROUND: checkpoint --leave-running: $(cat "$WORK/logs/$ROUND-checkpoint.json")"
	badmap_try "missing GPU" "not on this host" restore --from "$ar" --work-dir "$WORK/w2" --criu "$CRIU" \
		--gpu-map "${GPU_UUIDS[0]}=$ghost"
	# A hog takes all but HOG_LEAVE_MIB of GPU 1.
	rm -f "$WORK/hog.ready"
	"$PY" -c 'import sys, time, torch
free, _ = torch.cuda.mem_get_info(1)
x = torch.empty(free - (int(sys.argv[1]) << 20), dtype=torch.uint8, device="cuda:1")
open(sys.argv[2], "w").write("%d\n" % (free >> 20))
time.sleep(600)' "$HOG_LEAVE_MIB" "$WORK/hog.ready" >"$WORK/logs/$ROUND-hog.out" 2>&1 &
	HOG_PID=$!
	local i=0
	while [ ! -s "$WORK/hog.ready" ] && kill -0 "$HOG_PID" 2>/dev/null && [ $i -lt 600 ]; do
		sleep 0.1
		i=$((i + 1))
	done
	log "$ROUND: hog $HOG_PID on GPU 1 ($(cat "$WORK/hog.ready" 2>/dev/null || echo "NOT READY") MiB were free): $(nvidia-smi --query-gpu=index,memory.used,memory.free --format=csv,noheader | tr '\n' ';')"
	badmap_try "GPU 1 full" "MiB free" restore --from "$ar" --work-dir "$WORK/w2" --criu "$CRIU" \
		--gpu-map "${GPU_UUIDS[0]}=${GPU_UUIDS[1]}"
	kill -9 "$HOG_PID" 2>/dev/null
	wait "$HOG_PID" 2>/dev/null
	HOG_PID=
	(umask 077 && "$GCS" token >"$tok")
	badmap_try "receiver, missing GPU" "not on this host" receive --restore --listen "127.0.0.1:$(free_port)" \
		--token-file "$tok" --criu "$CRIU" --work-dir "$WORK/w2" --gpu-map "${GPU_UUIDS[0]}=$ghost"
	local ok=false
	[ $BADMAP_FAILS -eq 0 ] && ok=true
	emit "$(python3 -c '
import json, sys
print(json.dumps({"round": sys.argv[1], "ok": sys.argv[2] == "true", "note": "%s of 3 bad maps not refused as they should be" % sys.argv[3]}))
' "$ROUND" "$ok" "$BADMAP_FAILS")"
	rm -rf "$ar" "$tok"
	$ok
}

# fast_checkpoint LABEL DEST [ARGS...]: checkpoint of the target into DEST
# (--dedup in ARGS: LOC/NAME); its --json in
# logs/$ROUND-LABEL-checkpoint.json. Fails unless it took the fast path (on
# a GPU).
fast_checkpoint() {
	local label=$1 dest=$2 t0 j
	shift 2
	j=$WORK/logs/$ROUND-$label-checkpoint.json
	rm -rf "$WORK/w"
	mkdir -p "$WORK/w"
	t0=$(now)
	if ! "$GCS" checkpoint --pid "$TPID" --to "$dest" --codec "$FAST_CODEC" --work-dir "$WORK/w" --criu "$CRIU" --json \
		${VRAM_KEEP_DIR:+--vram-keep-dir "$VRAM_KEEP_DIR"} ${VRAM_FILES:+--vram-files "$VRAM_FILES"} "$@" \
		>"$j" 2>"$WORK/logs/$ROUND-$label-checkpoint.err"; then
		log "$ROUND: checkpoint $label failed: $(tail -c 3000 "$WORK/logs/$ROUND-$label-checkpoint.err")"
		keep_log "$WORK/w/img/dump.log" "$WORK/logs/$ROUND-$label-dump.log"
		crit_errors "$WORK/w/img/dump.log"
		return 1
	fi
	log "$ROUND: checkpoint $label ($*) into $dest in $(since "$t0")s: $(cat "$j")"
	if [ "$DEVICE" = cuda ] && ! grep -q '"vram copy out"' "$j"; then
		log "$ROUND: checkpoint $label did not take the fast path: the round fails ($(tail -c 600 "$WORK/logs/$ROUND-$label-checkpoint.err"))"
		return 1
	fi
}

# fast_restore LABEL SRC: restore the target from SRC once its tree is gone;
# it must prove itself (and go on counting); restore --json in
# logs/$ROUND-LABEL-restore.json.
fast_restore() {
	local label=$1 src=$2 t0 before=$COUNTER
	wait_tree_gone "$ROUND"
	rm -rf "$WORK/w2"
	mkdir -p "$WORK/w2"
	t0=$(now)
	if ! "$GCS" restore --from "$src" --work-dir "$WORK/w2" --criu "$CRIU" --json \
		>"$WORK/logs/$ROUND-$label-restore.json" 2>"$WORK/logs/$ROUND-$label-restore.err"; then
		log "$ROUND: restore $label failed: $(tail -c 3000 "$WORK/logs/$ROUND-$label-restore.err")"
		keep_log "$WORK/w2/img/restore.log" "$WORK/logs/$ROUND-$label-restore.log"
		crit_errors "$WORK/w2/img/restore.log"
		return 1
	fi
	log "$ROUND: restore $label in $(since "$t0")s: $(cat "$WORK/logs/$ROUND-$label-restore.json")"
	prove "after-$label" && [ "$COUNTER" -gt "$before" ]
}

# rewrite_tensors: the target rewrites REWRITE_PCT percent of its tensor
# bytes (SIGUSR2) and says which in rewritten.json.
rewrite_tensors() {
	local i=0
	rm -f "$TDIR/rewritten.json"
	kill -USR2 "$TPID" 2>/dev/null || return 1
	while [ ! -s "$TDIR/rewritten.json" ]; do
		sleep 0.1
		i=$((i + 1))
		if [ $i -gt 1200 ]; then
			log "$ROUND: the target did not rewrite its tensors within 120s"
			return 1
		fi
	done
	cp "$TDIR/rewritten.json" "$WORK/logs/$ROUND-rewritten-$1.json"
	log "$ROUND: rewritten: $(python3 -c 'import json, sys; d = json.load(open(sys.argv[1])); print("%d tensors, %d of %d bytes (%.1f%%) in %.2fs" % (len(d["tensors"]), d["bytes"], d["tensor_bytes"], 100.0 * d["bytes"] / d["tensor_bytes"], d["seconds"]))' "$TDIR/rewritten.json")"
}

# round_devhash: gpu hash, with the host's check, then after a rewrite
# of the tensors, then again; the changes it finds must cover the rewrite.
round_devhash() {
	local ok=true k
	for k in 1 2 3; do
		[ "$k" = 2 ] && { rewrite_tensors devhash || ok=false; }
		if ! "$GCS" gpu hash --pid "$TPID" $([ "$k" = 1 ] && echo --host-check) --json >"$WORK/logs/$ROUND-hash$k.json" 2>"$WORK/logs/$ROUND-hash$k.err"; then
			log "$ROUND: gpu hash $k failed: $(tail -3 "$WORK/logs/$ROUND-hash$k.err" | tr '\n' ' ')"
			ok=false
		fi
		log "$ROUND: gpu hash $k: $(cat "$WORK/logs/$ROUND-hash$k.json")"
		prove "after-hash$k" || ok=false
	done
	local row
	row=$(python3 -c '
import json, os, sys
rnd, ok, logs = sys.argv[1], sys.argv[2] == "true", sys.argv[3]
def load(name):
    try:
        return json.load(open(os.path.join(logs, rnd + "-" + name)))
    except (OSError, ValueError):
        return {}
h = [load("hash%d.json" % k).get("hash", {}) for k in (1, 2, 3)]
rw = load("rewritten-devhash.json")
d = [x.get("device", {}) for x in h]
cover = bool(rw.get("bytes")) and d[1].get("changed_bytes", 0) >= rw["bytes"]
ok = ok and all(d) and d[0].get("checked") and d[0].get("mismatched_blocks") == 0 and d[1].get("compared") and cover
print(json.dumps({"round": rnd, "codec": "devhash", "ok": ok, "raw_bytes": d[0].get("bytes", 0),
  "devhash": {"bytes": d[0].get("bytes", 0), "blocks": d[0].get("blocks", 0), "kernel_seconds": [x.get("kernel_s", 0) for x in d],
    "load_seconds": [x.get("load_s", 0) for x in d], "fetch_seconds": [x.get("fetch_s", 0) for x in d],
    "park_seconds": [x.get("park_s", 0) for x in h], "copy_out_seconds": [x.get("copy_out_s", 0) for x in h],
    "host_hash_seconds": [x.get("host_hash_s", 0) for x in h], "host_cores": h[0].get("host_cores", 0),
    "check_seconds": d[0].get("check_s", 0), "mismatched_blocks": d[0].get("mismatched_blocks"),
    "rewritten_bytes": rw.get("bytes", 0), "changed_after_rewrite": d[1].get("changed_bytes", 0),
    "changed_after_nothing": d[2].get("changed_bytes", 0), "covers_rewrite": cover}}))
' "$ROUND" "$ok" "$WORK/logs")
	emit "$row"
	log "$ROUND: $row"
	case $row in *'"ok": true'*) return 0 ;; esac
	return 1
}

# tmpfs_room DIR BYTES: whether the file system of DIR has BYTES free.
tmpfs_room() {
	local avail
	avail=$(df --output=avail -B1 "$1" 2>/dev/null | tail -1 | tr -d ' ')
	[ "${avail:-0}" -ge "$2" ]
}

# round_dedupfast: today's checkpoint (no --dedup) into tmpfs, restored and
# proved, for the comparison in the same run; then two deduplicated
# checkpoints of the fast-path target into each location (tmpfs, then
# disk), a tenth of its tensors rewritten between them; each restored and
# proved. One result row each.
round_dedupfast() {
	local kind loc ok=true need plain=$DEDUP_TMPFS/gpucr-dedup-$ROUND-plain pok=true
	need=$(python3 -c 'import json, sys; print(int(2.5 * json.load(open(sys.argv[1]))["info"]["tensor_bytes"]))' "$TDIR/checksums.json")
	if tmpfs_room "$DEDUP_TMPFS" "$need"; then
		rm -rf "$plain"
		fast_checkpoint plain "$plain" && fast_restore plain "$plain" || pok=false ok=false
		emit "$(python3 -c '
import json, os, sys
rnd, ok, logs = sys.argv[1:4]
def load(name):
    try:
        return json.load(open(os.path.join(logs, "%s-%s" % (rnd, name))))
    except (OSError, ValueError):
        return {}
c, r = load("plain-checkpoint.json"), load("plain-restore.json")
ph = {p["name"]: p["seconds"] for p in c.get("phases", [])}
rp = {p["name"]: p["seconds"] for p in r.get("phases", [])}
phases = {"dump": ph.get("criu dump + encode + write", 0), "commit": ph.get("commit", 0), "criu_restore": rp.get("criu restore + read + decode", 0),
  "vram_park": ph.get("vram park", 0), "vram_copy_out": ph.get("vram copy out", 0), "vram_release": ph.get("vram release", 0),
  "vram_store": ph.get("vram store (beside the dump)", 0), "vram_remap": rp.get("vram remap", 0), "vram_copy_in": rp.get("vram copy in", 0)}
print(json.dumps({"round": rnd + "/plain", "codec": "plain", "ok": ok == "true", "raw_bytes": c.get("raw_bytes", 0),
  "stored_bytes": c.get("stored_bytes", 0), "phases": phases, "checkpoint_total": c.get("total_seconds", 0),
  "restore_total": r.get("total_seconds", 0), "note": "today\x27s checkpoint (no --dedup) into tmpfs, beside the dedup rows"}))
' "$ROUND" "$pok" "$WORK/logs")"
		rm -rf "$plain"
	fi
	for kind in tmpfs disk; do
		local rok=true note=""
		if [ $kind = tmpfs ]; then
			loc=$DEDUP_TMPFS/gpucr-dedup-$ROUND
			if ! tmpfs_room "$DEDUP_TMPFS" "$need"; then
				log "$ROUND: $DEDUP_TMPFS has less than $need bytes free: no tmpfs location"
				continue
			fi
		else
			loc=$WORK/dedup-$ROUND
		fi
		rm -rf "$loc"
		if fast_checkpoint "$kind-one" "$loc/one" --dedup && fast_restore "$kind-one" "$loc/one" &&
			rewrite_tensors "$kind" && prove "after-rewrite-$kind" &&
			fast_checkpoint "$kind-two" "$loc/two" --dedup && fast_restore "$kind-two" "$loc/two"; then
			:
		else
			rok=false ok=false note="failed: see run.log"
		fi
		"$GCS" ls --json "$loc" >"$WORK/logs/$ROUND-$kind-ls.json" 2>&1
		python3 "$ROOT/e2e/gpu/newbytes.py" "$loc/two" "$loc/one" >"$WORK/logs/$ROUND-$kind-newbytes.json" 2>>"$RUNLOG" &&
			log "$ROUND: $kind: the second checkpoint's new bytes: $(cat "$WORK/logs/$ROUND-$kind-newbytes.json")"
		emit "$(python3 -c '
import json, os, sys
rnd, kind, loc, ok, note, logs, locbytes = sys.argv[1:8]
def load(name, default=None):
    try:
        return json.load(open(os.path.join(logs, "%s-%s" % (rnd, name))))
    except (OSError, ValueError):
        return default if default is not None else {}
c1, c2 = load(kind + "-one-checkpoint.json"), load(kind + "-two-checkpoint.json")
r1, r2 = load(kind + "-one-restore.json"), load(kind + "-two-restore.json")
rw = load("rewritten-%s.json" % kind)
es = {e["name"]: e for e in load(kind + "-ls.json", [])}
n1, n2 = es.get("one", {}).get("new_bytes", 0), es.get("two", {}).get("new_bytes", 0)
ph = {p["name"]: p["seconds"] for p in c1.get("phases", [])}
rp = {p["name"]: p["seconds"] for p in r1.get("phases", [])}
phases = {"lock": ph.get("gpu lock", 0), "gpu_checkpoint": ph.get("gpu checkpoint", 0), "dump": ph.get("criu dump + encode + write", 0),
  "commit": ph.get("commit", 0), "criu_restore": rp.get("criu restore + read + decode", 0), "gpu_restore": rp.get("gpu restore", 0),
  "unlock": rp.get("gpu unlock", 0), "vram_park": ph.get("vram park", 0), "vram_copy_out": ph.get("vram copy out", 0),
  "vram_release": ph.get("vram release", 0), "vram_store": ph.get("vram store (beside the dump)", 0),
  "vram_remap": rp.get("vram remap", 0), "vram_copy_in": rp.get("vram copy in", 0)}
d = {"location": kind + " " + loc, "first_seconds": c1.get("total_seconds", 0), "second_seconds": c2.get("total_seconds", 0),
  "first_new_bytes": n1, "second_new_bytes": n2, "second_share": (n2 / n1) if n1 else 0,
  "rewrite_bytes": rw.get("bytes", 0), "rewrite_share": (rw["bytes"] / rw["tensor_bytes"]) if rw.get("tensor_bytes") else 0,
  "first_restore_seconds": r1.get("total_seconds", 0), "second_restore_seconds": r2.get("total_seconds", 0),
  "location_bytes": int(locbytes or 0), "second_new_by_kind": load(kind + "-newbytes.json").get("by_kind", {})}
# Issue 36: what the second copied out and kept (the blocks that changed
# since the first), of the device memory the target holds.
v2 = c2.get("vram") or {}
d["second_kept_bytes"], d["second_allocated_bytes"] = v2.get("kept_bytes", 0), v2.get("allocated_bytes", 0)
d["second_earlier_bytes"] = v2.get("earlier_bytes", 0)
d["second_kept_share"] = (d["second_kept_bytes"] / d["second_allocated_bytes"]) if d["second_allocated_bytes"] else 0
d["second_vram_phases"] = {p["name"]: p["seconds"] for p in c2.get("phases", []) if p["name"].startswith("vram ") or p["name"] in ("commit", "criu dump + encode + write")}
print(json.dumps({"round": rnd + "/" + kind, "codec": "dedup", "ok": ok == "true", "raw_bytes": c1.get("raw_bytes", 0),
  "stored_bytes": c1.get("stored_bytes", 0), "phases": phases, "checkpoint_total": c1.get("total_seconds", 0),
  "restore_total": r1.get("total_seconds", 0), "dedup": d, "note": note}))
' "$ROUND" "$kind" "$loc" "$rok" "$note" "$WORK/logs" "$(du -sb "$loc" 2>/dev/null | awk '{print $1}')")"
		rm -rf "$loc"
		$rok || break
	done
	$ok
}

# round_fastexit: where the exit of a restored fast-path target goes (the
# "process exit" phase of a checkpoint of a restored process, which waited
# for the reap until the checkpoint stopped waiting for it:
# 1.5-1.9 s, against 0.01 s for a fresh one). Checkpoint and restore the
# target, record what the restored process holds (status, smaps_rollup, its
# mappings by path), then checkpoint it again while sampling its kernel
# stack every 20 ms until it is gone (logs/ROUND-exit-*.txt).
round_fastexit() {
	local d=$DEDUP_TMPFS/gpucr-$ROUND ok=true out=$WORK/logs/$ROUND-exit pid
	rm -rf "$d"
	fast_checkpoint one "$d/one" && fast_restore one "$d/one" || ok=false
	if $ok; then
		pid=$TPID
		{
			cat /proc/$pid/status
			cat /proc/$pid/smaps_rollup
			awk '{print $6}' /proc/$pid/maps | sort | uniq -c | sort -rn | head -30
		} >"$out-held.txt" 2>&1
		(
			while [ -d /proc/$pid ]; do
				echo "t=$(now) $(awk '{print $3}' /proc/$pid/stat 2>/dev/null) $(cat /proc/$pid/wchan 2>/dev/null)"
				grep -E 'VmRSS|VmPin|VmLck|Threads' /proc/$pid/status 2>/dev/null | tr '\n' ' '
				echo
				cat /proc/$pid/stack 2>/dev/null | head -12
				for t in /proc/$pid/task/*; do
					[ "$(awk '{print $3}' $t/stat 2>/dev/null)" = D ] && { echo " task $t D:"; head -8 $t/stack 2>/dev/null; }
				done
				sleep 0.02
			done
		) >"$out-samples.txt" 2>&1 &
		local sampler=$!
		fast_checkpoint two "$d/two" || ok=false
		wait $sampler
		log "$ROUND: the restored target held: $(grep -E 'VmRSS|VmPin|VmLck|RssShmem|RssFile|RssAnon' "$out-held.txt" | tr -s ' \t' ' ' | tr '\n' ';')"
		log "$ROUND: exit samples (state, wchan, top frame), the samples in states D, Z, X (first 60 lines):"
		grep -A3 '^t=' "$out-samples.txt" | grep -v '^--' | awk '/^t=/ {p = ($2 == "D" || $2 == "Z" || $2 == "X")} p' | head -60 | tee -a "$RUNLOG"
		$ok && fast_restore two "$d/two" || ok=false
	fi
	rm -rf "$d"
	$ok
}

# round_dedupreplicas: REPLICAS targets with the same seed checkpointed
# --dedup into one location one after the other, then each restored and
# proved; what all added over what the first added.
round_dedupreplicas() {
	local loc=$DEDUP_TMPFS/gpucr-dedup-$ROUND ok=true k need pids=("$TPID") dirs=("$TDIR") counters=("$COUNTER") sizes=()
	need=$(python3 -c 'import json, sys; print(int(2.5 * json.load(open(sys.argv[1]))["info"]["tensor_bytes"]))' "$TDIR/checksums.json")
	tmpfs_room "$DEDUP_TMPFS" "$need" || loc=$WORK/dedup-$ROUND
	rm -rf "$loc"
	for ((k = 2; k <= REPLICAS; k++)); do
		if ! start_target "$ROUND-r$k" || ! prove before; then
			log "$ROUND: replica $k did not start"
			ok=false
			break
		fi
		pids+=("$TPID") dirs+=("$TDIR") counters+=("$COUNTER")
	done
	for ((k = 0; k < ${#pids[@]} && ${#pids[@]} == REPLICAS; k++)); do
		TPID=${pids[$k]} TDIR=${dirs[$k]} COUNTER=${counters[$k]}
		fast_checkpoint "r$((k + 1))" "$loc/r$((k + 1))" --dedup || {
			ok=false
			break
		}
		sizes+=("$(du -sb "$loc" | awk '{print $1}')")
	done
	for ((k = 0; k < ${#sizes[@]} && ${#sizes[@]} == REPLICAS; k++)); do
		TPID=${pids[$k]} TDIR=${dirs[$k]} COUNTER=${counters[$k]}
		fast_restore "r$((k + 1))" "$loc/r$((k + 1))" || ok=false
	done
	"$GCS" ls --json "$loc" >"$WORK/logs/$ROUND-ls.json" 2>&1
	emit "$(python3 -c '
import json, os, sys
rnd, ok, logs, n = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4])
sizes = [int(x) for x in sys.argv[5:]]
try:
    es = {e["name"]: e for e in json.load(open(os.path.join(logs, rnd + "-ls.json")))}
except (OSError, ValueError):
    es = {}
def load(name):
    try:
        return json.load(open(os.path.join(logs, "%s-%s" % (rnd, name))))
    except (OSError, ValueError):
        return {}
new = [es.get("r%d" % (k + 1), {}).get("new_bytes", 0) for k in range(n)]
c = [load("r%d-checkpoint.json" % (k + 1)) for k in range(n)]
r = [load("r%d-restore.json" % (k + 1)) for k in range(n)]
d = {"replicas": n, "new_bytes": new, "over_one": (sum(new) / new[0]) if new and new[0] else 0,
  "checkpoint_seconds": [x.get("total_seconds", 0) for x in c], "restore_seconds": [x.get("total_seconds", 0) for x in r],
  "location_bytes_one": sizes[0] if sizes else 0, "location_bytes_all": sizes[-1] if sizes else 0}
print(json.dumps({"round": rnd, "codec": "dedup", "ok": ok == "true" and len(sizes) == n, "raw_bytes": c[0].get("raw_bytes", 0),
  "stored_bytes": c[0].get("stored_bytes", 0), "checkpoint_total": c[0].get("total_seconds", 0),
  "restore_total": r[0].get("total_seconds", 0), "dedup": d}))
' "$ROUND" "$ok" "$WORK/logs" "$REPLICAS" "${sizes[@]}")"
	for ((k = 0; k < ${#pids[@]} - 1; k++)); do kill_tree "${pids[$k]}" "${dirs[$k]}"; done
	TPID=${pids[-1]} TDIR=${dirs[-1]}
	rm -rf "$loc"
	$ok
}

CRIU_OPTS=${CRIU_OPTS:-}
# If CRIU refuses the first dump, the rounds are tried again once with these
# options (what a process with external sockets, locks or unlinked files
# needs).
CRIU_RETRY_OPTS=${CRIU_RETRY_OPTS---ext-unix-sk --file-locks --link-remap}
FAILED=0
RETRIED=0
set -- $ROUNDS
while [ $# -gt 0 ]; do
	ROUND=$1
	shift
	elapsed=$(since "$T_START")
	if awk -v e="$elapsed" -v d="$DEADLINE" 'BEGIN { exit !(e > d) }'; then
		log "deadline ${DEADLINE}s passed: skipping round $ROUND and the rest"
		break
	fi
	base=${ROUND%%-*} # auto-2 runs the auto round again
	if two_gpu "$base" && [ "$NGPU" -lt 2 ]; then
		log "round $ROUND: SKIPPED: it needs 2 GPUs, nvidia-smi lists $NGPU"
		continue
	fi
	if [ "$base" = probe ]; then
		# The quiescence probe starts its own targets.
		log "=== round $ROUND"
		for conf in "" expandable_segments:True; do
			if "$PY" "$ROOT/e2e/gpu/quiesce_probe.py" --gcs "$GCS" --lib "$(dirname "$GCS")/libgpucr-preload.so" \
				--out "$OUTDIR" ${conf:+--alloc-conf "$conf"} 2>&1 | tee -a "$RUNLOG"; then
				log "round $ROUND ${conf:-default}: PASS"
			else
				log "round $ROUND ${conf:-default}: FAIL"
				FAILED=$((FAILED + 1))
			fi
		done
		continue
	fi
	nkids=0
	[ "$base" = tree ] || [ "$base" = fasttree ] && nkids=$TREE_CHILDREN
	log "=== round $ROUND"
	start_target "$ROUND" "$nkids" || {
		log "round $ROUND: target did not start"
		FAILED=$((FAILED + 1))
		continue
	}
	COUNTER=0
	prove before || {
		FAILED=$((FAILED + 1))
		kill_tree "$TPID" "$TDIR"
		continue
	}
	DUMP_FAILED=0
	case $base in
	fast | fastexp | remapfast | spanfast | spanswapfast) round_gcs "$FAST_CODEC" ;;
	remap | span | spanswap) round_gcs auto ;;
	nccl) round_nccl ;;
	ncclfast | ncclfastswap | ncclp2p | ncclp2pswap | ncclp2ptp) round_gcs "$FAST_CODEC" ;;
	ncclp2pmigrate) round_migrate fast ;;
	ncclp2pfault) round_fault ;;
	ncclfault) round_nccl fault ;;
	migrateremap) round_migrate ;;
	badmap) round_badmap ;;
	fastleave) round_gcs "$FAST_CODEC" leave ;;
	fasttree) round_gcs "$FAST_CODEC" ;;
	fastsuspend) round_suspend ;;
	fastfault) round_fault ;;
	dedupfast) round_dedupfast ;;
	dedupreplicas) round_dedupreplicas ;;
	devhash) round_devhash ;;
	fastexit) round_fastexit ;;
	ctr | ctrfast | ctrfastlib | ctrfastmigrate) round_ctr ;;
	baseline) round_baseline ;;
	leave) round_gcs auto leave ;;
	tree) round_gcs auto ;;
	migrate) round_migrate ;;
	migratefast) round_migrate fast ;;
	infer) round_gcs auto ;;
	inferfast | inferfastcache) round_gcs "$FAST_CODEC" ;;
	*) round_gcs "$base" ;;
	esac
	rc=$?
	if [ $rc -ne 0 ] && [ $DUMP_FAILED = 1 ] && [ $RETRIED = 0 ] && [ -n "$CRIU_RETRY_OPTS" ] && [ -z "$CRIU_OPTS" ]; then
		RETRIED=1
		CRIU_OPTS=$CRIU_RETRY_OPTS
		log "round $ROUND: criu dump failed; trying again with criu options $CRIU_OPTS"
		kill_tree "$TPID" "$TDIR"
		set -- "$ROUND" "$@"
		continue
	fi
	[ $rc -ne 0 ] && FAILED=$((FAILED + 1))
	log "round $ROUND: $([ $rc -eq 0 ] && echo PASS || echo FAIL)"
	kill_tree "$TPID" "$TDIR"
	rm -rf "$WORK/img" "$WORK"/ar-* "${MIGRATE_KEEP_DIR:-$WORK}/gpucr-migrate-keep"
done
log "failed rounds: $FAILED"
finish $([ $FAILED -eq 0 ] && echo 0 || echo 1)
