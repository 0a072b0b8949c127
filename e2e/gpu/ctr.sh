# shellcheck shell=bash
# The container rounds of e2e/gpu/run.sh (sourced by it): the standard
# target in a runc container, checkpointed with `gpucr-stream checkpoint
# --container` and restored with `restore --container` twice over (the
# second checkpoint is of the restored container), proved after each
# restore, as a process's rounds are.
#
#   ctr         the driver's checkpoint only (no library in the container)
#   ctrfast     the fast path, `gpucr-stream run --` as the entry point
#   ctrfastlib  the fast path, the library mounted in and LD_PRELOAD set
#   ctrfastmigrate
#               ctrfast's container moved by `migrate --container` over
#               loopback into a second runc root (`receive --restore
#               --container`), then checkpointed and restored there
#
# The container's root file system is the host's own directories bound
# read-only (PyTorch, CUDA's libraries and the driver's are wherever the
# host has them), each mount under them bound too, so that runc declares
# every one to CRIU as external; the GPU's device nodes are the spec's
# devices. gpucr-stream, the library and the scripts are bound at /gcs
# and /gcsgpu, the target's work dir at /tdir. The container has its own
# PID namespace: the target is its init, PID 1 inside; TPID is its host
# PID (runc state).
#
# Knobs: RUNC (runc on PATH), CTR_NETWORK_LOCK (CRIU's network-lock
# method, through the bundle's org.criu.config; default: CRIU's own where
# ip6tables-restore is on PATH, else skip).

RUNC=${RUNC:-runc}
if [ -z "${CTR_NETWORK_LOCK+set}" ] && ! command -v ip6tables-restore >/dev/null; then
	CTR_NETWORK_LOCK=skip
fi
export CTR_NETWORK_LOCK
CTR_ROOT=${CTR_ROOT:-$WORK/runc}
CTR_ID=

# ctr_pid ID: the host PID of container ID's init, if it runs.
ctr_pid() {
	local st
	st=$("$RUNC" --root "$CTR_ROOT" state "$1" 2>/dev/null) || return 0
	python3 -c 'import json, sys; s = json.loads(sys.argv[1]); print(s["pid"] if s["status"] == "running" else "")' "$st"
}

# ctr_bundle DIR SCRIPT ARGS...: an OCI bundle in DIR running the target
# SCRIPT with ARGS as the container's init, for round ROUND.
ctr_bundle() {
	local b=$1 script=$2
	shift 2
	rm -rf "$b"
	mkdir -p "$b/rootfs"
	"$RUNC" spec --bundle "$b" || return 1
	local entry=()
	case ${ROUND%%-*} in
	ctrfast | ctrfastmigrate) entry=(/gcs/gpucr-stream run --) ;;
	esac
	# The target's output goes into /tdir/target.out from inside: CRIU
	# dumps a descriptor only of a file the container can see.
	python3 - "$b" "$WORK" "$TDIR" "$(dirname "$GCS")" "$ROOT/e2e/gpu" "${ROUND%%-*}" \
		/bin/sh -c 'exec "$@" >>/tdir/target.out 2>&1' sh \
		"${entry[@]}" "$(command -v "$PY")" "/gcsgpu/$script" --dir /tdir "$@" <<'EOF'
import json, os, stat, sys
bundle, work, tdir, bindir, scripts, kind = sys.argv[1:7]
args = sys.argv[7:]
rootfs = os.path.join(bundle, "rootfs")
spec = json.load(open(os.path.join(bundle, "config.json")))
proc = spec["process"]
proc["terminal"] = False
proc["args"] = args
proc.pop("rlimits", None)  # the host's, as a process started by run.sh has
env = {"PATH": os.environ["PATH"], "HOME": "/root", "PYTHONUNBUFFERED": "1",
       "ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16", "DNNL_MAX_CPU_ISA": "AVX512_CORE_BF16"}
for k in ("LD_LIBRARY_PATH", "PYTHONPATH", "CUDA_VISIBLE_DEVICES"):
    if os.environ.get(k):
        env[k] = os.environ[k]
if kind == "ctrfastlib":
    env["LD_PRELOAD"] = "/gcs/libgpucr-preload.so"
proc["env"] = ["%s=%s" % kv for kv in env.items()]
spec["root"]["readonly"] = False
for d in ("proc", "sys", "dev", "tmp", "run", "gcs", "gcsgpu", "tdir"):
    os.makedirs(os.path.join(rootfs, d), exist_ok=True)
