#!/usr/bin/env python3
"""Checkpoint target for the GPU end-to-end test (e2e/gpu/run.sh).

A PyTorch process that holds a known amount of device memory with known
content and keeps computing:

  * random tensors: float32 torch.randn, --gib-random GiB in 512 MiB tensors
    (activations, optimizer state);
  * model-like weights: bfloat16 matrices drawn as trained weights look
    (normal, per-layer scale 0.01..0.05, plus norm vectors near 1.0),
    --gib-weights GiB in 128 MiB layers.

At start it stores a checksum of every tensor (two 64-bit sums over the raw
bit patterns, one position-weighted, computed on the device) and a reference
product x @ W0. Then it loops: every --period seconds it computes x @ W0
again, compares it bit for bit with the reference and counts the step.

Protocol (files in --dir):
  ready        written once everything is allocated and checksummed: the pid
  proof.json   written on SIGUSR1: every checksum recomputed and compared,
               the product compared, the step counter, device memory in use
  target.log   what it did

Exit codes: 0 on SIGTERM; 2 bad arguments; 3 setup failed.
"""

import argparse
import json
import os
import signal
import sys
import time

import torch

MASK = (1 << 64) - 1
CHUNK = 1 << 26  # elements per checksum pass


def log(args, msg):
    line = "%s pid %d: %s" % (time.strftime("%H:%M:%S"), os.getpid(), msg)
    with open(os.path.join(args.dir, "target.log"), "a") as f:
        f.write(line + "\n")
    print(line, flush=True)


class Checksummer:
    def __init__(self, device):
        self.weights = (torch.arange(CHUNK, device=device, dtype=torch.int64) % 65521) + 1

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
        for i, off in enumerate(range(0, bits.numel(), CHUNK)):
            b = bits[off:off + CHUNK].to(torch.int64)
            s1 += int(b.sum().item())
            s2 += int((b * self.weights[:b.numel()]).sum().item()) * (i + 1)
        return "%016x%016x" % (s1 & MASK, s2 & MASK)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--gib-random", type=float, default=4.0)
    p.add_argument("--gib-weights", type=float, default=6.0)
    p.add_argument("--device", default="cuda")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--period", type=float, default=0.05)
    p.add_argument("--side", type=int, default=8192, help="weight matrices are side x side (8192: 128 MiB in bf16)")
    args = p.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("CUDA is not available", file=sys.stderr)
        sys.exit(3)
    t0 = time.time()
    torch.manual_seed(args.seed)
    gen = torch.Generator(device=dev)
    gen.manual_seed(args.seed)

    tensors = []  # (name, tensor)
    n_rand = int(args.gib_random * 1024 / 512 + 0.5)
    per = (512 << 20) // 4
    for i in range(n_rand):
        tensors.append(("random%03d" % i, torch.randn(per, generator=gen, device=dev, dtype=torch.float32)))
    side = args.side
    n_layers = int(args.gib_weights * 2**30 / (side * side * 2) + 0.5)
    for i in range(n_layers):
        scale = 0.01 + 0.04 * ((i * 7919) % 97) / 96.0
        w = torch.randn(side, side, generator=gen, device=dev, dtype=torch.float32) * scale
        tensors.append(("layer%03d.weight" % i, w.to(torch.bfloat16)))
        del w
        if i % 8 == 0:
            norm = 1.0 + 0.05 * torch.randn(side, generator=gen, device=dev, dtype=torch.float32)
            tensors.append(("layer%03d.norm" % i, norm.to(torch.bfloat16)))
    if dev.type == "cuda":
        torch.cuda.synchronize()
    cs = Checksummer(dev)
    sums = {name: cs(t) for name, t in tensors}
    w0 = next(t for name, t in tensors if name.endswith(".weight")) if n_layers else None
    x = torch.randn(256, side, generator=gen, device=dev, dtype=torch.float32).to(torch.bfloat16)
    ref = (x @ w0) if w0 is not None else None
    if dev.type == "cuda":
        torch.cuda.synchronize()
    nbytes = sum(t.numel() * t.element_size() for _, t in tensors)
    info = {
        "tensors": len(tensors),
        "tensor_bytes": nbytes,
        "device": str(dev),
        "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
        "allocated": torch.cuda.memory_allocated(dev) if dev.type == "cuda" else nbytes,
        "reserved": torch.cuda.memory_reserved(dev) if dev.type == "cuda" else nbytes,
        "setup_seconds": time.time() - t0,
        "torch": torch.__version__,
    }
    with open(os.path.join(args.dir, "checksums.json"), "w") as f:
        json.dump({"info": info, "sums": sums}, f, indent=1)
    log(args, "ready: %d tensors, %.2f GiB on %s in %.1fs" % (len(tensors), nbytes / 2**30, dev, info["setup_seconds"]))

    state = {"prove": False, "stop": False}
    signal.signal(signal.SIGUSR1, lambda s, f: state.__setitem__("prove", True))
    signal.signal(signal.SIGTERM, lambda s, f: state.__setitem__("stop", True))
    tmp = os.path.join(args.dir, ".ready.tmp")
    with open(tmp, "w") as f:
        f.write("%d\n" % os.getpid())
    os.rename(tmp, os.path.join(args.dir, "ready"))

    counter = 0
    matmul_ok = True
    first_error = ""
    while not state["stop"]:
        if ref is not None:
            y = x @ w0
            if not torch.equal(y, ref):
                matmul_ok = False
                if not first_error:
                    d = (y.float() - ref.float()).abs().max().item()
                    first_error = "x @ W0 differs from the reference at step %d (max abs diff %g)" % (counter, d)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        counter += 1
        if state["prove"]:
            state["prove"] = False
            t = time.time()
            bad = [name for name, tt in tensors if cs(tt) != sums[name]]
            proof = {
                "pid": os.getpid(),
                "counter": counter,
                "tensors": len(tensors),
                "tensor_bytes": nbytes,
                "checksums_ok": not bad,
                "mismatched": bad[:20],
                "matmul_ok": matmul_ok,
                "error": first_error,
                "allocated": torch.cuda.memory_allocated(dev) if dev.type == "cuda" else nbytes,
                "verify_seconds": time.time() - t,
                "time": time.time(),
            }
            tmp = os.path.join(args.dir, ".proof.tmp")
            with open(tmp, "w") as f:
                json.dump(proof, f)
            os.rename(tmp, os.path.join(args.dir, "proof.json"))
            log(args, "proof: counter %d, checksums %s, matmul %s" % (counter, "ok" if not bad else "BAD %s" % bad[:3], matmul_ok))
        time.sleep(args.period)
    log(args, "stopped at step %d" % counter)


if __name__ == "__main__":
    main()
