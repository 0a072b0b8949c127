#!/usr/bin/env python3
"""Checkpoint target for the GPU end-to-end test (e2e/gpu/run.sh).

A PyTorch process that holds a known amount of device memory with known
content and keeps computing:

  * random tensors: float32 torch.randn, --gib-random GiB in 512 MiB tensors
    (activations, optimizer state);
  * model-like weights: bfloat16 matrices drawn as trained weights look
    (normal, per-layer scale 0.01..0.05, plus norm vectors near 1.0),
    --gib-weights GiB in 128 MiB layers.

With --devices 0,1 (CUDA only) the process spans several GPUs: the random
tensors go to the first device, the weights to the last (so the amounts
differ and a swap of the GPUs shows in nvidia-smi), and every device also
holds a small product pair of its own, so a product is checked on each.

At start it stores a checksum of every tensor (two 64-bit sums over the raw
bit patterns, one position-weighted, computed on the device) and a reference
product x @ W0. Then it loops: every --period seconds it computes x @ W0
again, compares it bit for bit with the reference and counts the step.

With --children N it is the root of a tree of CUDA processes: after its own
setup it starts N children (this script again, with --child-of; started by
fork + exec, so no CUDA state is forked, in the same session and process
group, so CRIU dumps and restores them with it). Each child holds --child-mib
MiB of its own (half float32 random, half bf16 weights), checksummed the same
way, and runs its own x @ W0 loop. A child exits when its parent is gone.

Protocol (files in --dir):
  ready            written once everything is allocated and checksummed (and
                   every child is ready): the pid
  rewritten.json   written on SIGUSR2, after the process rewrote --rewrite-pct
                   percent of its tensor bytes with new random values (in
                   place: same addresses) and recomputed their checksums, so
                   proofs hold; which tensors, a function of --seed and the
                   rewrite's number (x @ W0's tensors are never rewritten)
  proof.json       written on SIGUSR1: every checksum recomputed and
                   compared, the product compared, the step counter, device
                   memory in use; with children, their proofs merged in (a
                   child that is gone or does not answer within
                   --child-proof-timeout seconds fails the proof)
  target.log       what it did (children too)
  ready-child-K    child K is ready: its pid
  proof-child-K.json  child K's proof, written on SIGUSR1 (the parent asks)
  child-K.out      child K's output

SIGTERM stops the process; the parent terminates its children first.

Exit codes: 0 on SIGTERM; 2 bad arguments; 3 setup failed; 4 (child) the
parent is gone.
"""

import argparse
import json
import os
import random
import signal
import subprocess
import sys
import time

import torch

from targetfiles import write_atomic

MASK = (1 << 64) - 1
CHUNK = 1 << 26  # elements per checksum pass
CHILD_CHUNK = 1 << 22  # a child's passes: its weights vector is 32 MiB, not 512


def log(args, msg):
    line = "%s pid %d: %s" % (time.strftime("%H:%M:%S"), os.getpid(), msg)
    with open(os.path.join(args.dir, "target.log"), "a") as f:
        f.write(line + "\n")
    print(line, flush=True)


class Checksummer:
    """Checksums a tensor in passes of chunk elements widened to int64.

    Its scratch (two int64 buffers of chunk elements: 1 GiB with CHUNK) is
    its own and zeroed after every checksum: left in the caching
    allocator's free blocks, it held a widened copy of the last tensor
    checked, and when that tensor was one the dedupfast round rewrote, a
    second checkpoint found 1 GiB more changed device memory than the
    rewrite (17% new instead of 9%: 2026-11-28, newbytes.py)."""

    def __init__(self, device, chunk=CHUNK):
        self.chunk = chunk
        self.weights = (torch.arange(chunk, device=device, dtype=torch.int64) % 65521) + 1
        self.wide = torch.zeros(chunk, device=device, dtype=torch.int64)
        self.prod = torch.zeros(chunk, device=device, dtype=torch.int64)

    def __call__(self, t):
        flat = t.reshape(-1)
        if t.element_size() == 2:
            bits = flat.view(torch.int16)
        elif t.element_size() == 4:
            bits = flat.view(torch.int32)
        else:
            raise ValueError("unsupported dtype %s" % t.dtype)
        s1 = 0
        s2 = 0
        for i, off in enumerate(range(0, bits.numel(), self.chunk)):
            part = bits[off:off + self.chunk]
            n = part.numel()
            b, p = self.wide[:n], self.prod[:n]
            b.copy_(part)
            s1 += int(b.sum().item())
            torch.mul(b, self.weights[:n], out=p)
            s2 += int(p.sum().item()) * (i + 1)
        self.wide.zero_()
        self.prod.zero_()
        return "%016x%016x" % (s1 & MASK, s2 & MASK)


