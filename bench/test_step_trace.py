#!/usr/bin/env python3
"""Checks bench/step_trace.py on a hand-made trace of one step boundary: the compute stream is the
one with the most kernels, its idle stretches over the threshold are found (and the shorter one
is not), overlapping kernels do not make a stretch, copies get their rates and the small one is
left out, host updates are told apart from the other annotations, the forward+backward's tail
after its last kernel is split into copies landing and host work alone; a trace without GPU work is
refused."""
import gzip
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import step_trace  # noqa: E402
from test_kernel_table import trace  # noqa: E402  (writes a hand-made trace)


def main():
    d = tempfile.mkdtemp()
    path, empty = os.path.join(d, "t.json"), os.path.join(d, "empty.json")
    k = lambda ts, dur, stream=7, device=0: dict(cat="kernel", name="gemm", ts=ts, dur=dur,  # noqa: E731
                                                  args=dict(stream=stream, device=device))
    trace(path, [
        k(1000, 1000), k(1500, 2000),        # overlapping: busy to 3500
        k(1600, 100),                        # inside the one before: busy still to 3500
        k(3700, 100),                        # 200 us after: below the threshold
        k(10000, 500),                       # 6.2 ms idle before it (from 3800)
        k(2000, 10, stream=9), k(5000, 10, stream=9),  # fewer kernels: not the compute stream
        k(6000, 10, device=1), k(7000, 10, device=1), k(8000, 10, device=1),  # stream 7 of another device
        k(6500, 10, device=1),
        dict(cat="gpu_memcpy", name="Memcpy HtoD (Pinned -> Device)", ts=4000, dur=4000, args=dict(stream=3, bytes=200e6)),
        dict(cat="gpu_memcpy", name="Memcpy DtoH (Device -> Pinned)", ts=4000, dur=100, args=dict(stream=4, bytes=1e6)),
        # Ends in the forward+backward's tail (after its last kernel's end, 3800; before its end, 3900).
        dict(cat="gpu_memcpy", name="Memcpy DtoH (Device -> Pinned)", ts=3790, dur=60, args=dict(stream=4, bytes=2e6)),
        dict(cat="user_annotation", name="strata::forward_backward", ts=900, dur=3000),
        dict(cat="user_annotation", name="strata::host_update block 0", ts=3000, dur=1000, tid=42),
        dict(cat="user_annotation", name="other", ts=0, dur=1),
        dict(cat="cpu_op", name="aten::mm", ts=0, dur=99999)])
    trace(empty, [dict(cat="cpu_op", name="aten::mm", ts=0, dur=5)])
    t = step_trace.read(path, idle_us=300, min_mb=50)
    assert t["compute"] == (0, 7), t["compute"]
    assert t["idle"] == [(2.8, 9.0)], t["idle"]
    assert t["annotations"] == [("strata::forward_backward", -0.1, 2.9)], t["annotations"]
    assert t["host_updates"] == [("strata::host_update block 0", 2.0, 3.0)], t["host_updates"]
    assert len(t["copies"]) == 1, t["copies"]
    kind, start, dur, mb, rate = t["copies"][0]
    assert (kind, start, dur, mb) == ("HtoD", 3.0, 4.0, 200.0) and abs(rate - 50.0) < 1e-9, t["copies"]
    assert len(t["tails"]) == 1, t["tails"]
    a, last, landed, end, mb = t["tails"][0]
    assert [round(x, 6) for x in (a, last, landed, end, mb)] == [-0.1, 2.8, 2.85, 2.9, 2.0], t["tails"]
    text = step_trace.report(t, 300, 50)
    assert "after its last kernel (2.80): 0.10 ms, copies landing for 0.05 ms (2.0 MB), then 0.05 ms with none" in text, text
    assert "compute idle over 300 us: 1 stretches, 6.20 ms" in text, text
    assert "HtoD       3.00    4.00 ms     200.0 MB   50.0 GB/s" in text, text
    r = subprocess.run([sys.executable, os.path.join(HERE, "step_trace.py"), empty], capture_output=True, text=True)
    assert r.returncode != 0 and "no GPU activity" in r.stderr, (r.returncode, r.stderr)
    gz = path + ".gz"
    with open(path, "rb") as src, gzip.open(gz, "wb") as dst:
        dst.write(src.read())
    assert step_trace.read(gz, idle_us=300, min_mb=50)["idle"] == [(2.8, 9.0)]
    r = subprocess.run([sys.executable, os.path.join(HERE, "step_trace.py"), os.path.join(d, "missing.json")],
                       capture_output=True, text=True)
    assert r.returncode != 0 and "cannot read" in r.stderr, (r.returncode, r.stderr)
    print("step_trace.py self-test passed")


if __name__ == "__main__":
    main()
