#!/usr/bin/env python3
"""Where a deduplicated checkpoint's new bytes are: for the checkpoint
directory NEW against the checkpoint directories OLD... of one location,
the stored bytes of NEW's chunks that none of OLD holds, by file and by kind
of file (CRIU's page images, the fast path's VRAM files, the rest of CRIU's
images). Prints one JSON object.

    newbytes.py LOC/two LOC/one
"""
import json
import os
import re
import sys


def chunks(ckpt):
    with open(os.path.join(ckpt, "manifest.json")) as f:
        m = json.load(f)
    for fl in m.get("files") or []:
        for c in fl.get("chunks") or []:
            yield fl["name"], fl.get("size", 0), c


def kind(name):
    if re.match(r"vram-\d+-\d+\.bin$", name):
        return "vram"
    if re.match(r"pages-\d+\.img$", name):
        return "criu pages"
    return "criu other"


def main():
    new, olds = sys.argv[1], sys.argv[2:]
    held = {c.get("hash") for o in olds for _, _, c in chunks(o)}
    seen, files = set(), {}
    for name, size, c in chunks(new):
        f = files.setdefault(name, {"file": name, "size": size, "new_bytes": 0, "new_chunks": 0})
        h = c.get("hash")
        if not h or h in held or h in seen:
            continue
        seen.add(h)
        f["new_bytes"] += c.get("stored", 0)
        f["new_chunks"] += 1
    by_kind = {}
    for f in files.values():
        k = by_kind.setdefault(kind(f["file"]), {"size": 0, "new_bytes": 0, "files": 0})
        k["size"] += f["size"]
        k["new_bytes"] += f["new_bytes"]
        k["files"] += 1
    top = sorted(files.values(), key=lambda f: -f["new_bytes"])[:12]
    print(json.dumps({"by_kind": by_kind, "top_files": top}))


if __name__ == "__main__":
    main()
