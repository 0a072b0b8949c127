#!/usr/bin/env python3
"""Two processes talking over NCCL, for the GPU end-to-end test's `nccl`
round (e2e/gpu/run.sh): can a pair that shares a communicator be
checkpointed and restored?

Rank 0 (this process, cuda:0) starts rank 1 (this script again, cuda:1)
by fork + exec in its session, as torch_target.py starts its children. Each
rank holds --mib MiB of float32 random tensors (checksummed as
torch_target.py does) and loops: all_reduce of a vector of its rank + 1,
which must sum to 3 everywhere, and a counter. The files in --dir follow
torch_target.py's protocol (ready, proof.json on SIGUSR1 with rank 1 as
child 0: ready-child-0, proof-child-0.json), so run.sh proves it the same
way. NCCL_NVLS_ENABLE=0 is forced (no NVLink multicast on shared hosts).

With --tp-layers N the pair is also a tensor-parallel model (Megatron's
MLP split): N layers of d -> 4d -> d with residuals, bf16, each rank holding
half of every layer's columns of W1 and rows of W2; a layer's output is the
all_reduce of the two halves. Every step runs the model on a fixed input and
compares the output bit for bit with the one of the first step (same
communicator, same ring, same sums); the weights are checksummed with the
other tensors.

With --launch this process is torchrun's agent instead: it holds no GPU
(and imports no torch), starts rank 0 and rank 1 as its two children, and
answers for them: ready (its pid) once both are, with rank 1 as child 0
(ready-child-0) and rank 0 as child 1 (ready-child-1); on SIGUSR1 it asks
rank 0 for a proof and writes proof.json with both ranks as its children.
CRIU restores a parent's memory before it forks the children, which then
restore theirs at once: with rank 0 as rank 1's parent the two restore one
after the other.

While --dir/pause exists, the pair idles at a collective boundary both
ranks agree on: rank 0 adds PAUSE to its all_reduce input when it sees the
file, every rank sees the sum and stops after that same collective, writes
paused-RANK, and waits (no GPU work in flight) until the file is gone.
"""

import argparse
import json
import os
import signal
import subprocess
import sys
import time

from targetfiles import write_atomic

os.environ["NCCL_NVLS_ENABLE"] = "0"
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

PAUSE = 1000.0


def unlink(*paths):
    for path in paths:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass


def rank_args(a, rank):
    return [sys.executable, os.path.abspath(__file__), "--dir", a.dir, "--rank", str(rank), "--mib", str(a.mib),
            "--period", str(a.period), "--tp-layers", str(a.tp_layers), "--tp-dim", str(a.tp_dim)]


