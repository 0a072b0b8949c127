#!/usr/bin/env python3
"""Inference-shaped checkpoint target for e2e/gpu/run.sh (rounds infer*).

What vLLM and SGLang look like on a GPU after warm-up, without a model
server: bf16 weights, and a KV cache made with torch.zeros at start-up that
fills most of the memory left, of which a few requests wrote a small part.

  * weights: bfloat16 matrices drawn as trained weights look, --gib-weights
    GiB in --side x --side layers (as torch_target.py);
  * KV cache: a K and a V tensor of shape [blocks, block elements] for each
    of --kv-layers layers (vLLM keeps both in one [2, blocks, ...] tensor a
    layer; two keep every tensor under 2^31 elements, which PyTorch's
    index kernels need), bf16, torch.zeros, together
    --kv-fraction of the device memory free once the weights, the checksum
    scratch and the graphs are in place;
  * requests: runs of consecutive blocks at random places (vLLM hands a
    request its blocks from the free list) whose K and V rows in every
    layer hold random values, --kv-written-pct percent of the blocks;
  * CUDA graphs: --graphs captured graphs (x @ W into a static output),
    replayed every step and compared with their reference, where this
    PyTorch can capture them.

Proof (SIGUSR1, proof.json): every weight's checksum, the written blocks'
checksums (per layer, over the written rows gathered), zeros everywhere else
(the layer's non-zero count equals that of its written rows), x @ W0 and
every graph's output bit for bit, and the step counter. With --cache-marked
the KV cache was handed to gpucr-stream as a cache the process can rebuild
(gpucr_mark_cache in libgpucr-preload): after a restore it comes back as
zeros, so the proof accepts the written rows either intact or all zero and
says which ("kv": "intact" or "dropped").

Protocol files in --dir as torch_target.py: ready (the pid), proof.json,
target.log; checksums.json holds the setup's sums and sizes.
"""

import argparse
import ctypes
import json
import os
import random
import signal
import sys
import time

import torch

from targetfiles import write_atomic
from torch_target import CHUNK, Checksummer, log

NONZERO_CHUNK = 1 << 28  # elements a non-zero count reads at once


def count_nonzero(t):
    flat = t.reshape(-1)
    n = 0
    for off in range(0, flat.numel(), NONZERO_CHUNK):
        n += int(torch.count_nonzero(flat[off:off + NONZERO_CHUNK]).item())
    return n


