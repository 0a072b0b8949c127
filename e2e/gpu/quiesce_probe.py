#!/usr/bin/env python3
"""Quiescence probe for the GPU fast path (libgpucr-preload), on a real GPU.

  quiesce_probe.py --gcs BIN --lib LIB --out DIR [--alloc-conf CONF]

Starts a PyTorch process with the library preloaded that launches work as
fast as it can (a device counter incremented by one kernel per step, counted
on the host too, and a matrix product), then, through the library's control
socket and `gpucr-stream gpu ...`:

 1. lock-first: the driver's lock (cuCheckpointProcessLock) first, then
    `park`: does the library's park (gate + cuCtxSynchronize on its control
    thread) get through while the driver holds the process locked?
 2. parked: two copy-outs 1 s apart while parked must be identical (no
    work ran), and the counter must not move.
 3. the chosen order, in full: park -> copy out -> release -> driver lock ->
    driver checkpoint -> driver restore -> driver unlock -> remap -> copy in
    -> unpark; device memory in use is read at each step (nvidia-smi), and
    the target then proves that its counter equals its host step count and
    that every checksum holds.

Results: DIR/quiesce-probe.json (and lines on stdout).
"""
import argparse, hashlib, json, os, signal, socket, subprocess, sys, threading, time

def target_main(d):
    import torch
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(7)
    big = [torch.randn(128 << 20, device=dev, generator=g) for _ in range(8)]  # 4 GiB
    sums = [float(t.double().sum().item()) for t in big]
    a = torch.randn(2048, 2048, device=dev, generator=g)
    ref = a @ a
    c = torch.zeros(1, dtype=torch.int64, device=dev)
    steps = 0
    want = {"proof": False}
    signal.signal(signal.SIGUSR1, lambda s, f: want.__setitem__("proof", True))
    with open(os.path.join(d, "ready"), "w") as f:
        f.write(str(os.getpid()))
    while True:
        c += 1
        steps += 1
        y = a @ a
        if steps % 64 == 0:
            torch.cuda.synchronize()
        if want["proof"]:
            want["proof"] = False
            torch.cuda.synchronize()
            p = {"steps": steps, "counter": int(c.item()),
                 "checksums_ok": all(float(t.double().sum().item()) == s for t, s in zip(big, sums)),
                 "matmul_ok": bool(torch.equal(y, ref)), "mem_allocated": torch.cuda.memory_allocated()}
            tmp = os.path.join(d, "proof.tmp")
            with open(tmp, "w") as f:
                json.dump(p, f)
            os.rename(tmp, os.path.join(d, "proof.json"))


class Ctl:
    def __init__(self, path):
        self.s = socket.socket(socket.AF_UNIX)
        self.s.connect(path)
        self.f = self.s.makefile("rb")

    def cmd(self, c, fds=None):
        if fds:
            socket.send_fds(self.s, [c.encode() + b"\n"], fds)
        else:
            self.s.sendall(c.encode() + b"\n")
        line = self.f.readline().decode().strip()
        if not line.startswith("ok"):
            raise RuntimeError("%s: %s" % (c, line))
        return json.loads(line[3:]) if len(line) > 3 else {}


