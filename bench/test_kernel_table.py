#!/usr/bin/env python3
"""Checks bench/kernel_table.py on two hand-made traces: kernels are classed and summed per class,
copies and sets counted apart, CPU events ignored, the idle time before kernels the host had not
launched yet found through the launches' correlation ids, and a trace without GPU work refused."""
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import kernel_table  # noqa: E402


def trace(path, events):
    with open(path, "w") as f:
        json.dump({"traceEvents": [dict(ph="X", **e) for e in events]}, f)


def main():
    d = tempfile.mkdtemp()
    a, b, empty = (os.path.join(d, n) for n in ("a.json", "b.json", "empty.json"))
    trace(a, [dict(cat="kernel", name="sm90_xmma_gemm_f32f32_tf32", ts=0, dur=1000),
              dict(cat="kernel", name="sm90_xmma_gemm_f32f32_tf32", ts=1000, dur=500),
              dict(cat="kernel", name="vectorized_elementwise_kernel<4, CUDAFunctor_add<float>>", ts=1500, dur=200),
              dict(cat="gpu_memcpy", name="Memcpy HtoD (Pinned -> Device)", ts=1700, dur=300),
              dict(cat="cpu_op", name="aten::mm", ts=0, dur=9999)])
    trace(b, [dict(cat="kernel", name="fmha_cutlassF_f32_aligned", ts=0, dur=400)])
    trace(empty, [dict(cat="cpu_op", name="aten::mm", ts=0, dur=5)])
    s = kernel_table.summarize(kernel_table.load(a))
    assert abs(s["busy"] - 2.0) < 1e-9, s["busy"]
    assert s["kernels"] == 3, s["kernels"]
    assert s["by_class"]["matrix product"] == [1.5, 2], s["by_class"]["matrix product"]
    assert s["by_class"]["elementwise"] == [0.2, 1], s["by_class"]["elementwise"]
    assert s["by_class"]["memcpy"] == [0.3, 1], s["by_class"]["memcpy"]
    assert abs(s["span"] - 2.0) < 1e-9, s["span"]
    text = kernel_table.tables([a, b], ["x", "y"], top=2)
    assert "| attention | 0.00 (0) | 0.40 (1) | +0.40 |" in text, text
    assert "| matrix product | 1.50 (2) | 0.00 (0) | -1.50 |" in text, text
    # The kernels run back to back; the copy after them is compute idle at the span's end.
    gaps, idle = kernel_table.compute_gaps(kernel_table.load(a), 3)
    assert idle == 300 and gaps == [(300, "vectorized_elementwise_kernel<4, CUDAFunctor_add<float>>", "(end)",
                                     ["HtoD ? MB"])], (idle, gaps)
    assert "| copied HtoD | 0.000 GB (+1 without a byte count) | 0.000 GB |" in text, text  # a's copy has no count
    gap = empty.replace("empty", "gap")
    trace(gap, [dict(cat="gpu_memcpy", name="Memcpy HtoD (Pinned -> Device)", ts=0, dur=20, args={"bytes": 4e6}),
                dict(cat="kernel", name="k1", ts=20, dur=10),
                dict(cat="gpu_memcpy", name="Memcpy DtoH (Device -> Pinned)", ts=10, dur=50, args={"bytes": 2e6}),
                dict(cat="kernel", name="k2", ts=60, dur=10),
                dict(cat="kernel", name="k3", ts=75, dur=5)])
    gaps, idle = kernel_table.compute_gaps(kernel_table.load(gap), 2)
    assert idle == 20 + 30 + 5 and gaps == [(30, "k1", "k2", ["DtoH 2 MB"]), (20, "(start)", "k1", ["HtoD 4 MB", "DtoH 2 MB"])], \
        (idle, gaps)
    copied = kernel_table.summarize(kernel_table.load(gap))["copied"]
    assert copied["HtoD"] == [4000000, 20.0, 0] and copied["DtoH"] == [2000000, 50.0, 0], copied
    assert "| copied DtoH | 0.002 GB at 40.0 GB/s |" in kernel_table.tables([gap], ["g"], top=1), "copy line"
    # Launches linked to kernels: k2 was launched 1 ms into the 1.5 ms stretch before it, so 1 ms of
    # the idle waited for the host; k3 was queued long before it ran. Leads: 1, 0.5 and 4 ms.
    linked = empty.replace("empty", "linked")
    trace(linked, [dict(cat="cuda_runtime", name="cudaLaunchKernel", ts=0, dur=2, args={"correlation": 1}),
                   dict(cat="cuda_runtime", name="cudaLaunchKernel", ts=3000, dur=2, args={"correlation": 2}),
                   dict(cat="cuda_runtime", name="cudaLaunchKernel", ts=500, dur=2, args={"correlation": 3}),
                   dict(cat="kernel", name="k1", ts=1000, dur=1000, args={"correlation": 1}),
                   dict(cat="kernel", name="k2", ts=3500, dur=1000, args={"correlation": 2}),
                   dict(cat="kernel", name="k3", ts=4500, dur=500, args={"correlation": 3})])
    pairs = kernel_table.launches(linked)
    assert pairs == [(1000.0, 0.0), (3500.0, 3000.0), (4500.0, 500.0)], pairs
    assert kernel_table.host_late(kernel_table.load(linked), pairs) == 1000.0
    text = kernel_table.tables([linked, gap], ["l", "g"], top=1)
    assert ("Compute idle, l: 1.50 ms without a kernel running (1.00 ms of it before a kernel the host had not "
            "launched yet; the host's lead at each kernel's start: median 1.00 ms, 10th percentile 0.50 ms)") in text, text
    assert "Compute idle, g: 0.06 ms without a kernel running; the longest" in text, text  # no launches recorded
    r = subprocess.run([sys.executable, os.path.join(HERE, "kernel_table.py"), empty], capture_output=True, text=True)
    assert r.returncode != 0 and "no GPU activity" in r.stderr, (r.returncode, r.stderr)
    print("kernel_table.py: every check passed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
