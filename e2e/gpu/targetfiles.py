"""What the GPU test targets (torch_target.py, nccl_pair.py) share
without importing torch: the files run.sh reads appear whole."""

import os


def write_atomic(path, text):
    tmp = os.path.join(os.path.dirname(path), "." + os.path.basename(path) + ".tmp")
    with open(tmp, "w") as f:
        f.write(text)
    os.rename(tmp, path)