def vram_records(b):
    """The (va, bytes) of a VRAM file's records (docs/PRODUCERS.md, "VRAM files"): GPUCRVM3 stores only
    the blocks its bitmap does not leave out (zeros), GPUCRVM2 every byte at a 4 KiB boundary,
    GPUCRVM1 every byte right after the header."""
    v = {b"GPUCRVM1": 1, b"GPUCRVM2": 2, b"GPUCRVM3": 3}.get(b[:8])
    assert v, "bad magic"
    hn, off, out = (32 if v == 3 else 16), 8, []
    while True:
        va, ln = int.from_bytes(b[off:off + 8], "little"), int.from_bytes(b[off + 8:off + 16], "little")
        block = int.from_bytes(b[off + 16:off + 24], "little") if v == 3 else max(ln, 1)
        off += hn
        if va == 0 and ln == 0:
            return out
        nblk = (ln + block - 1) // block
        bm = b[off:off + (nblk + 7) // 8] if v == 3 else b""
        off += len(bm)
        if v > 1:
            off = (off + 4095) // 4096 * 4096
        piece = bytearray(ln)
        for k in range(nblk):
            n = min(block, ln - k * block)
            if bm and bm[k // 8] >> (k % 8) & 1:
                continue
            piece[k * block:k * block + n] = b[off:off + n]
            off += n
        out.append((va, bytes(piece)))


def copy_out(ctl, n=4):
    """copyout into n pipes; returns (sha256 over the records sorted by address, bytes, seconds)."""
    pipes = [os.pipe() for _ in range(n)]
    data = [None] * n

    def rd(i):
        with os.fdopen(pipes[i][0], "rb") as f:
            data[i] = f.read()
    ts = [threading.Thread(target=rd, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    t0 = time.time()
    r = ctl.cmd("copyout", [w for _, w in pipes])
    for _, w in pipes:
        os.close(w)
    for t in ts:
        t.join()
    dt = time.time() - t0
    recs = []
    for b in data:
        recs.extend(vram_records(b))
    h = hashlib.sha256()
    for va, payload in sorted(recs):
        h.update(va.to_bytes(8, "little"))
        h.update(payload)
    return h.hexdigest(), r["bytes"], dt, data


def copy_in(ctl, data):
    n = len(data)
    pipes = [os.pipe() for _ in range(n)]

    def wr(i):
        with os.fdopen(pipes[i][1], "wb") as f:
            f.write(data[i])
    ts = [threading.Thread(target=wr, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    t0 = time.time()
    r = ctl.cmd("copyin", [rr for rr, _ in pipes])
    for rr, _ in pipes:
        os.close(rr)
    for t in ts:
        t.join()
    return r["bytes"], time.time() - t0


def used_mib(pid):
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20).stdout
        for l in out.splitlines():
            p, m = [x.strip() for x in l.split(",")]
            if int(p) == pid:
                return int(m)
    except Exception as e:
        return "nvidia-smi: %s" % e
    return 0


def proof(d, pid, timeout=60):
    pf = os.path.join(d, "proof.json")
    if os.path.exists(pf):
        os.remove(pf)
    os.kill(pid, signal.SIGUSR1)
    t = time.time()
    while not os.path.exists(pf):
        if time.time() - t > timeout:
            return {"error": "no proof within %ds" % timeout}
        time.sleep(0.05)
    return json.load(open(pf))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gcs", required=True)
    ap.add_argument("--lib", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--alloc-conf", default="")
    ap.add_argument("--target-dir", default="")
    a = ap.parse_args()
    if a.target_dir:
        return target_main(a.target_dir)
    # The target's files stay out of --out (only the results go there).
    d = os.path.join(os.environ.get("TMPDIR", "/tmp"), "qp-" + (a.alloc_conf.replace(":", "_") or "default"))
    os.makedirs(d, exist_ok=True)
    sockdir = os.environ.get("GPUCR_PRELOAD_DIR", "/run/gpucr-stream")
    env = dict(os.environ, LD_PRELOAD=a.lib)
    if a.alloc_conf:
        env["PYTORCH_CUDA_ALLOC_CONF"] = a.alloc_conf
    log = open(os.path.join(d, "target.out"), "w")
    tp = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--gcs", a.gcs, "--lib", a.lib, "--out", a.out,
                           "--target-dir", d], env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
    res = {"alloc_conf": a.alloc_conf or "default", "steps": []}

    def step(name, **kw):
        kw["name"] = name
        kw["t"] = round(time.time() - t_start, 3)
        res["steps"].append(kw)
        print("probe:", json.dumps(kw), flush=True)
    t_start = time.time()
    try:
        while not os.path.exists(os.path.join(d, "ready")):
            if tp.poll() is not None:
                raise RuntimeError("target died: " + open(os.path.join(d, "target.out")).read()[-2000:])
            time.sleep(0.1)
        pid = tp.pid
        time.sleep(1)
        ctl = Ctl(os.path.join(sockdir, "preload-%d.sock" % pid))
        step("report", **ctl.cmd("report"), used_mib=used_mib(pid))

        def gpu(*args):
            t0 = time.time()
            r = subprocess.run([a.gcs, "gpu", *args, "--pid", str(pid)], capture_output=True, text=True, timeout=120)
            return r.returncode, (r.stdout + r.stderr).strip()[-300:], round(time.time() - t0, 3)

        # 1. The driver's lock first, then park.
        rc, out, dt = gpu("lock")
        step("driver lock", rc=rc, out=out, seconds=dt)
        box = {}

        def park():
            t0 = time.time()
            try:
                box["r"] = ctl.cmd("park 30000")
            except Exception as e:
                box["err"] = str(e)
            box["dt"] = time.time() - t0
        th = threading.Thread(target=park)
        th.start()
        th.join(3)
        step("park while driver-locked", answered_within_3s=not th.is_alive())
        rc, out, dt = gpu("unlock")
        step("driver unlock", rc=rc, out=out, seconds=dt)
        th.join(60)
        step("park after unlock", answered=not th.is_alive(), result=box.get("r"), error=box.get("err"),
             seconds=round(box.get("dt", 0), 3))
        if "err" in box or th.is_alive():
            raise RuntimeError("park failed")

        # 2. Parked: nothing moves.
        h1, n1, dt1, _ = copy_out(ctl)
        time.sleep(1)
        h2, n2, dt2, data = copy_out(ctl)
        step("copy out twice while parked", identical=h1 == h2, bytes=n1, seconds=round(dt1, 3),
             GBps=round(n1 / dt1 / 1e9, 2), second_seconds=round(dt2, 3))
        ctl.cmd("unpark")
        time.sleep(1)
        p = proof(d, pid)
        step("proof after park/unpark", **p)

        # 3. The chosen order, in full (without CRIU).
        t0 = time.time(); ctl.cmd("park 10000"); tpark = time.time() - t0
        h3, n3, dt3, data = copy_out(ctl, 8)
        t0 = time.time(); ctl.cmd("release"); trel = time.time() - t0
        step("park + copy out + release", park_s=round(tpark, 3), bytes=n3, copy_s=round(dt3, 3),
             GBps=round(n3 / dt3 / 1e9, 2), release_s=round(trel, 3), used_mib=used_mib(pid))
        for s in ("lock", "checkpoint", "restore", "unlock"):
            rc, out, dt = gpu(s)
            step("driver " + s, rc=rc, out=out, seconds=dt, used_mib=used_mib(pid))
            if rc:
                raise RuntimeError("gpu %s failed: %s" % (s, out))
        t0 = time.time(); ctl.cmd("remap"); tremap = time.time() - t0
        nb, tin = copy_in(ctl, data)
        ctl.cmd("unpark")
        step("remap + copy in + unpark", remap_s=round(tremap, 3), bytes=nb, copy_s=round(tin, 3),
             GBps=round(nb / tin / 1e9, 2), used_mib=used_mib(pid))
        time.sleep(1)
        p = proof(d, pid)
        step("proof after the full order", **p)
        res["ok"] = (p.get("counter") == p.get("steps") and p.get("checksums_ok") and p.get("matmul_ok")
                     and h1 == h2 and res["steps"][4]["answered"])
    except Exception as e:
        res["ok"] = False
        res["error"] = str(e)
        print("probe: ERROR", e, flush=True)
    finally:
        tp.kill()
        tp.wait()
        with open(os.path.join(a.out, "quiesce-probe-%s.json" % (a.alloc_conf.replace(":", "_") or "default")), "w") as f:
            json.dump(res, f, indent=1)
    print("probe: ok" if res.get("ok") else "probe: FAILED", flush=True)
    return 0 if res.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
