#!/bin/bash
# The NCCL probe of issue 24 (2-GPU machine): what the driver's steps and the
# fast path do with e2e/gpu/nccl_pair.py. PHASES (default "A B C D"):
#   A  plain pair, NCCL's defaults (P2P over cuMem shareable handles), paused
#      at a collective boundary (--dir/pause): gpu lock, checkpoint, restore,
#      unlock of both ranks, then a proof
#   B  the same with NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 (sockets)
#   C  the pair under `gpucr-stream run` with GPUCR_PRELOAD_TRACE=1: what the
#      library sees (shared handles, cuMemCreate locations)
#   D  under run, sockets, paused: checkpoint (fast path) and restore in place
#   E  under run, sockets, paused: gpu suspend --to / resume --from
#   F  under run, sockets, NOT paused (PERIOD=0: all_reduce back to back):
#      checkpoint and restore in place twice (the collective barrier)
# Results in $OUT/probe.log. GCS, CRIU name the binaries.
set -u
R=$(cd "$(dirname "$0")/../.." && pwd)
GCS=${GCS:-$R/bin/gpucr-stream}
CRIU=${CRIU:-$R/.cache/criu/bin/criu}
O=${OUT:-/tmp/out}; W=/dev/shm/probe; rm -rf $W; mkdir -p $W $O
PHASES=${PHASES:-A B C D}
log(){ echo "[$(date +%T.%N | cut -c1-12)] $*" | tee -a $O/probe.log; }
waitf(){ local n=0; while [ ! -e "$1" ]; do sleep 0.1; n=$((n+1)); [ $n -gt ${2:-1200} ] && return 1; done; return 0; }
tcp(){ python3 - "$@" <<'PY'
import sys,os,glob
st={'01':'ESTAB','0A':'LISTEN','06':'TIME_WAIT','08':'CLOSE_WAIT','04':'FIN_WAIT1','05':'FIN_WAIT2'}
inodes={}
for p in sys.argv[1:]:
    for f in glob.glob('/proc/%s/fd/*'%p):
        try: l=os.readlink(f)
        except OSError: continue
        if l.startswith('socket:['): inodes[l[8:-1]]=p
for l in open('/proc/net/tcp').readlines()[1:]+open('/proc/net/tcp6').readlines()[1:]:
    f=l.split(); la=f[1]; ra=f[2]; s=f[3]; ino=f[9]
    lp=int(la.split(':')[1],16); rp=int(ra.split(':')[1],16)
    if ino in inodes or s=='06':
        print(' tcp %s %d -> %d pid %s'%(st.get(s,s),lp,rp,inodes.get(ino,'-')))
PY
}
start_pair(){ # DIR PRE... -- ENV...
  D=$W/$1; shift; mkdir -p $D
  local pre=()
  while [ "$1" != "::" ]; do pre+=("$1"); shift; done; shift
  env "$@" NCCL_NVLS_ENABLE=0 NCCL_DEBUG=INFO TORCH_SYMM_MEM_DISABLE_MULTICAST=1 setsid "${pre[@]}" python3 $R/e2e/gpu/nccl_pair.py --dir $D --mib 1024 --period ${PERIOD:-0.05} </dev/null >$D/out 2>&1 &
  if ! waitf $D/ready 900; then log "pair in $D not ready"; tail -n 30 $D/out $D/child-0.out | tee -a $O/probe.log; return 1; fi
  P0=$(cat $D/ready); P1=$(cat $D/ready-child-0); log "pair $D: ranks $P0 $P1"
}
pause(){ touch $D/pause; waitf $D/paused-0 300 && waitf $D/paused-1 300 && log "paused at $(cat $D/paused-0)/$(cat $D/paused-1)"; }
unpause(){ rm -f $D/pause; sleep 0.5; }
prove(){ rm -f $D/proof.json; kill -USR1 $P0 || { log "prove: $P0 gone"; return 1; }; waitf $D/proof.json 600 || { log "prove $1: none"; return 1; }; log "proof $1: $(cat $D/proof.json | cut -c1-600)"; }
info(){ for p in $P0 $P1; do log "$1 pid $p: fds: $(ls -l /proc/$p/fd 2>/dev/null | awk '{print $NF}' | grep -v '^/dev/pts\|pipe:\|^/dev/null' | sort | uniq -c | tr '\n' ' ' | cut -c1-900)"; log "$1 pid $p maps nvidia/shm: $(grep -c 'nvidia' /proc/$p/maps) $(grep -o '/dev/shm/[^ ]*' /proc/$p/maps | sort -u | tr '\n' ' ')"; done; tcp $P0 $P1 | tee -a $O/probe.log; }
gstep(){ local a=$1 p=$2 t0=$(date +%s.%N) r; r=$(timeout 60 $GCS gpu $a --pid $p 2>&1); log "gpu $a $p (rc $?, $(awk -v a=$t0 -v b=$(date +%s.%N) "BEGIN{print b-a}")s): $(echo $r | cut -c1-400) | state $($GCS gpu state --pid $p 2>&1)"; }
killpair(){ kill -9 -- -$P0 2>/dev/null; kill -9 $P0 $P1 2>/dev/null; sleep 2; }

