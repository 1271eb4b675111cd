#!/usr/bin/env python3
"""Whether the link's copies take host memory bandwidth from a memory-bound host pass.

A hook_offload step with an overlapped optimizer runs its host updates while gradients and
windows cross the link, and both go through the host's memory. This times a memory-bound pass on
every core (a triad, a = b + s * c over fp32 tensors of --mb MB each: 12 bytes an element, as
STREAM counts them) alone; a loop of pinned copies of --copy-mb MB to the device, from it, and both
at once (a stream each), alone; then the pass beside each loop. For each pairing it prints the
pass's time and rate, the copies' rate beside it, and the host memory traffic of both together
over the pass's time: where that stays near the pass's rate alone, the copies' bytes came out of
the pass's bandwidth.

  host_link_contention.py [--device cuda:0] [--mb 1024] [--copy-mb 256] [--reps 7] [--out FILE.json]

Needs a CUDA device (the copies are what it measures); exits 2 without one."""
import argparse
import json
import os
import statistics
import sys
import threading
import time

import torch


def copy_loop(kind, device, nbytes, stop, moved):
    """Copies pinned host <-> device buffers of nbytes until stop is set; adds (bytes, seconds) of
    each finished copy to moved."""
    n = nbytes // 4
    host = torch.empty(n, dtype=torch.float32).pin_memory()
    dev = torch.empty(n, dtype=torch.float32, device=device)
    stream = torch.cuda.Stream(device=device)
    with torch.cuda.stream(stream):
        while not stop.is_set():
            start = time.perf_counter()
            if kind == "h2d":
                dev.copy_(host, non_blocking=True)
            else:
                host.copy_(dev, non_blocking=True)
            stream.synchronize()
            moved.append((start, time.perf_counter(), nbytes))


def bytes_between(moved, t0, t1):
    """The bytes of the copies in moved, prorated to the part of each that fell within [t0, t1]."""
    total = 0.0
    for start, end, nbytes in list(moved):
        overlap = min(end, t1) - max(start, t0)
        if overlap > 0 and end > start:
            total += nbytes * overlap / (end - start)
    return total


def run_copies(kinds, device, nbytes, seconds):
    stop = threading.Event()
    moved = {k: [] for k in kinds}
    threads = [threading.Thread(target=copy_loop, args=(k, device, nbytes, stop, moved[k])) for k in kinds]
    for t in threads:
        t.start()
    return stop, moved, threads


def time_pass(a, b, c, reps):
    """Median seconds of the triad over reps runs, and each run's (start, end)."""
    spans = []
    for _ in range(reps):
        start = time.perf_counter()
        torch.add(b, c, alpha=1.5, out=a)
        spans.append((start, time.perf_counter()))
    return statistics.median(e - s for s, e in spans), spans


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--mb", type=int, default=1024, help="MB of each of the pass's three tensors")
    ap.add_argument("--copy-mb", type=int, default=256, help="MB of each copy")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--out", help="the figures as JSON")
    args = ap.parse_args()
    for name in ("mb", "copy_mb", "reps"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')}={getattr(args, name)} must be 1 or more")
    if not args.device.startswith("cuda") or not torch.cuda.is_available():
        print(f"host_link_contention.py: --device={args.device}: needs a CUDA device (the copies over the link "
              "are what it measures)", file=sys.stderr)
        return 2
    torch.set_num_threads(os.cpu_count() or 1)
    n = args.mb * 2**20 // 4
    a, b, c = torch.empty(n), torch.rand(n), torch.rand(n)
    pass_bytes = 12 * n
    copy_bytes = args.copy_mb * 2**20
    time_pass(a, b, c, 2)  # pages touched, threads up
    results = {"threads": torch.get_num_threads(), "pass_bytes": pass_bytes, "copy_bytes": copy_bytes}

    alone, _ = time_pass(a, b, c, args.reps)
    results["pass_alone_ms"] = alone * 1e3
    results["pass_alone_GBps"] = pass_bytes / alone / 1e9
    print(f"pass alone: {alone * 1e3:.1f} ms, {pass_bytes / alone / 1e9:.1f} GB/s "
          f"({results['threads']} threads, 3 x {args.mb} MB)")

    for kinds in (("h2d",), ("d2h",), ("h2d", "d2h")):
        label = "+".join(kinds)
        stop, moved, threads = run_copies(kinds, args.device, copy_bytes, 0)
        time.sleep(0.3)  # the loops running
        t0 = time.perf_counter()
        time.sleep(max(0.5, alone * args.reps))
        t1 = time.perf_counter()
        rate_alone = {k: bytes_between(moved[k], t0, t1) / (t1 - t0) / 1e9 for k in kinds}
        beside, spans = time_pass(a, b, c, args.reps)
        stop.set()
        for t in threads:
            t.join()
        s0, s1 = spans[0][0], spans[-1][1]
        link = {k: bytes_between(moved[k], s0, s1) for k in kinds}
        rate_beside = {k: link[k] / (s1 - s0) / 1e9 for k in kinds}
        total = (pass_bytes * args.reps + sum(link.values())) / (s1 - s0) / 1e9
        results[label] = {"copies_alone_GBps": rate_alone, "pass_ms": beside * 1e3,
                          "pass_GBps": pass_bytes / beside / 1e9, "copies_beside_GBps": rate_beside,
                          "pass_and_link_GBps": total}
        copies = ", ".join(f"{k} {rate_alone[k]:.1f} -> {rate_beside[k]:.1f} GB/s" for k in kinds)
        print(f"beside {label}: pass {beside * 1e3:.1f} ms ({beside / alone:.2f} x alone, "
              f"{pass_bytes / beside / 1e9:.1f} GB/s); copies alone -> beside the pass: {copies}; "
              f"pass and link together {total:.1f} GB/s")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