class KVCache:
    """The per-layer K/V tensors and which block rows the requests wrote."""

    def __init__(self, dev, layers, blocks, block_elems):
        self.dev = dev
        self.blocks = blocks
        self.block_elems = block_elems
        # K and V of each layer: [blocks, block_elems] each.
        self.layers = [torch.zeros((blocks, block_elems), device=dev, dtype=torch.bfloat16) for _ in range(2 * layers)]
        self.rows = None  # int64 tensor of the written blocks' rows
        self.runs = []  # (first block, blocks) of each request
        self.nbytes = sum(t.numel() * t.element_size() for t in self.layers)

    def write_requests(self, pct, seed, max_run):
        """Requests take runs of 1..max_run consecutive blocks at random free
        places until pct percent of the blocks are written; each run's K and
        V rows get random values in every layer."""
        rnd = random.Random(seed)
        want = int(self.blocks * pct / 100.0 + 0.5)
        taken = bytearray(self.blocks)
        done, tries = 0, 0
        while done < want and tries < 100 * max(1, want):
            tries += 1
            n = min(rnd.randint(1, max_run), want - done)
            first = rnd.randrange(0, self.blocks - n + 1)
            if any(taken[first:first + n]):
                continue
            taken[first:first + n] = b"\x01" * n
            self.runs.append((first, n))
            done += n
        blocks = [b for first, n in self.runs for b in range(first, first + n)]
        rows = torch.tensor(blocks, device=self.dev, dtype=torch.int64)
        self.rows = rows
        g = torch.Generator(device=self.dev)
        for i, t in enumerate(self.layers):
            g.manual_seed(seed + 17 * i)
            src = torch.randn((rows.numel(), self.block_elems), generator=g, device=self.dev, dtype=torch.float32)
            t.index_copy_(0, rows, src.to(torch.bfloat16))
            del src
        return done

    def written_bytes(self):
        return 0 if self.rows is None else self.rows.numel() * self.block_elems * 2 * len(self.layers)  # bf16

    def sums(self, cs):
        """(checksum, non-zero count) of the written rows of every layer, and
        the non-zero count of each whole layer."""
        out = []
        for t in self.layers:
            sel = t.index_select(0, self.rows)
            out.append((cs(sel), count_nonzero(sel), count_nonzero(t)))
            sel.zero_()  # left in the allocator's cache it would be written memory
            del sel
        return out


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--device", default="cuda")
    p.add_argument("--gib-weights", type=float, default=15.0)
    p.add_argument("--side", type=int, default=8192)
    p.add_argument("--kv-fraction", type=float, default=0.9, help="share of the free device memory the KV cache takes")
    p.add_argument("--kv-written-pct", type=float, default=5.0, help="percent of the KV blocks the requests write")
    p.add_argument("--kv-layers", type=int, default=32)
    p.add_argument("--kv-block-kib", type=int, default=32, help="one block's K (or V) rows of one layer, KiB (16 tokens x 8 heads x 128 x bf16)")
    p.add_argument("--kv-max-run", type=int, default=128, help="most blocks one request holds (128: 2048 tokens)")
    p.add_argument("--kv-gib", type=float, default=0, help="KV cache size in GiB instead of --kv-fraction (CPU testing)")
    p.add_argument("--graphs", type=int, default=2)
    p.add_argument("--cache-marked", action="store_true", help="mark the KV cache as a cache (gpucr_mark_cache)")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--period", type=float, default=0.05)
    args = p.parse_args()
    os.makedirs(args.dir, exist_ok=True)
    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("CUDA is not available", file=sys.stderr)
        sys.exit(3)
    cuda = dev.type == "cuda"
    t0 = time.time()
    torch.manual_seed(args.seed)
    gen = torch.Generator(device=dev)
    gen.manual_seed(args.seed)

    weights = []
    side = args.side
    n_layers = int(args.gib_weights * 2**30 / (side * side * 2) + 0.5)
    for i in range(n_layers):
        scale = 0.01 + 0.04 * ((i * 7919) % 97) / 96.0
        w = torch.randn(side, side, generator=gen, device=dev, dtype=torch.float32) * scale
        weights.append(("layer%03d.weight" % i, w.to(torch.bfloat16)))
        del w
    if not weights:
        print("--gib-weights gives no layer", file=sys.stderr)
        sys.exit(2)
    cs = Checksummer(dev, CHUNK)
    x = torch.randn(256, side, generator=gen, device=dev, dtype=torch.float32).to(torch.bfloat16)
    w0 = weights[0][1]
    ref = x @ w0
    # The graphs: each x @ W(i) into a static output.
    graphs, graph_note = [], ""
    if cuda and args.graphs > 0:
        try:
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                for i in range(args.graphs):
                    w = weights[(i + 1) % len(weights)][1]
                    out = x @ w  # warm-up on the side stream, as PyTorch asks
            torch.cuda.current_stream().wait_stream(s)
            for i in range(args.graphs):
                w = weights[(i + 1) % len(weights)][1]
                out = torch.empty_like(ref)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    out.copy_(x @ w)
                g.replay()
                graphs.append((g, out, (x @ w).clone()))
            graph_note = "%d CUDA graphs" % len(graphs)
        except Exception as e:  # noqa: BLE001: a PyTorch that cannot capture runs without
            graphs, graph_note = [], "no CUDA graphs: %s" % e
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()  # freed scratch (the float32 weights) back to the driver
        free, total = torch.cuda.mem_get_info(dev)
    else:
        free, total = int(args.kv_gib * 2**30 / max(args.kv_fraction, 1e-9)), 0
    block_elems = args.kv_block_kib * 1024 // 2
    per_block = 2 * block_elems * 2 * args.kv_layers  # K and V of every layer
    kv_bytes = int(args.kv_gib * 2**30) if args.kv_gib else int(free * args.kv_fraction)
    blocks = kv_bytes // per_block
    if blocks < 16:
        print("KV cache of %d bytes holds fewer than 16 blocks" % kv_bytes, file=sys.stderr)
        sys.exit(3)
    kv = KVCache(dev, args.kv_layers, blocks, block_elems)
    written_blocks = kv.write_requests(args.kv_written_pct, args.seed, args.kv_max_run)
    if cuda:
        torch.cuda.empty_cache()  # the requests' random scratch is not the process's memory
    if args.cache_marked:
        lib = ctypes.CDLL(None)
        try:
            mark = lib.gpucr_mark_cache
        except AttributeError:
            print("--cache-marked: gpucr_mark_cache not found (run under gpucr-stream run)", file=sys.stderr)
            sys.exit(3)
        mark.argtypes = [ctypes.c_uint64, ctypes.c_uint64]
        mark.restype = ctypes.c_int
        for t in kv.layers:
            rc = mark(t.data_ptr(), t.numel() * t.element_size())
            if rc != 0:
                print("gpucr_mark_cache(0x%x, %d) = %d" % (t.data_ptr(), t.numel() * 2, rc), file=sys.stderr)
                sys.exit(3)
    if cuda:
        torch.cuda.synchronize()
    wsums = {name: cs(t) for name, t in weights}
    kvsums = kv.sums(cs)
    for i, (_, nz_sel, nz_all) in enumerate(kvsums):
        if nz_sel != nz_all:
            print("setup: layer %d has %d non-zero elements outside the written rows" % (i, nz_all - nz_sel), file=sys.stderr)
            sys.exit(3)
    wbytes = sum(t.numel() * t.element_size() for _, t in weights)
    info = {
        "weights_bytes": wbytes,
        "kv_bytes": kv.nbytes,
        "kv_blocks": blocks,
        "kv_written_blocks": written_blocks,
        "kv_written_bytes": kv.written_bytes(),
        "kv_requests": len(kv.runs),
        "written_bytes": wbytes + kv.written_bytes(),
        "free_before_kv": free,
        "total": total,
        "graphs": graph_note,
        "cache_marked": args.cache_marked,
        "allocated": torch.cuda.memory_allocated(dev) if cuda else wbytes + kv.nbytes,
        "reserved": torch.cuda.memory_reserved(dev) if cuda else wbytes + kv.nbytes,
        "setup_seconds": time.time() - t0,
        "torch": torch.__version__,
    }
    with open(os.path.join(args.dir, "checksums.json"), "w") as f:
        json.dump({"info": info, "weights": wsums, "kv": kvsums}, f, indent=1)

    state = {"prove": False, "stop": False, "counter": 0, "ok": True, "error": ""}
    signal.signal(signal.SIGUSR1, lambda s, f: state.__setitem__("prove", True))
    signal.signal(signal.SIGTERM, lambda s, f: state.__setitem__("stop", True))

    def fail(msg):
        state["ok"] = False
        if not state["error"]:
            state["error"] = msg

    def step():
        if not torch.equal(x @ w0, ref):
            fail("x @ W0 differs at step %d" % state["counter"])
        for i, (g, out, want) in enumerate(graphs):
            g.replay()
            if not torch.equal(out, want):
                fail("graph %d's output differs at step %d" % (i, state["counter"]))
        if cuda:
            torch.cuda.synchronize()
        state["counter"] += 1

    def proof():
        t = time.time()
        bad = [name for name, w in weights if cs(w) != wsums[name]]
        # Each layer is intact, all zero (a marked cache dropped), or bad;
        # a cache comes back whole or as zeros, never partly.
        kinds = []
        for i, ((s0, nz0, _), (s1, nz1, nzall)) in enumerate(zip(kvsums, kv.sums(cs))):
            if nz1 != nzall:
                kinds.append("kv%02d: %d non-zero elements outside the written rows" % (i, nzall - nz1))
            elif s1 == s0 and nz1 == nz0:
                kinds.append("intact")
            elif nzall == 0:
                kinds.append("zero")
            else:
                kinds.append("kv%02d: written rows differ" % i)
        kvbad = [k for k in kinds if k not in ("intact", "zero")]
        if kvbad:
            kvstate = "bad"
        elif all(k == "intact" for k in kinds):
            kvstate = "intact"
        elif args.cache_marked and all(k == "zero" for k in kinds):
            kvstate = "dropped"
        else:
            kvstate = "bad"
            kvbad = ["KV cache: %d of %d layers zero, the rest intact" % (kinds.count("zero"), len(kinds))]
        return {
            "pid": os.getpid(),
            "counter": state["counter"],
            "tensors": len(weights) + len(kv.layers),
            "tensor_bytes": wbytes + kv.nbytes,
            "written_bytes": wbytes + kv.written_bytes(),
            "checksums_ok": not bad and not kvbad,
            "mismatched": (bad + kvbad)[:20],
            "kv": kvstate,
            "matmul_ok": state["ok"],
            "error": state["error"],
            "allocated": torch.cuda.memory_allocated(dev) if cuda else 0,
            "verify_seconds": time.time() - t,
            "time": time.time(),
        }

    log(args, "ready: %.2f GiB weights, KV cache %.2f GiB in %d layers x %d blocks, %d blocks (%.2f GiB) written by %d requests, %s; %.1fs" % (
        wbytes / 2**30, kv.nbytes / 2**30, args.kv_layers, blocks, written_blocks, kv.written_bytes() / 2**30, len(kv.runs),
        graph_note or "no graphs", time.time() - t0))
    write_atomic(os.path.join(args.dir, "ready"), "%d\n" % os.getpid())
    while not state["stop"]:
        step()
        if state["prove"]:
            state["prove"] = False
            pr = proof()
            if cuda:
                torch.cuda.empty_cache()
            write_atomic(os.path.join(args.dir, "proof.json"), json.dumps(pr))
            log(args, "proof: counter %d, checksums %s, kv %s, matmul %s" % (
                pr["counter"], "ok" if pr["checksums_ok"] else "BAD %s" % pr["mismatched"][:3], pr["kv"], pr["matmul_ok"]))
        time.sleep(args.period)
    log(args, "stopped at step %d" % state["counter"])


if __name__ == "__main__":
    main()