def launch(a):
    """torchrun's layout: both ranks are children of this process."""
    unlink(*(os.path.join(a.dir, f) for f in ("ready", "ready-child-0", "ready-child-1", "proof-child-0.json",
                                                  "proof-child-1.json", "proof.json", "store")))
    out = open(os.path.join(a.dir, "child-0.out"), "ab")
    ranks = [subprocess.Popen(rank_args(a, r) + ["--launched"], stdin=subprocess.DEVNULL, stdout=out if r else None,
                              stderr=subprocess.STDOUT if r else None, close_fds=True) for r in (0, 1)]
    state = {"prove": False, "stop": False}
    signal.signal(signal.SIGUSR1, lambda s, f: state.__setitem__("prove", True))
    signal.signal(signal.SIGTERM, lambda s, f: state.__setitem__("stop", True))

    def gone():
        for r, k in enumerate(ranks):
            if k.poll() is not None:
                print("rank %d exited with %s" % (r, k.returncode), flush=True)
                return True
        return False

    while not all(os.path.exists(os.path.join(a.dir, "ready-child-%d" % i)) for i in (0, 1)):
        if gone():
            sys.exit(3)
        time.sleep(0.05)
    write_atomic(os.path.join(a.dir, "ready"), "%d\n" % os.getpid())
    print("launcher ready: ranks %d and %d, pid %d" % (ranks[0].pid, ranks[1].pid, os.getpid()), flush=True)
    path = os.path.join(a.dir, "proof-child-1.json")
    while not state["stop"]:
        time.sleep(0.05)
        if not state["prove"]:
            continue
        state["prove"] = False
        unlink(path)
        t_ask = time.time()
        os.kill(ranks[0].pid, signal.SIGUSR1)
        r0 = None
        while r0 is None and time.time() < t_ask + 150 and not gone():
            if os.path.exists(path):
                r0 = json.load(open(path))
            time.sleep(0.05)
        if r0 is None:
            r0 = {"pid": ranks[0].pid, "counter": 0, "checksums_ok": False, "matmul_ok": False,
                  "error": "rank 0: no proof within 150s", "mismatched": [], "children": []}
        kids = r0.pop("children", [])
        r0["ok"] = bool(r0["checksums_ok"] and r0["matmul_ok"] and not r0["error"])
        mine = dict(r0, pid=os.getpid(), children=kids + [r0], time=time.time())
        mine["checksums_ok"] = all(k.get("checksums_ok") for k in mine["children"])
        mine["matmul_ok"] = all(k.get("matmul_ok") for k in mine["children"])
        mine["error"] = "; ".join(filter(None, [k.get("error") for k in mine["children"]])) + ("" if len(kids) == 1 else "; rank 0 answered without rank 1")
        write_atomic(os.path.join(a.dir, "proof.json"), json.dumps(mine))
        print("proof: counter %d, ranks %s" % (mine["counter"], [k["ok"] for k in mine["children"]]), flush=True)
    for k in ranks:
        k.terminate()
    for k in ranks:
        k.wait()


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--mib", type=int, default=1024)
    p.add_argument("--period", type=float, default=0.05)
    p.add_argument("--tp-layers", type=int, default=0)
    p.add_argument("--tp-dim", type=int, default=4096)
    p.add_argument("--launch", action="store_true", help="start both ranks as children and hold no GPU")
    p.add_argument("--launched", action="store_true", help="(rank) started by --launch")
    a = p.parse_args()
    os.makedirs(a.dir, exist_ok=True)
    if a.launch:
        return launch(a)
    rank_main(a)