skip = {"proc", "sys", "dev", "run", "tmp", "var", "boot", "lost+found", "gcs", "gcsgpu", "tdir"}
tops = []
for name in sorted(os.listdir("/")):
    p = "/" + name
    if name in skip:
        continue
    if os.path.islink(p):
        os.symlink(os.readlink(p), os.path.join(rootfs, name))
    elif os.path.isdir(p):
        tops.append(p)
mounts = [{"destination": p, "type": "bind", "source": p, "options": ["bind", "ro"]} for p in tops]
# Every mount below a bound directory, in the order the host mounted
# them: a bind is not recursive, so that each is its own spec mount,
# which runc declares to CRIU as external.
def under(p, top):
    return p.startswith(top + "/")
for line in open("/proc/self/mountinfo"):
    f = line.split()
    mp = f[4].encode().decode("unicode_escape")
    fstype = f[f.index("-") + 1]
    if under(mp, work) or mp == work or fstype in ("proc", "sysfs", "autofs", "binfmt_misc"):
        continue
    if any(under(mp, t) for t in tops):
        mounts.append({"destination": mp, "type": "bind", "source": mp, "options": ["bind", "ro"]})
for dst, src, mode in (("/gcs", bindir, "ro"), ("/gcsgpu", scripts, "ro"), ("/tdir", tdir, "rw")):
    mounts.append({"destination": dst, "type": "bind", "source": src, "options": ["bind", mode]})
spec["mounts"] += mounts
# The GPU's device nodes, allowed in the device cgroup.
devs, rules = [], []
for name in sorted(os.listdir("/dev")):
    p = "/dev/" + name
    if not name.startswith("nvidia"):
        continue
    st = os.stat(p)
    if not stat.S_ISCHR(st.st_mode):
        continue
    ma, mi = os.major(st.st_rdev), os.minor(st.st_rdev)
    devs.append({"path": p, "type": "c", "major": ma, "minor": mi, "fileMode": 0o666, "uid": 0, "gid": 0})
    rules.append({"allow": True, "type": "c", "major": ma, "minor": mi, "access": "rwm"})
linux = spec["linux"]
linux["devices"] = linux.get("devices", []) + devs
res = linux.setdefault("resources", {})
res["devices"] = res.get("devices", []) + rules
# CRIU locks the container's network with iptables unless told
# otherwise: where the host has none, the lock (of a namespace holding
# only lo) is skipped.
if os.environ.get("CTR_NETWORK_LOCK"):
    conf = os.path.join(bundle, "criu.conf")
    open(conf, "w").write("network-lock %s\n" % os.environ["CTR_NETWORK_LOCK"])
    spec.setdefault("annotations", {})["org.criu.config"] = conf
json.dump(spec, open(os.path.join(bundle, "config.json"), "w"), indent=1)
print("bundle: %d mounts bound from the host, %d GPU device nodes" % (len(mounts), len(devs)))
EOF
}

# start_container ROUND SCRIPT ARGS...: runs the target in container
# gg-ROUND and waits until it is ready; TPID is its host PID.
start_container() {
	local round=$1 script=$2 t0 b=$WORK/ctr-$1
	shift 2
	CTR_ID=gg-$round
	mkdir -p "$CTR_ROOT"
	ctr_bundle "$b" "$script" "$@" 2>&1 | tee -a "$RUNLOG"
	[ "${PIPESTATUS[0]}" = 0 ] || return 1
	t0=$(now)
	# The container's stdio on /dev/null, runc's messages in a log.
	if ! "$RUNC" --root "$CTR_ROOT" --log "$WORK/logs/$round-runc.log" run --detach --bundle "$b" "$CTR_ID" \
		</dev/null >/dev/null 2>&1; then
		log "$round: runc run failed: $(tail -5 "$WORK/logs/$round-runc.log")"
		return 1
	fi
	local waited=0
	while [ ! -s "$TDIR/ready" ]; do
		sleep 0.2
		waited=$((waited + 1))
		if [ $waited -gt 1500 ] || [ -z "$(ctr_pid "$CTR_ID")" ]; then
			tail -20 "$TDIR/target.out" | tee -a "$RUNLOG"
			ctr_delete
			return 1
		fi
	done
	TPID=$(ctr_pid "$CTR_ID")
	log "target in container $CTR_ID (network lock ${CTR_NETWORK_LOCK:-as CRIU picks it}): host PID $TPID (PID $(cat "$TDIR/ready") inside) ready in $(since "$t0")s: $(tail -1 "$TDIR/target.out")"
	[ "$DEVICE" = cuda ] && nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader | tee -a "$RUNLOG"
	return 0
}

