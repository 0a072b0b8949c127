#!/usr/bin/env python3
"""Host memory a step takes, sampled (e2e/gpu/run.sh, infer rounds).

memwatch.py --out FILE --dest DIR samples /proc/meminfo every --every
seconds until SIGTERM, then writes FILE (JSON): the peak of the host memory
in use (MemTotal - MemAvailable) over its value at the start, and the same
less what the destination's file system gained (an archive on tmpfs is the
destination's memory, not the step's), with MemTotal and the cgroup's limit.
"""

import argparse
import json
import os
import signal
import time


def meminfo():
    d = {}
    with open("/proc/meminfo") as f:
        for line in f:
            k, v = line.split(":", 1)
            d[k] = int(v.split()[0]) * 1024
    return d


def fs_used(path):
    st = os.statvfs(path)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--dest", required=True)
    p.add_argument("--every", type=float, default=0.02)
    a = p.parse_args()
    stop = []
    signal.signal(signal.SIGTERM, lambda s, f: stop.append(1))
    m0 = meminfo()
    used0 = m0["MemTotal"] - m0["MemAvailable"]
    dest0 = fs_used(a.dest)
    peak = peak_less = dest_at_peak = 0
    n = 0
    while not stop:
        m = meminfo()
        used = m["MemTotal"] - m["MemAvailable"] - used0
        dest = fs_used(a.dest) - dest0
        peak = max(peak, used)
        if used - dest > peak_less:
            peak_less, dest_at_peak = used - dest, dest
        n += 1
        time.sleep(a.every)
    limit = None
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
    except OSError:
        pass
    with open(a.out, "w") as f:
        json.dump({"peak_used_delta": peak, "peak_used_less_dest_delta": peak_less, "dest_delta_at_peak": dest_at_peak,
                   "memtotal": m0["MemTotal"], "available_at_start": m0["MemAvailable"], "cgroup_max": limit,
                   "samples": n}, f)


if __name__ == "__main__":
    main()