def rank_main(a):
    global torch, dist
    import torch
    import torch.distributed as dist
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from torch_target import Checksummer

    dev = torch.device("cuda", a.rank)
    torch.cuda.set_device(dev)
    child = None
    if a.rank == 0 and not a.launched:
        unlink(*(os.path.join(a.dir, f) for f in ("ready-child-0", "proof-child-0.json", "store")))
        out = open(os.path.join(a.dir, "child-0.out"), "ab")
        child = subprocess.Popen(rank_args(a, 1), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                                 close_fds=True)
    dist.init_process_group("nccl", init_method="file://" + os.path.join(a.dir, "store"), rank=a.rank, world_size=2,
                            device_id=dev)
    g = torch.Generator(device=dev)
    g.manual_seed(99 + a.rank)
    per = (256 << 20) // 4
    tensors = [("rank%d.random%02d" % (a.rank, i), torch.randn(per, generator=g, device=dev)) for i in range(max(1, a.mib // 256))]
    # The model's shards: the same seed on both ranks gives the whole
    # layer, each keeps its half (columns of W1, rows of W2).
    d, layers = a.tp_dim, []
    gw = torch.Generator(device=dev)
    gw.manual_seed(7)
    for i in range(a.tp_layers):
        w1 = (torch.randn(d, 4 * d, generator=gw, device=dev) * 0.02).to(torch.bfloat16)
        w2 = (torch.randn(4 * d, d, generator=gw, device=dev) * 0.02).to(torch.bfloat16)
        h = 2 * d
        layers.append((w1[:, a.rank * h:(a.rank + 1) * h].contiguous(), w2[a.rank * h:(a.rank + 1) * h, :].contiguous()))
        del w1, w2
        tensors += [("rank%d.tp%02d.w1" % (a.rank, i), layers[-1][0]), ("rank%d.tp%02d.w2" % (a.rank, i), layers[-1][1])]
    x0 = (torch.randn(64, d, generator=gw, device=dev)).to(torch.bfloat16)

    def model():
        x = x0
        for w1, w2 in layers:
            y = torch.nn.functional.gelu(x @ w1) @ w2
            dist.all_reduce(y)
            x = x + y
        return x

    y0 = model() if layers else None
    cs = Checksummer(dev)
    sums = {n: cs(t) for n, t in tensors}
    vec = torch.empty(1 << 20, device=dev)
    state = {"prove": False, "stop": False, "counter": 0, "ok": True, "error": ""}
    signal.signal(signal.SIGUSR1, lambda s, f: state.__setitem__("prove", True))
    signal.signal(signal.SIGTERM, lambda s, f: state.__setitem__("stop", True))

    pause = os.path.join(a.dir, "pause")

    def step():
        flag = PAUSE if a.rank == 0 and os.path.exists(pause) else 0
        vec.fill_(a.rank + 1 + flag)
        dist.all_reduce(vec)
        torch.cuda.synchronize(dev)
        paused = float(vec[0]) >= PAUSE
        want = 3 + (PAUSE if paused else 0)
        if state["ok"] and not bool((vec == want).all()):
            state["ok"] = False
            state["error"] = "rank %d: all_reduce gave %s at step %d, want %d" % (a.rank, vec[:4].tolist(), state["counter"], want)
        if layers and state["ok"] and not torch.equal(model(), y0):
            state["ok"] = False
            state["error"] = "rank %d: the tensor-parallel model's output changed at step %d" % (a.rank, state["counter"])
        state["counter"] += 1
        if paused:
            mark = os.path.join(a.dir, "paused-%d" % a.rank)
            write_atomic(mark, "%d\n" % state["counter"])
            while os.path.exists(pause):
                time.sleep(0.01)
            try:
                os.unlink(mark)
            except FileNotFoundError:
                print("rank %d: %s was gone at the end of the pause" % (a.rank, mark), flush=True)

    def proof():
        t = time.time()
        bad = [n for n, tt in tensors if cs(tt) != sums[n]]
        return {"pid": os.getpid(), "counter": state["counter"], "tensors": len(tensors),
                "tensor_bytes": sum(tt.numel() * tt.element_size() for _, tt in tensors), "checksums_ok": not bad, "mismatched": bad,
                "matmul_ok": state["ok"], "error": state["error"], "verify_seconds": time.time() - t, "time": time.time()}

    step()
    if a.rank == 1:
        write_atomic(os.path.join(a.dir, "ready-child-0"), "%d\n" % os.getpid())
    else:
        while not os.path.exists(os.path.join(a.dir, "ready-child-0")):
            if child and child.poll() is not None:
                print("rank 1 exited with %s before it was ready" % child.returncode, flush=True)
                sys.exit(3)
            time.sleep(0.05)
        peer = child.pid if child else int(open(os.path.join(a.dir, "ready-child-0")).read())
        write_atomic(os.path.join(a.dir, "ready-child-1" if a.launched else "ready"), "%d\n" % os.getpid())
    print("rank %d ready: %d MiB on %s, pid %d" % (a.rank, a.mib, dev, os.getpid()), flush=True)
    while not state["stop"]:
        # Both ranks must step: a proof is asked of rank 0, which passes
        # it on and waits for rank 1's answer while stepping.
        step()
        if state["prove"]:
            state["prove"] = False
            if a.rank == 1:
                write_atomic(os.path.join(a.dir, "proof-child-0.json"), json.dumps(proof()))
            else:
                t_ask = time.time()
                try:
                    os.unlink(os.path.join(a.dir, "proof-child-0.json"))
                except FileNotFoundError:
                    pass
                os.kill(peer, signal.SIGUSR1)
                mine = proof()
                kid, path = None, os.path.join(a.dir, "proof-child-0.json")
                while kid is None and time.time() < t_ask + 120:
                    step()
                    if os.path.exists(path):
                        kid = json.load(open(path))
                    time.sleep(a.period)
                if kid is None:
                    kid = {"pid": peer, "counter": 0, "checksums_ok": False, "matmul_ok": False,
                           "error": "rank 1: no proof within 120s", "mismatched": []}
                kid["ok"] = bool(kid["checksums_ok"] and kid["matmul_ok"] and not kid["error"])
                mine["children"] = [kid]
                mine["checksums_ok"] = mine["checksums_ok"] and kid["checksums_ok"]
                mine["matmul_ok"] = mine["matmul_ok"] and kid["matmul_ok"]
                mine["error"] = "; ".join(filter(None, [mine["error"], kid["error"]]))
                write_atomic(os.path.join(a.dir, "proof-child-1.json" if a.launched else "proof.json"), json.dumps(mine))
                print("proof: counter %d, ok %s, rank 1 %s" % (mine["counter"], mine["checksums_ok"] and mine["matmul_ok"], kid["ok"]), flush=True)
        time.sleep(a.period)
    if child:
        child.terminate()
        child.wait()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