# ctr_delete: container CTR_ID goes, whatever its state.
ctr_delete() {
	[ -n "$CTR_ID" ] || return 0
	"$RUNC" --root "$CTR_ROOT" delete --force "$CTR_ID" >/dev/null 2>&1
	CTR_ID=
}

# ctr_cycle N: checkpoint container CTR_ID into an archive and restore it
# as a container; the restored one must prove itself, count on, be
# running in runc's list and sit in the cgroup the container had.
ctr_cycle() {
	local n=$1 ar=$WORK/ar-$ROUND-$1 t0 tck trs cg cg2 j=$WORK/logs/$ROUND-$1
	rm -rf "$ar"
	cg=$(cat "/proc/$TPID/cgroup")
	local extra=()
	case $ROUND in *fast*) extra+=(${VRAM_KEEP_DIR:+--vram-keep-dir "$VRAM_KEEP_DIR"} ${VRAM_FILES:+--vram-files "$VRAM_FILES"}) ;; esac
	t0=$(now)
	if ! "$GCS" checkpoint --container "$CTR_ID" --runtime-root "$CTR_ROOT" --to "$ar" --codec "$FAST_CODEC" \
		--criu "$CRIU" --json "${extra[@]}" >"$j-checkpoint.json" 2>"$j-checkpoint.err"; then
		log "$ROUND: checkpoint $n failed: $(tail -c 3000 "$j-checkpoint.err")"
		return 1
	fi
	tck=$(since "$t0")
	log "$ROUND: checkpoint $n of the container in ${tck}s: $(cat "$j-checkpoint.json")"
	if [ "$(cuda_count "$j-checkpoint.json")" != 1 ] && [ "$DEVICE" = cuda ]; then
		log "$ROUND: checkpoint $n did not checkpoint the container's CUDA process"
		return 1
	fi
	case $ROUND in *fast*)
		if [ "$DEVICE" = cuda ] && ! grep -q '"vram copy out"' "$j-checkpoint.json"; then
			log "$ROUND: checkpoint $n did not take the fast path ($(tail -c 600 "$j-checkpoint.err"))"
			return 1
		fi
		;;
	esac
	wait_gone "$TPID" || log "$ROUND: the container's init $TPID is still there"
	t0=$(now)
	if ! "$GCS" restore --container "$CTR_ID" --runtime-root "$CTR_ROOT" --from "$ar" --criu "$CRIU" --json \
		>"$j-restore.json" 2>"$j-restore.err"; then
		log "$ROUND: restore $n failed: $(tail -c 3000 "$j-restore.err")"
		return 1
	fi
	trs=$(since "$t0")
	log "$ROUND: restore $n of the container in ${trs}s: $(cat "$j-restore.json")"
	TPID=$(ctr_pid "$CTR_ID")
	if [ -z "$TPID" ]; then
		log "$ROUND: after restore $n, runc does not list $CTR_ID as running: $("$RUNC" --root "$CTR_ROOT" list)"
		return 1
	fi
	"$RUNC" --root "$CTR_ROOT" list | tee -a "$RUNLOG"
	cg2=$(cat "/proc/$TPID/cgroup")
	if [ "$cg" != "$cg2" ]; then
		log "$ROUND: after restore $n the init sits in cgroups [$cg2], the container's were [$cg]"
		return 1
	fi
	local before=$COUNTER
	prove "after-$n" && [ "$COUNTER" -gt "$before" ] || return 1
	emit "$(python3 -c '
import json, sys
ck, rs = json.load(open(sys.argv[3])), json.load(open(sys.argv[4]))
ph = {p["name"]: p["seconds"] for p in ck.get("phases", [])}
print(json.dumps({"round": sys.argv[1] + "-" + sys.argv[2], "codec": sys.argv[5], "ok": True,
  "raw_bytes": ck.get("raw_bytes", 0), "stored_bytes": ck.get("stored_bytes", 0),
  "checkpoint_total": ck.get("total_seconds", 0), "restore_total": rs.get("total_seconds", 0),
  "phases": {"lock": ph.get("gpu lock", 0), "gpu_checkpoint": ph.get("gpu checkpoint", 0),
    "vram_copy_out": ph.get("vram copy out", 0), "dump": ph.get("criu dump + encode + write", 0), "commit": ph.get("commit", 0)},
  "restore_steps": [[p["name"], p["seconds"]] for p in rs.get("phases", []) if ":" not in p["name"]],
  "cuda_pids": ck.get("cuda_pids"), "note": "runc container, cgroup kept"}))
