#!/usr/bin/env python3
"""Run a command as our child in a session of its own, and reap every
process orphaned under us (PR_SET_CHILD_SUBREAPER) until none is left.

e2e/gpu/run.sh starts targets through it in rounds named X-reaped: the GPU
machine's init reaps an orphan 1.5-1.9 s after it dies, and a checkpointed
NCCL pair's rank 1 is orphaned when rank 0 dies, so a migration over
loopback (whose receiver needs the PIDs free) waited for that init.
Deployed, init (systemd, a container's) reaps at once; across hosts migrate
does not wait for the reap at all.
"""

import ctypes
import os
import sys

PR_SET_CHILD_SUBREAPER = 36


def main():
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        print("reaper: PR_SET_CHILD_SUBREAPER: errno %d" % ctypes.get_errno(), file=sys.stderr)
        sys.exit(1)
    pid = os.fork()
    if pid == 0:
        os.setsid()
        os.execvp(sys.argv[1], sys.argv[1:])
    status = 0
    while True:
        try:
            p, st = os.wait()
        except ChildProcessError:
            break
        if p == pid:
            status = os.waitstatus_to_exitcode(st)
    sys.exit(status if status >= 0 else 128 - status)


if __name__ == "__main__":
    main()
