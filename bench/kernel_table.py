#!/usr/bin/env python3
"""Tabulates the GPU work of profiled steps, side by side: Chrome traces from
`strata_compare --profile=DIR` (LibTorch's profiler) and `bench/peers.py --profile=DIR`
(torch.profiler) read alike. For each trace: GPU busy time (kernels, copies, sets), kernel count,
the span from the first GPU activity to the last; then time by kernel class (matrix products,
attention, layer norm, loss, ...) with the difference against the first trace, and the top kernels
of each.

    kernel_table.py A.trace.json B.trace.json [...] [--labels a,b] [--top N] [--markdown OUT.md]
"""
import argparse
import collections
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


def load(path):
    """GPU activities of a trace as (name, category, start us, duration us)."""
    with open(path) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    out = []
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in CATEGORIES:
            continue
        out.append((e.get("name", "?"), e["cat"].lower(), float(e.get("ts", 0)), float(e.get("dur", 0))))
    if not out:
        sys.exit(f"kernel_table.py: {path} holds no GPU activity (was it recorded on a GPU, with CUDA activities?)")
    return out


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
    for name, cat, _, dur in events:
        c = by_class[classify(name, cat)]
        c[0] += dur / 1e3
        c[1] += 1
        n = by_name[name]
        n[0] += dur / 1e3
        n[1] += 1
    busy = sum(d for *_, d in events) / 1e3
    span = (max(t + d for _, _, t, d in events) - min(t for _, _, t, _ in events)) / 1e3
    kernels = sum(1 for _, cat, _, _ in events if "kernel" in cat)
    return {"busy": busy, "span": span, "kernels": kernels, "by_class": by_class, "by_name": by_name}


def compute_gaps(events, count):
    """The longest stretches in which no kernel ran (copies may have), with the kernels around them:
    where a strategy's compute waited, e.g. for a block's parameters to arrive."""
    kernels = sorted((t, t + d, name) for name, cat, t, d in events if "kernel" in cat)
    gaps, end, last = [], None, None
    for start, stop, name in kernels:
        if end is not None and start > end:
            gaps.append((start - end, last, name))
        if end is None or stop > end:
            end, last = stop, name
    return sorted(gaps, reverse=True)[:count], sum(g for g, _, _ in gaps)


def short(name, width=96):
    name = re.sub(r"\s+", " ", name)
    return name if len(name) <= width else name[: width - 3] + "..."


def tables(paths, labels, top):
    traces = [load(p) for p in paths]
    sums = [summarize(events) for events in traces]
    lines = ["| | " + " | ".join(labels) + " |", "|---|" + "---:|" * len(labels)]
    lines.append("| GPU busy ms | " + " | ".join(f"{s['busy']:.1f}" for s in sums) + " |")
    lines.append("| GPU span ms (first to last activity) | " + " | ".join(f"{s['span']:.1f}" for s in sums) + " |")
    lines.append("| kernels | " + " | ".join(str(s["kernels"]) for s in sums) + " |")
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
    for label, events in zip(labels, traces):
        gaps, total = compute_gaps(events, 5)
        lines += ["", f"Compute idle, {label}: {total / 1e3:.2f} ms without a kernel running; the longest stretches:",
                  "", "| ms | after | before |", "|---:|---|---|"]
        for g, before, after in gaps:
            lines.append(f"| {g / 1e3:.2f} | `{short(before, 60)}` | `{short(after, 60)}` |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("traces", nargs="+")
    ap.add_argument("--labels", help="comma-separated, one per trace (default: the file names)")
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--markdown", help="also write the tables to this file")
    args = ap.parse_args()
    labels = args.labels.split(",") if args.labels else [p.split("/")[-1].replace(".trace.json", "") for p in args.traces]
    if len(labels) != len(args.traces):
        sys.exit(f"kernel_table.py: {len(labels)} labels for {len(args.traces)} traces")
    text = tables(args.traces, labels, args.top)
    print(text)
    if args.markdown:
        with open(args.markdown, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