def sync(dev):
    if dev.type == "cuda":
        torch.cuda.synchronize()


def allocated(dev, nbytes):
    return torch.cuda.memory_allocated(dev) if dev.type == "cuda" else nbytes


class Worker:
    """The tensors of one process, their checksums and its x @ W0 loop (one
    product per (x, W) pair in extra, on the devices the pairs live on)."""

    def __init__(self, dev, tensors, w0, x, chunk, extra=(), devs=None):
        self.dev = dev
        self.devs = devs or [dev]
        self.tensors = tensors  # (name, tensor)
        self.sync()
        self.cs = {str(d): Checksummer(d, chunk) for d in self.devs}
        self.sums = {name: self.sum(t) for name, t in tensors}
        self.w0, self.x = w0, x
        self.ref = (x @ w0) if w0 is not None else None
        self.extra = [(xx, ww, xx @ ww) for xx, ww in extra]
        self.sync()
        self.nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
        self.counter = 0
        self.matmul_ok = True
        self.first_error = ""

    def sync(self):
        for d in self.devs:
            if d.type == "cuda":
                torch.cuda.synchronize(d)

    def sum(self, t):
        return self.cs.get(str(t.device), self.cs[str(self.devs[0])])(t)

    def check(self, x, w, ref, what):
        y = x @ w
        if not torch.equal(y, ref):
            self.matmul_ok = False
            if not self.first_error:
                d = (y.float() - ref.float()).abs().max().item()
                self.first_error = "%s differs from the reference at step %d (max abs diff %g)" % (what, self.counter, d)

    def step(self):
        if self.ref is not None:
            self.check(self.x, self.w0, self.ref, "x @ W0")
        for x, w, ref in self.extra:
            self.check(x, w, ref, "x @ W on %s" % x.device)
        self.sync()
        self.counter += 1

    def rewrite(self, pct, seed, generation):
        """Rewrite pct percent of the tensor bytes in place with new random
        values (tensors picked by seed and generation; W0 never) and
        recompute their checksums."""
        t = time.time()
        order = [i for i, (name, tt) in enumerate(self.tensors) if tt is not self.w0 and not name.startswith("pair")]
        random.Random(seed * 1000 + generation).shuffle(order)
        want, done, names = self.nbytes * pct / 100.0, 0, []
        for i in order:
            if done >= want:
                break
            name, tt = self.tensors[i]
            g = torch.Generator(device=tt.device)
            g.manual_seed(seed + 100000 * generation + i)
            tt.normal_(0.0, 0.03, generator=g)
            self.sums[name] = self.sum(tt)
            done += tt.numel() * tt.element_size()
            names.append(name)
        self.sync()
        return {"generation": generation, "pct": pct, "tensors": names, "bytes": done, "tensor_bytes": self.nbytes,
                "seconds": time.time() - t, "time": time.time()}

    def proof(self):
        t = time.time()
        bad = [name for name, tt in self.tensors if self.sum(tt) != self.sums[name]]
        return {
            "pid": os.getpid(),
            "counter": self.counter,
            "tensors": len(self.tensors),
            "tensor_bytes": self.nbytes,
            "checksums_ok": not bad,
            "mismatched": bad[:20],
            "matmul_ok": self.matmul_ok,
            "error": self.first_error,
            "allocated": allocated(self.dev, self.nbytes),
            "allocated_per_device": {str(d): allocated(d, 0) for d in self.devs},
            "verify_seconds": time.time() - t,
            "time": time.time(),
        }


