#!/usr/bin/env python3
"""Reads a strata checkpoint with PyTorch alone: every file of its manifest has the size and CRC-32
the manifest gives, torch.load returns a dict of tensors, and each tensor's dtype is the manifest's.
Prints one line per tensor ("name dtype shape sum") for the caller to compare.

  python3 correctness/check_torch_load.py CHECKPOINT_DIR
"""
import os
import sys
import zlib

import torch


def main(checkpoint):
    with open(os.path.join(checkpoint, "manifest.txt")) as f:
        lines = f.read().splitlines()
    assert lines[0].startswith("strata checkpoint "), lines[0]
    files, dtypes = [], {}
    for line in lines[1:]:
        key, _, rest = line.partition(" ")
        if key == "file":
            name, size, crc = rest.split()
            files.append((name, int(size), int(crc, 16)))
        elif key == "dtype":
            name, dtype = rest.rsplit(" ", 1)
            dtypes[name] = dtype
    for name, size, crc in files:
        with open(os.path.join(checkpoint, name), "rb") as f:
            data = f.read()
        assert len(data) == size, (name, len(data), size)
        assert zlib.crc32(data) == crc, (name, zlib.crc32(data), crc)
        # weights_only: what torch.load does by default from PyTorch 2.6 on, asked for on every version
        tensors = torch.load(os.path.join(checkpoint, name), weights_only=True)
        for key in sorted(tensors):
            t = tensors[key]
            assert str(t.dtype).replace("torch.", "") in (dtypes[key].lower(), {"Float": "float32", "Long": "int64",
                                                                              "BFloat16": "bfloat16"}.get(dtypes[key])), \
                (key, t.dtype, dtypes[key])
            print(f"{key} {dtypes[key]} {list(t.shape)} {t.double().sum().item():.6f}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
