#!/usr/bin/env python3
"""Starts N copies of a command on this machine as the ranks of one job, the torchrun way: each gets
RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR=127.0.0.1 and a free MASTER_PORT. Each
line a rank prints is prefixed with [rank R]. When a rank exits non-zero, the others get --grace
seconds to notice (their collectives fail and they exit with their own message), then are ended;
when --timeout passes, all are ended. Exit status: 0 if every rank exited 0, else the first failing
rank's status (124 on timeout).

On machines with PyTorch, torchrun does the same (torchrun --nproc-per-node=N --no-python CMD);
over several machines use torchrun --nnodes (see README).

  python3 strategies/distributed/launch.py --nproc=2 [--timeout=600] [--grace=20] [--share-device] -- COMMAND [ARGS...]
"""
import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def relay(stream, rank, lock):
    for line in iter(stream.readline, b""):
        with lock:
            sys.stdout.write(f"[rank {rank}] {line.decode(errors='replace')}")
            sys.stdout.flush()


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, required=True)
    ap.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole job")
    ap.add_argument("--grace", type=float, default=20.0, help="seconds the others get after a rank fails")
    ap.add_argument("--share-device", action="store_true",
                    help="every rank computes on one device (cuda:0) instead of cuda:LOCAL_RANK: sets "
                         "STRATA_RANKS_SHARE_DEVICE=1, under which CUDA tensors travel over Gloo")
    ap.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if args.nproc < 1 or not command:
        ap.error(f"--nproc={args.nproc} must be at least 1 and a command must follow '--'")
    port = free_port()
    lock = threading.Lock()
    procs, threads = [], []
    for rank in range(args.nproc):
        env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(args.nproc),
                   LOCAL_WORLD_SIZE=str(args.nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        env.setdefault("NCCL_NVLS_ENABLE", "0")
        if args.share_device:
            env["STRATA_RANKS_SHARE_DEVICE"] = "1"
        p = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                             start_new_session=True)
        t = threading.Thread(target=relay, args=(p.stdout, rank, lock), daemon=True)
        t.start()
        procs.append(p)
        threads.append(t)

    def end(ps, why):
        for p in ps:
            if p.poll() is None:
                print(f"launch.py: ending rank {procs.index(p)} ({why})", flush=True)
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.time() + 5
        for p in ps:
            try:
                p.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()

    # Ended itself (a test's timeout, Ctrl-C): end the ranks too, never leave them holding GPUs and ports.
    def on_signal(signum, frame):
        end(procs, f"launch.py got signal {signum}")
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    start, status, failed_at = time.time(), 0, None
    while any(p.poll() is None for p in procs):
        now = time.time()
        for rank, p in enumerate(procs):
            if p.returncode not in (None, 0) and status == 0:
                status, failed_at = p.returncode, now
                print(f"launch.py: rank {rank} exited with status {p.returncode}", flush=True)
        if failed_at is not None and now - failed_at > args.grace:
            end(procs, f"rank failed {args.grace:.0f} s ago")
            break
        if now - start > args.timeout:
            print(f"launch.py: timeout after {args.timeout:.0f} s", flush=True)
            end(procs, "timeout")
            status = 124
            break
        time.sleep(0.05)
    for t in threads:
        t.join(timeout=2)
    for rank, p in enumerate(procs):
        if p.returncode not in (0, None) and status == 0:
            status = p.returncode
        print(f"launch.py: rank {rank} status {p.returncode}", flush=True)
    if status < 0:  # killed by a signal
        status = 128 - status
    return status


if __name__ == "__main__":
    sys.exit(main())