def child_main(args, dev):
    """A child of the tree: --child-mib MiB, its own loop, proofs on SIGUSR1."""
    k = args.child_index
    state = {"prove": False, "stop": False}
    signal.signal(signal.SIGUSR1, lambda s, f: state.__setitem__("prove", True))
    signal.signal(signal.SIGTERM, lambda s, f: state.__setitem__("stop", True))
    if os.getppid() != args.child_of:
        log(args, "child %d: parent %d is gone before setup" % (k, args.child_of))
        sys.exit(4)
    t0 = time.time()
    torch.manual_seed(args.seed)
    gen = torch.Generator(device=dev)
    gen.manual_seed(args.seed)
    total = args.child_mib << 20
    n_f32 = (total // 2) // 4
    tensors = [("child%d.random" % k, torch.randn(n_f32, generator=gen, device=dev, dtype=torch.float32))]
    side = 1024  # 2 MiB bf16 layers
    n_layers = max(1, (total - n_f32 * 4) // (side * side * 2))
    for i in range(n_layers):
        w = torch.randn(side, side, generator=gen, device=dev, dtype=torch.float32) * (0.01 + 0.04 * (i % 5) / 4.0)
        tensors.append(("child%d.layer%03d.weight" % (k, i), w.to(torch.bfloat16)))
        del w
    x = torch.randn(64, side, generator=gen, device=dev, dtype=torch.float32).to(torch.bfloat16)
    wk = Worker(dev, tensors, tensors[1][1], x, CHILD_CHUNK)
    with open(os.path.join(args.dir, "checksums-child-%d.json" % k), "w") as f:
        json.dump({"pid": os.getpid(), "tensor_bytes": wk.nbytes, "sums": wk.sums}, f, indent=1)
    log(args, "child %d ready: %d tensors, %.0f MiB on %s in %.1fs" % (k, len(tensors), wk.nbytes / 2**20, dev, time.time() - t0))
    write_atomic(os.path.join(args.dir, "ready-child-%d" % k), "%d\n" % os.getpid())

    while not state["stop"]:
        if os.getppid() != args.child_of:
            log(args, "child %d: parent %d is gone (parent now %d); exiting at step %d" % (k, args.child_of, os.getppid(), wk.counter))
            sys.exit(4)
        wk.step()
        if state["prove"]:
            state["prove"] = False
            proof = wk.proof()
            proof["index"] = k
            write_atomic(os.path.join(args.dir, "proof-child-%d.json" % k), json.dumps(proof))
            log(args, "child %d proof: counter %d, checksums %s, matmul %s" % (
                k, wk.counter, "ok" if proof["checksums_ok"] else "BAD %s" % proof["mismatched"][:3], wk.matmul_ok))
        time.sleep(args.period)
    log(args, "child %d stopped at step %d" % (k, wk.counter))


def start_children(args):
    """Start the children (fork + exec, same session) and wait until each is
    ready; returns the Popen objects, or exits 3."""
    children = []
    for k in range(args.children):
        for f in ("ready-child-%d" % k, "proof-child-%d.json" % k):
            try:
                os.unlink(os.path.join(args.dir, f))
            except FileNotFoundError:
                pass
        cmd = [sys.executable, os.path.abspath(__file__), "--dir", args.dir, "--device", args.device,
               "--child-of", str(os.getpid()), "--child-index", str(k), "--child-mib", str(args.child_mib),
               "--seed", str(args.seed + 1000 * (k + 1)), "--period", str(args.period)]
        with open(os.path.join(args.dir, "child-%d.out" % k), "ab") as out:
            children.append(subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                             start_new_session=False, close_fds=True))
    deadline = time.time() + args.child_ready_timeout
    pending = set(range(args.children))
    while pending:
        for k in sorted(pending):
            if os.path.exists(os.path.join(args.dir, "ready-child-%d" % k)):
                pending.discard(k)
            elif children[k].poll() is not None:
                stop_children(args, children)
                log(args, "setup failed: child %d (pid %d) exited with %s before it was ready" % (k, children[k].pid, children[k].returncode))
                sys.exit(3)
        if pending and time.time() > deadline:
            stop_children(args, children)
            log(args, "setup failed: children %s not ready after %ds" % (sorted(pending), args.child_ready_timeout))
            sys.exit(3)
        time.sleep(0.05)
    return children


def stop_children(args, children):
    for c in children:
        if c.poll() is None:
            c.terminate()
    deadline = time.time() + 10
    for c in children:
        try:
            c.wait(timeout=max(0.1, deadline - time.time()))
        except subprocess.TimeoutExpired:
            c.kill()
            c.wait()
    if children:
        log(args, "children stopped: %s" % ", ".join("%d (%s)" % (c.pid, c.returncode) for c in children))


def ask_children(args, children):
    """Remove the children's old proofs and signal them; returns the time
    of the request and, per child, an error if it could not be signalled."""
    t_ask = time.time()
    gone = {}
    for k, c in enumerate(children):
        try:
            os.unlink(os.path.join(args.dir, "proof-child-%d.json" % k))
        except FileNotFoundError:
            pass
        if c.poll() is not None:
            gone[k] = "child %d (pid %d) is gone (exit status %s)" % (k, c.pid, c.returncode)
            continue
        try:
            os.kill(c.pid, signal.SIGUSR1)
        except OSError as e:
            gone[k] = "child %d (pid %d) is gone (%s)" % (k, c.pid, e)
    return t_ask, gone


def collect_children(args, children, t_ask, gone):
    """Wait (at most --child-proof-timeout s) for the children's fresh
    proofs; returns a list with one entry per child."""
    res = {k: {"index": k, "pid": c.pid, "counter": 0, "ok": False, "checksums_ok": False, "matmul_ok": False, "error": gone[k]}
           for k, c in enumerate(children) if k in gone}
    deadline = t_ask + args.child_proof_timeout
    pending = [k for k in range(len(children)) if k not in gone]
    while pending:
        for k in list(pending):
            c = children[k]
            path = os.path.join(args.dir, "proof-child-%d.json" % k)
            p = None
            if os.path.exists(path):
                with open(path) as f:
                    p = json.load(f)
                if p.get("time", 0) < t_ask:
                    p = None  # a late answer to an earlier request
            if p is not None:
                ok = bool(p["checksums_ok"] and p["matmul_ok"] and not p["error"])
                err = ""
                if not ok:
                    err = "child %d (pid %d): %s" % (k, p["pid"], "; ".join(filter(None, [
                        "" if p["checksums_ok"] else "checksums differ: %s" % p["mismatched"][:5],
                        "" if p["matmul_ok"] else "x @ W0 differs",
                        p["error"]])))
                res[k] = {"index": k, "pid": p["pid"], "counter": p["counter"], "ok": ok, "checksums_ok": p["checksums_ok"],
                          "matmul_ok": p["matmul_ok"], "mismatched": p["mismatched"], "tensor_bytes": p["tensor_bytes"],
                          "allocated": p["allocated"], "verify_seconds": p["verify_seconds"], "error": err}
                pending.remove(k)
            elif c.poll() is not None:
                res[k] = {"index": k, "pid": c.pid, "counter": 0, "ok": False, "checksums_ok": False, "matmul_ok": False,
                          "error": "child %d (pid %d) is gone (exit status %s)" % (k, c.pid, c.returncode)}
                pending.remove(k)
            elif time.time() > deadline:
                res[k] = {"index": k, "pid": c.pid, "counter": 0, "ok": False, "checksums_ok": False, "matmul_ok": False,
                          "error": "child %d (pid %d): no proof within %ds" % (k, c.pid, args.child_proof_timeout)}
                pending.remove(k)
        if pending:
            time.sleep(0.02)
    return [res[k] for k in range(len(children))]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--gib-random", type=float, default=4.0)
    p.add_argument("--gib-weights", type=float, default=6.0)
    p.add_argument("--device", default="cuda")
    p.add_argument("--devices", default="", help="CUDA ordinals to spread over, e.g. 0,1 (default: --device alone)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--period", type=float, default=0.05)
    p.add_argument("--rewrite-pct", type=float, default=10.0, help="share of the tensor bytes SIGUSR2 rewrites, percent")
    p.add_argument("--side", type=int, default=8192, help="weight matrices are side x side (8192: 128 MiB in bf16)")
    p.add_argument("--children", type=int, default=0, help="start this many CUDA child processes (a process tree)")
    p.add_argument("--child-mib", type=int, default=512, help="device memory each child holds, MiB")
    p.add_argument("--child-ready-timeout", type=int, default=300, help="seconds the children may take to get ready")
    p.add_argument("--child-proof-timeout", type=int, default=120, help="seconds a child may take to answer a proof request")
    p.add_argument("--child-of", type=int, default=0, help=argparse.SUPPRESS)  # child mode: the parent's pid
    p.add_argument("--child-index", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.children < 0 or args.child_mib < 4 or (args.child_of and args.children):
        p.error("--children must be >= 0 (and not given to a child), --child-mib >= 4")
    os.makedirs(args.dir, exist_ok=True)
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("CUDA is not available", file=sys.stderr)
        sys.exit(3)
    devs = [dev]
    if args.devices:
        if dev.type != "cuda" or args.child_of or args.children:
            p.error("--devices needs --device cuda and no children")
        devs = [torch.device("cuda", int(i)) for i in args.devices.split(",")]
        if max(d.index for d in devs) >= torch.cuda.device_count():
            print("--devices %s: this host has %d CUDA devices" % (args.devices, torch.cuda.device_count()), file=sys.stderr)
            sys.exit(3)
        dev = devs[0]
    if args.child_of:
        child_main(args, dev)
        return
    t0 = time.time()
    torch.manual_seed(args.seed)
    gen = torch.Generator(device=dev)
    gen.manual_seed(args.seed)

    tensors = []  # (name, tensor)
    n_rand = int(args.gib_random * 1024 / 512 + 0.5)
    per = (512 << 20) // 4
    for i in range(n_rand):
        tensors.append(("random%03d" % i, torch.randn(per, generator=gen, device=dev, dtype=torch.float32)))
    wdev = devs[-1]
    if wdev != dev:
        gen = torch.Generator(device=wdev)
        gen.manual_seed(args.seed + 1)
    side = args.side
    n_layers = int(args.gib_weights * 2**30 / (side * side * 2) + 0.5)
    for i in range(n_layers):
        scale = 0.01 + 0.04 * ((i * 7919) % 97) / 96.0
        w = torch.randn(side, side, generator=gen, device=wdev, dtype=torch.float32) * scale
        tensors.append(("layer%03d.weight" % i, w.to(torch.bfloat16)))
        del w
        if i % 8 == 0:
            norm = 1.0 + 0.05 * torch.randn(side, generator=gen, device=wdev, dtype=torch.float32)
            tensors.append(("layer%03d.norm" % i, norm.to(torch.bfloat16)))
    w0 = next(t for name, t in tensors if name.endswith(".weight")) if n_layers else None
    x = torch.randn(256, side, generator=gen, device=wdev, dtype=torch.float32).to(torch.bfloat16)
    extra = []
    if len(devs) > 1:
        # A product pair on every device, checksummed with the rest.
        for d in devs:
            g = torch.Generator(device=d)
            g.manual_seed(args.seed + 7 + d.index)
            xx = torch.randn(256, 2048, generator=g, device=d, dtype=torch.float32).to(torch.bfloat16)
            ww = torch.randn(2048, 2048, generator=g, device=d, dtype=torch.float32).to(torch.bfloat16)
            tensors += [("pair%d.x" % d.index, xx), ("pair%d.w" % d.index, ww)]
            extra.append((xx, ww))
    wk = Worker(dev, tensors, w0, x, CHUNK, extra, devs)
    nbytes = wk.nbytes
    info = {
        "tensors": len(tensors),
        "tensor_bytes": nbytes,
        "device": str(dev),
        "devices": [str(d) for d in devs],
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "allocated": allocated(dev, nbytes),
        "reserved": torch.cuda.memory_reserved(dev) if dev.type == "cuda" else nbytes,
        "setup_seconds": time.time() - t0,
        "torch": torch.__version__,
    }

    state = {"prove": False, "stop": False, "rewrite": False, "rewrites": 0}
    signal.signal(signal.SIGUSR1, lambda s, f: state.__setitem__("prove", True))
    signal.signal(signal.SIGUSR2, lambda s, f: state.__setitem__("rewrite", True))
    signal.signal(signal.SIGTERM, lambda s, f: state.__setitem__("stop", True))
    children = []
    if args.children:
        t1 = time.time()
        children = start_children(args)
        info["children"] = [c.pid for c in children]
        info["children_setup_seconds"] = time.time() - t1
    with open(os.path.join(args.dir, "checksums.json"), "w") as f:
        json.dump({"info": info, "sums": wk.sums}, f, indent=1)
    log(args, "ready: %d tensors, %.2f GiB on %s in %.1fs%s" % (
        len(tensors), nbytes / 2**30, dev, time.time() - t0,
        ", %d children (pids %s) of %d MiB each" % (len(children), " ".join(str(c.pid) for c in children), args.child_mib) if children else ""))
    write_atomic(os.path.join(args.dir, "ready"), "%d\n" % os.getpid())

    while not state["stop"]:
        wk.step()
        if state["rewrite"]:
            state["rewrite"] = False
            state["rewrites"] += 1
            rw = wk.rewrite(args.rewrite_pct, args.seed, state["rewrites"])
            write_atomic(os.path.join(args.dir, "rewritten.json"), json.dumps(rw))
            log(args, "rewrite %d: %d tensors, %.2f GiB (%.1f%% of the tensor bytes) in %.2fs" % (
                rw["generation"], len(rw["tensors"]), rw["bytes"] / 2**30, 100.0 * rw["bytes"] / max(1, wk.nbytes), rw["seconds"]))
        if state["prove"]:
            state["prove"] = False
            # The children verify while this process does.
            t_ask, gone = ask_children(args, children)
            proof = wk.proof()
            if children:
                kids = collect_children(args, children, t_ask, gone)
                bad = [c for c in kids if not c["ok"]]
                proof["children"] = kids
                proof["checksums_ok"] = proof["checksums_ok"] and all(c["checksums_ok"] for c in kids)
                proof["matmul_ok"] = proof["matmul_ok"] and all(c["matmul_ok"] for c in kids)
                proof["mismatched"] = (proof["mismatched"] + [n for c in kids for n in c.get("mismatched", [])])[:20]
                proof["error"] = "; ".join(filter(None, [proof["error"]] + [c["error"] for c in bad]))
                proof["children_tensor_bytes"] = sum(c.get("tensor_bytes", 0) for c in kids)
                proof["verify_seconds"] = time.time() - t_ask
                proof["time"] = time.time()
            write_atomic(os.path.join(args.dir, "proof.json"), json.dumps(proof))
            log(args, "proof: counter %d, checksums %s, matmul %s%s" % (
                wk.counter, "ok" if proof["checksums_ok"] else "BAD %s" % proof["mismatched"][:3], proof["matmul_ok"],
                "; children %s" % " ".join("%d:%d:%s" % (c["pid"], c["counter"], "ok" if c["ok"] else "BAD") for c in proof["children"])
                if children else ""))
            if proof["error"]:
                log(args, "proof error: %s" % proof["error"])
        time.sleep(args.period)
    stop_children(args, children)
    log(args, "stopped at step %d" % wk.counter)


if __name__ == "__main__":
    main()