' "$ROUND" "$n" "$j-checkpoint.json" "$j-restore.json" "$FAST_CODEC")"
	rm -rf "$ar"
}

# ctr_migrate: container CTR_ID moves by migrate --container over
# loopback into the runc root CTR_ROOT-b, which it is managed by from
# then on; the moved one must be running there, in the cgroups it had,
# and prove itself.
ctr_migrate() {
	local tok=$WORK/token rootb=$CTR_ROOT-b j=$WORK/logs/$ROUND-migrate port t0 tm cg mrc=0
	rm -rf "$tok" "$WORK/w2"
	mkdir -p "$rootb" "$WORK/w2"
	(umask 077 && "$GCS" token >"$tok") || return 1
	port=$(free_port) || return 1
	cg=$(cat "/proc/$TPID/cgroup")
	start_receiver "$j-receive.json" "$j-receive.err" "$GCS" receive --restore --listen "127.0.0.1:$port" --token-file "$tok" \
		--criu "$CRIU" --container "$CTR_ID" --runtime-root "$rootb" --work-dir "$WORK/w2" --json || return 1
	t0=$(now)
	"$GCS" migrate --container "$CTR_ID" --runtime-root "$CTR_ROOT" --to "tcp://127.0.0.1:$port" --token-file "$tok" \
		--criu "$CRIU" --codec "$FAST_CODEC" --json >"$j-migrate.json" 2>"$j-migrate.err" || mrc=$?
	tm=$(since "$t0")
	stop_receiver "$([ $mrc -eq 0 ] && echo 120 || echo 15)"
	log "$ROUND: migrate (exit $mrc) in ${tm}s: $(cat "$j-migrate.json")"
	log "$ROUND: receive (exit $RECV_RC): $(cat "$j-receive.json")"
	if [ $mrc -ne 0 ] || [ "$RECV_RC" -ne 0 ]; then
		log "$ROUND: migrate: $(tail -c 3000 "$j-migrate.err"); receive: $(tail -c 3000 "$j-receive.err")"
		return 1
	fi
	if [ "$DEVICE" = cuda ] && ! { grep -q '"vram copy out"' "$j-migrate.json" && grep -q '"vram copy in"' "$j-receive.json"; }; then
		log "$ROUND: the migration did not take the fast path both ways"
		return 1
	fi
	if [ -n "$(ctr_pid "$CTR_ID")" ]; then
		log "$ROUND: the container still runs in the sending runc root"
		return 1
	fi
	CTR_ROOT=$rootb
	TPID=$(ctr_pid "$CTR_ID")
	if [ -z "$TPID" ] || [ "$(cat "/proc/$TPID/cgroup")" != "$cg" ]; then
		log "$ROUND: after the migration: $("$RUNC" --root "$CTR_ROOT" list); cgroups [$(cat "/proc/$TPID/cgroup" 2>/dev/null)], the container's were [$cg]"
		return 1
	fi
	"$RUNC" --root "$CTR_ROOT" list | tee -a "$RUNLOG"
	local before=$COUNTER
	prove after-migrate && [ "$COUNTER" -gt "$before" ] || return 1
	emit "$(python3 -c '
import json, sys
m, r = json.load(open(sys.argv[2])), json.load(open(sys.argv[3]))
print(json.dumps({"round": sys.argv[1] + "-migrate", "ok": True, "checkpoint_total": float(sys.argv[4]),
  "raw_bytes": m.get("raw_bytes", 0), "stored_bytes": m.get("stored_bytes", 0),
  "restore_steps": [[p["name"], p["seconds"]] for p in r.get("phases", []) if ":" not in p["name"]],
  "note": "migrate --container over loopback between runc roots (CHECKPOINT column: the migration wall time)"}))
' "$ROUND" "$j-migrate.json" "$j-receive.json" "$tm")"
}

# round_ctr: two checkpoint and restore cycles of the container, the
# second of the restored one; for ctrfastmigrate, a migration and then
# one cycle in the runc root it moved to.
round_ctr() {
	local rc=0 root=$CTR_ROOT
	case ${ROUND%%-*} in
	ctrfastmigrate) ctr_migrate && ctr_cycle 2 || rc=1 ;;
	*) ctr_cycle 1 && ctr_cycle 2 || rc=1 ;;
	esac
	ctr_delete
	CTR_ROOT=$root
	return $rc
}
