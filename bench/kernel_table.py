#!/usr/bin/env python3
"""Tabulates the GPU work of profiled steps, side by side: Chrome traces from
`strata_compare --profile=DIR` (LibTorch's profiler) and `bench/peers.py --profile=DIR`
(torch.profiler) read alike. For each trace: GPU busy time (kernels, copies, sets), kernel count,
the span from the first GPU activity to the last, bytes copied each way; then time by kernel class
(matrix products, attention, layer norm, loss, ...) with the difference against the first trace,
the top kernels of each, and the longest stretches without a kernel (the start and end of the
span included), with the copies that ran during each: where compute waited for the link. Where
the trace links each kernel to its launch (the profilers' correlation ids), also how far ahead of
the GPU the host launched (its lead) and how much of the idle time came before a kernel that the
host had not launched yet: where compute waited for the host.

    kernel_table.py A.trace.json B.trace.json [...] [--labels a,b] [--top N] [--gaps N] [--markdown OUT.md]
"""
import argparse
import collections
import functools
import json
import re
import sys

# First match wins; names are CUDA kernel names as the profiler records them.
CLASSES = [
    ("matrix product", r"gemm|nvjet|cutlass.*(tensorop|gemm)|xmma|cublas|sm\d+_xmma|s\d+gemm|magma"),
    ("attention", r"fmha|flash|attention|efficient_attention|mem_eff"),
    ("layer norm", r"layer_norm|LayerNorm|layernorm"),
    ("softmax / loss", r"softmax|nll_loss|cross_entropy|log_softmax"),
    ("gelu", r"gelu|Gelu"),
    ("embedding / index", r"embedding|indexSelect|index_select|index_put|scatter|gather|indexFuncLarge"),
    ("optimizer (multi-tensor)", r"multi_tensor_apply|foreach|fused_adam|FusedAdam"),
    ("reduction", r"reduce_kernel|Reduce|reduction"),
    ("copy / layout", r"copy|transpose|cat_|CatArray|contiguous|permute"),
    ("elementwise", r"elementwise|vectorized|unrolled|Functor|pointwise"),
]
CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset", "Kernel", "Memcpy", "Memset"}


@functools.lru_cache(maxsize=None)
def trace_events(path):
    """A trace's events, read once however many tables ask (traces run to tens of MB)."""
    with open(path) as f:
        data = json.load(f)
    return data["traceEvents"] if isinstance(data, dict) else data


def load(path):
    """GPU activities of a trace as (name, category, start us, duration us, bytes or None where the
    trace gives no byte count)."""
    out = []
    for e in trace_events(path):
        if e.get("ph") != "X" or e.get("cat") not in CATEGORIES:
            continue
        nbytes = e.get("args", {}).get("bytes")
        nbytes = None if nbytes is None else int(nbytes)
        out.append((e.get("name", "?"), e["cat"].lower(), float(e.get("ts", 0)), float(e.get("dur", 0)), nbytes))
    if not out:
        sys.exit(f"kernel_table.py: {path} holds no GPU activity (was it recorded on a GPU, with CUDA activities?)")
    return out


def launches(path):
    """Each kernel's start on the GPU and its launch on the host (us), paired by the traces'
    correlation ids; empty when the trace records no launches."""
    events = trace_events(path)
    launched = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("cuda_runtime", "cuda_driver"):
            c = e.get("args", {}).get("correlation")
            if c is not None:
                launched[c] = float(e.get("ts", 0))
    out = []
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "Kernel"):
            c = e.get("args", {}).get("correlation")
            if c in launched:
                out.append((float(e.get("ts", 0)), launched[c]))
    return sorted(out)


def host_late(events, pairs):
    """Of the compute-idle time, the part before a kernel that the host had not launched yet: for
    each stretch without a kernel, from its start to the next kernel's launch, where that launch
    came inside the stretch (us, total)."""
    kernels = sorted((t, t + d) for name, cat, t, d, _ in events if "kernel" in cat)
    launch_at = dict(pairs)
    late, end = 0.0, None
    for start, stop in kernels:
        if end is not None and start > end and start in launch_at:
            late += max(0.0, min(launch_at[start], start) - end)
        end = stop if end is None else max(end, stop)
    return late


def percentile(values, q):
    v = sorted(values)
    return v[min(len(v) - 1, int(q * len(v)))]


def classify(name, category):
    if "memcpy" in category:
        return "memcpy"
    if "memset" in category:
        return "memset"
    for label, pattern in CLASSES:
        if re.search(pattern, name, re.IGNORECASE):
            return label
    return "other"


def summarize(events):
    by_class = collections.defaultdict(lambda: [0.0, 0])
    by_name = collections.defaultdict(lambda: [0.0, 0])
    copied = collections.defaultdict(lambda: [0, 0.0, 0])  # direction -> bytes, us, copies without a count
    for name, cat, _, dur, nbytes in events:
        if "memcpy" in cat:
            c = copied[direction(name)]
            if nbytes is None:
                c[2] += 1
            else:
                c[0] += nbytes
                c[1] += dur
        c = by_class[classify(name, cat)]
        c[0] += dur / 1e3
        c[1] += 1
        n = by_name[name]
        n[0] += dur / 1e3
        n[1] += 1
    busy = sum(e[3] for e in events) / 1e3
    span = (max(e[2] + e[3] for e in events) - min(e[2] for e in events)) / 1e3
    kernels = sum(1 for e in events if "kernel" in e[1])
    return {"busy": busy, "span": span, "kernels": kernels, "by_class": by_class, "by_name": by_name,
            "copied": copied}