driver_steps(){
  pause || return
  info "$1"
  for a in lock checkpoint restore unlock; do gstep $a $P0; gstep $a $P1; done
  unpause; prove "$1-after-driver" ; sleep 1; prove "$1-again"
}
for ph in $PHASES; do
 case $ph in
 A) log "== A: plain, default NCCL: the driver's steps on a paused pair"; start_pair A :: && { driver_steps A; grep -h 'via\|NCCL version\|CUMEM\|cuMem' $D/out $D/child-0.out | head -20 | tee -a $O/probe.log; killpair; } ;;
 B) log "== B: plain, P2P and SHM off"; start_pair B :: NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 && { driver_steps B; grep -h 'via' $D/out | head -4 | tee -a $O/probe.log; killpair; } ;;
 C) log "== C: preloaded, default NCCL, trace"; start_pair C $GCS run -- :: GPUCR_PRELOAD_TRACE=1 && { pause; info C; grep -h 'gpucr-preload' $D/out $D/child-0.out | grep -v 'location 1/' | sort | uniq -c | head -40 | tee -a $O/probe.log; grep -h 'gpucr-preload.*cuMemCreate' $D/out $D/child-0.out | awk '{print $5, $6,$7,$8,$9,$10,$11,$12}' | sort | uniq -c | head -20 | tee -a $O/probe.log; unpause; prove C; killpair; } ;;
 D) log "== D: preloaded, P2P and SHM off: checkpoint (fast path), restore"; start_pair D $GCS run -- :: NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 GPUCR_PRELOAD_TRACE=1 && {
   grep -h 'gpucr-preload.*incapable' $D/out $D/child-0.out | sort | uniq -c | head | tee -a $O/probe.log
   pause; info D-before
   t0=$(date +%s.%N); timeout 200 $GCS checkpoint --pid $P0 --to $W/ckD --codec none --work-dir $W/wD --criu $CRIU --criu-opts "--tcp-established --ghost-limit 256M" --no-progress >$O/D-ckpt.out 2>&1; rc=$?
   log "checkpoint rc $rc in $(awk -v a=$t0 -v b=$(date +%s.%N) "BEGIN{print b-a}")s: $(tail -c 2500 $O/D-ckpt.out)"
   tcp | tee -a $O/probe.log
   if [ $rc = 0 ]; then
     t0=$(date +%s.%N); timeout 200 $GCS restore --from $W/ckD --work-dir $W/wDr --criu $CRIU --criu-opts "--tcp-established --ghost-limit 256M" --no-progress >$O/D-rst.out 2>&1; rc=$?
     log "restore rc $rc in $(awk -v a=$t0 -v b=$(date +%s.%N) "BEGIN{print b-a}")s: $(tail -c 2500 $O/D-rst.out)"
     [ $rc = 0 ] || { grep -h 'Error\|rror (' $W/wDr/*/restore.log $W/wDr/restore.log 2>/dev/null | head -20 | tee -a $O/probe.log; find $W/wDr -name '*.log' | head; cp $(find $W/wDr -name 'restore.log' | head -1) $O/ 2>/dev/null; }
     unpause; prove D-restored; sleep 1; prove D-again
     grep -v 'NCCL INFO\|gpucr-preload' $D/out | tail -n 8 | tee -a $O/probe.log; grep -v 'NCCL INFO\|gpucr-preload' $D/child-0.out | tail -n 5 | tee -a $O/probe.log
   else
     cp $(find $W/wD -name 'dump.log' | head -1) $O/ 2>/dev/null; unpause; prove D-after-failed
   fi
   killpair; } ;;
 E) log "== E: preloaded, P2P and SHM off: gpu suspend/resume of both ranks (fast path, no CRIU)"; start_pair E $GCS run -- :: NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 GPUCR_PRELOAD_TRACE=1 && {
   grep -h 'gpucr-preload.*incapable' $D/out $D/child-0.out | sort | uniq -c | head | tee -a $O/probe.log
   grep -h 'gpucr-preload.*cuMemCreate' $D/out $D/child-0.out | awk '{print $5,$6,$7,$8,$9,$10,$11,$12}' | sort | uniq -c | tee -a $O/probe.log
   pause
   for p in $P0 $P1; do t0=$(date +%s.%N); timeout 100 $GCS gpu suspend --pid $p --to $W/s-$p --codec none > $O/E-s-$p.out 2>&1; log "suspend $p rc $? in $(awk -v a=$t0 -v b=$(date +%s.%N) "BEGIN{print b-a}")s: $(tail -c 800 $O/E-s-$p.out) | state $($GCS gpu state --pid $p 2>&1)"; done
   nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader | tee -a $O/probe.log
   for p in $P0 $P1; do t0=$(date +%s.%N); timeout 100 $GCS gpu resume --pid $p --from $W/s-$p > $O/E-r-$p.out 2>&1; log "resume $p rc $? in $(awk -v a=$t0 -v b=$(date +%s.%N) "BEGIN{print b-a}")s: $(tail -c 800 $O/E-r-$p.out) | state $($GCS gpu state --pid $p 2>&1)"; done
   unpause; prove E-resumed; sleep 1; prove E-again
   grep -v 'NCCL INFO\|gpucr-preload' $D/out | tail -n 8 | tee -a $O/probe.log; grep -v 'NCCL INFO\|gpucr-preload' $D/child-0.out | tail -n 5 | tee -a $O/probe.log
   killpair; } ;;
 F) log "== F: preloaded, P2P and SHM off, NOT paused: checkpoint (fast path, collective barrier), restore in place"; start_pair F $GCS run -- :: NCCL_P2P_DISABLE=1 NCCL_SHM_DISABLE=1 GPUCR_PRELOAD_TRACE=1 && {
   sleep 2; prove F-before
   for round in 1 2; do
   t0=$(date +%s.%N); timeout 200 $GCS checkpoint --pid $P0 --to $W/ckF$round --codec none --work-dir $W/wF$round --criu $CRIU --criu-opts "--tcp-established --ghost-limit 256M" --no-progress >$O/F-ckpt$round.out 2>&1; rc=$?
   log "F$round checkpoint rc $rc in $(awk -v a=$t0 -v b=$(date +%s.%N) "BEGIN{print b-a}")s: $(tail -c 2500 $O/F-ckpt$round.out)"
   [ $rc = 0 ] || { prove F-after-failed; break; }
   t0=$(date +%s.%N); timeout 200 $GCS restore --from $W/ckF$round --work-dir $W/wFr$round --criu $CRIU --criu-opts "--tcp-established" --no-progress >$O/F-rst$round.out 2>&1; rc=$?
   log "F$round restore rc $rc in $(awk -v a=$t0 -v b=$(date +%s.%N) "BEGIN{print b-a}")s: $(tail -c 2500 $O/F-rst$round.out)"
   [ $rc = 0 ] || { grep -h 'Error' $W/wFr$round/img/restore.log | head | tee -a $O/probe.log; break; }
   prove F$round-restored; sleep 1; prove F$round-again
   rm -rf $W/ckF$round
   done
   grep -h 'gpucr-preload.*kernel' $D/out $D/child-0.out | cut -d' ' -f2- | sort | uniq -c | sort -rn | head -12 | tee -a $O/probe.log
   grep -v 'NCCL INFO\|gpucr-preload' $D/out | tail -n 8 | tee -a $O/probe.log; grep -v 'NCCL INFO\|gpucr-preload' $D/child-0.out | tail -n 5 | tee -a $O/probe.log
   killpair; } ;;
 esac
done
log "probe done"