def direction(name):
    """HtoD, DtoH, DtoD, ... from a copy's name ("Memcpy HtoD (Pinned -> Device)")."""
    m = re.search(r"\b([A-Za-z])to([A-Za-z])\b", name)
    return f"{m.group(1).upper()}to{m.group(2).upper()}" if m else "copy"


def compute_gaps(events, count):
    """The longest stretches in which no kernel ran, with the kernels around them ("(start)" and
    "(end)" for the span's first and last GPU activity, a copy or a set) and the copies that ran
    during each, as "HtoD 201 MB": where a strategy's compute waited, e.g. for a block's parameters
    to arrive or its gradients to leave. Returns them longest first, and their total in us."""
    kernels = sorted((t, t + d, name) for name, cat, t, d, _ in events if "kernel" in cat)
    copies = [(t, t + d, f"{direction(name)} " + ("?" if nbytes is None else f"{nbytes / 1e6:.0f}") + " MB")
              for name, cat, t, d, nbytes in events if "memcpy" in cat]
    first = min(e[2] for e in events)
    last_end = max(e[2] + e[3] for e in events)
    spans, end, last = [], first, "(start)"
    for start, stop, name in kernels:
        if start > end:
            spans.append((end, start, last, name))
        if stop > end or last == "(start)":
            end, last = max(stop, end), name
    if last_end > end:
        spans.append((end, last_end, last, "(end)"))
    gaps = [(b - a, before, after, [c for s, e, c in copies if s < b and e > a]) for a, b, before, after in spans]
    return sorted(gaps, key=lambda g: -g[0])[:count], sum(g[0] for g in gaps)


def short(name, width=96):
    name = re.sub(r"\s+", " ", name)
    return name if len(name) <= width else name[: width - 3] + "..."


def tables(paths, labels, top, gap_count=5):
    traces = [load(p) for p in paths]
    sums = [summarize(events) for events in traces]
    lines = ["| | " + " | ".join(labels) + " |", "|---|" + "---:|" * len(labels)]
    lines.append("| GPU busy ms | " + " | ".join(f"{s['busy']:.1f}" for s in sums) + " |")
    lines.append("| GPU span ms (first to last activity) | " + " | ".join(f"{s['span']:.1f}" for s in sums) + " |")
    lines.append("| kernels | " + " | ".join(str(s["kernels"]) for s in sums) + " |")
    for way in sorted({w for s in sums for w in s["copied"]}):
        cells = []
        for s in sums:
            # The rate over the copies' summed durations: copies that overlapped each other show a
            # lower rate than the link gave them.
            nbytes, us, unknown = s["copied"].get(way, (0, 0.0, 0))
            cell = f"{nbytes / 1e9:.3f} GB" + (f" at {nbytes / us / 1e3:.1f} GB/s" if us > 0 else "")
            cells.append(cell + (f" (+{unknown} without a byte count)" if unknown else ""))
        lines.append(f"| copied {way} | " + " | ".join(cells) + " |")
    lines.append("")
    classes = sorted({c for s in sums for c in s["by_class"]}, key=lambda c: -max(s["by_class"][c][0] for s in sums))
    head = "| class | " + " | ".join(f"{l} ms (n)" for l in labels)
    head += " | " + " | ".join(f"{l} - {labels[0]} ms" for l in labels[1:]) + " |"
    lines += [head, "|---|" + "---:|" * (2 * len(labels) - 1)]
    for c in classes:
        row = [f"{s['by_class'][c][0]:.2f} ({s['by_class'][c][1]})" for s in sums]
        diff = [f"{s['by_class'][c][0] - sums[0]['by_class'][c][0]:+.2f}" for s in sums[1:]]
        lines.append(f"| {c} | " + " | ".join(row + diff) + " |")
    for label, s in zip(labels, sums):
        lines += ["", f"Top {top} kernels, {label}:", "", "| ms | n | share | kernel |", "|---:|---:|---:|---|"]
        for name, (ms, n) in sorted(s["by_name"].items(), key=lambda kv: -kv[1][0])[:top]:
            lines.append(f"| {ms:.2f} | {n} | {ms / s['busy']:.1%} | `{short(name)}` |")
    for path, label, events in zip(paths, labels, traces):
        gaps, total = compute_gaps(events, gap_count)
        pairs = launches(path)
        host = ""
        if pairs:
            leads = [(gpu - host_ts) / 1e3 for gpu, host_ts in pairs]
            host = (f" ({host_late(events, pairs) / 1e3:.2f} ms of it before a kernel the host had not launched yet; "
                    f"the host's lead at each kernel's start: median {percentile(leads, 0.5):.2f} ms, "
                    f"10th percentile {percentile(leads, 0.1):.2f} ms)")
        lines += ["", f"Compute idle, {label}: {total / 1e3:.2f} ms without a kernel running{host}; the longest stretches:",
                  "", "| ms | after | before | copies meanwhile |", "|---:|---|---|---|"]
        for g, before, after, during in gaps:
            lines.append(f"| {g / 1e3:.2f} | `{short(before, 60)}` | `{short(after, 60)}` | {', '.join(during) or '-'} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--labels", help="comma-separated, one per trace (default: the file names)")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--gaps", type=int, default=5, help="how many of the longest compute-idle stretches to list")
    ap.add_argument("--markdown", help="also write the tables to this file")
    args = ap.parse_args()
    labels = args.labels.split(",") if args.labels else [p.split("/")[-1].replace(".trace.json", "") for p in args.traces]
    if len(labels) != len(args.traces):
        sys.exit(f"kernel_table.py: {len(labels)} labels for {len(args.traces)} traces")
    text = tables(args.traces, labels, args.top, args.gaps)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
