#!/usr/bin/env python3
"""Turns strata_bench JSON (and optionally bench/peers.py JSON) into a Markdown report with PNG
plots for one machine: throughput and peak memory per strategy and model, the memory-vs-speed
trade-off, achieved host-to-device bandwidth against the link, and strata's figures as ratios to
PyTorch's own equivalents measured in the same run.

  python3 reports/make_report.py --strata bench.json [--peers peers.json] --out reports/h200 \
      [--machine "NVIDIA H200"] [--command "the command that produced the JSON"]

Cells that spread over several devices get a table of peak memory per device.

strata_capacity's JSON (one file per search or --fit run) becomes a "Largest that trains" section
and a frontier plot, beside a bench report or alone:

  python3 reports/make_report.py --capacity cap-depth.json [--capacity cap-24g.json ...] --out DIR

The README's tables of results are made from the committed reports' JSON, one table per machine
(a folder's `-bf16` sibling joins it as columns; no matplotlib needed):

  python3 reports/make_report.py --readme-table reports/h200     # prints the table
  python3 reports/make_report.py --update-readme README.md       # rewrites every marked table
"""
import argparse
import json
import os
import re
import statistics

try:  # the plots need matplotlib; --readme-table and --update-readme do not
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import EngFormatter, MaxNLocator
except ImportError:
    plt = None

GIB = 1024 ** 3


def load(path, source):
    """One row per cell: the median over repetitions where the run repeated (Google Benchmark's
    median aggregate), the single run otherwise; a cell with any errored repetition is failed."""
    with open(path) as f:
        doc = json.load(f)
    cells = {}
    for b in doc.get("benchmarks", []):
        name = re.sub(r"/iterations:\d+|/manual_time|/real_time|/repeats:\d+|_(mean|median|stddev|cv)$", "", b["name"])
        cells.setdefault(name, []).append(b)
    rows = []
    for name, group in cells.items():
        failed = [b for b in group if b.get("error_occurred")]
        medians = [b for b in group if b.get("aggregate_name") == "median"]
        runs = [b for b in group if b.get("run_type", "iteration") == "iteration"]
        r = dict(failed[0] if failed else medians[0] if medians else runs[0])
        strategy, _, model = name.rpartition("/")  # options (a schedule, a path) may hold '/'; model names do not
        r.update(strategy=strategy, model=model, source=source, key=name, failed=bool(failed),
                 repetitions=len(runs))
        rows.append(r)
    return doc.get("context", {}), rows


def fmt(x, spec=".1f"):
    return "—" if x is None else format(x, spec)


def byte_unit(values):
    """(name, divisor) of the unit that suits the largest of `values` (bytes): a table of kilobytes
    reads in KiB, not as 0.00 GiB."""
    top = max((v for v in values if v), default=0)
    for name, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if top >= div:
            return name, div
    return "B", 1


def rate_unit(values):
    """The same for bytes per step in decimal units (GB, MB, kB), as link rates are quoted."""
    top = max((v for v in values if v), default=0)
    for name, div in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if top >= div:
            return name, div
    return "B", 1


def status(r):
    """The cell's outcome; strata_bench writes it as the first words of the error message."""
    if not r["failed"]:
        if r["source"] == "peer" and r.get("parity_ok") is None:
            return "ok (parity unchecked)"
        return "ok" if r.get("parity_ok", 1) == 1 else "parity FAIL"
    msg = r.get("error_message", "error")
    if msg.startswith("out of memory"):
        return "OOM"
    return "parity FAIL" if msg.startswith("parity failed") else "error"


def panels(n):
    """One panel per model, at most three to a row; unused panels hidden."""
    cols = min(n, 3)
    rows = (n + cols - 1) // cols
    fig, axes = plt.subplots(rows, cols, figsize=(6.5 * cols, 4.2 * rows), squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax in flat[n:]:
        ax.set_visible(False)
    return fig, flat[:n]


def readable_ticks(axis):
    """Few ticks, in engineering notation (150k, not 150000): a narrow panel's labels must not run together."""
    axis.set_major_locator(MaxNLocator(nbins=5))
    axis.set_major_formatter(EngFormatter(sep=""))


def bar_chart(rows, models, value, ylabel, title, path, scale=1.0):
    fig, axes = panels(len(models))
    for ax, model in zip(axes, models):
        rs = [r for r in rows if r["model"] == model and not r["failed"] and r.get(value) is not None]
        names = [r["strategy"] for r in rs]
        vals = [r[value] * scale for r in rs]
        colors = ["#4c72b0" if r["source"] == "strata" else "#dd8452" for r in rs]
        ax.barh(names, vals, color=colors)
        ax.set_title(model)
        ax.set_xlabel(ylabel)
        readable_ticks(ax.xaxis)
        ax.invert_yaxis()
    fig.suptitle(title + "  (blue: strata, orange: PyTorch peers)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# strata's steps against PyTorch's own, forward+backward, with the targets strata holds itself to
# (bench/notes/reference-speed.md): a slower baseline would flatter every ratio built on it.
# sharded at world size 1 beside FSDP2 at world size 1 has no target of its own yet (None): shown, not judged.
# The pipelines beside torch.distributed.pipelining's schedules (a peer named with its settings,
# "torch_pp_zbv[m=4;ranks=1]": on one GPU both its stages on one rank, as strata's ranks share it),
# shown, not judged: their target is a ratio held across precisions, read off two reports. GPipe's
# schedule needs a rank per stage; on one rank its peer is ScheduleLoopedBFS, GPipe's order with both
# stages on the rank (ONE_RANK_ORDER).
REFERENCE_PAIRS = [("baseline", "torch_baseline", 1.01), ("baseline_checkpoint", "torch_checkpoint", 1.01),
                   ("hook_offload", "torch_checkpoint", 1.03), ("hook_offload_overlap", "torch_checkpoint", 1.03),
                   ("sharded", "fsdp2", None), ("sharded_offload", "fsdp2_cpu_offload", None),
                   ("pipeline_gpipe", "torch_pp_gpipe", None), ("pipeline_1f1b", "torch_pp_1f1b", None),
                   ("pipeline_interleaved", "torch_pp_interleaved", None), ("pipeline_zero_bubble", "torch_pp_zbv", None)]


ONE_RANK_ORDER = {"torch_pp_gpipe": "torch_pp_looped_bfs"}

# The machinery's own cost: a strategy against the strata strategy that computes the same in one
# process (sharded in a world of one recomputes as baseline_checkpoint does; what it adds is its
# units, windows and reductions), with the target it is held to.
OWN_COST_PAIRS = [("sharded", "baseline_checkpoint", 1.03)]


def peer_named(kind, peers):
    """The peer of that kind in this run: by its plain name; a pipeline peer by its name with its
    settings, on one rank (the matrix's pipeline cells share one GPU), the fewest micro-batches first,
    else the schedule that runs its order on one rank."""
    if kind in peers:
        return kind
    if not kind.startswith("torch_pp_"):
        return None
    def micro_batches(name):
        m = re.search(r"m=(\d+)", name)
        return int(m.group(1)) if m else 0
    named = [k for k in peers if k.startswith(kind + "[") and re.search(r"[\[;]ranks=1[;\]]", k)]
    if not named and kind in ONE_RANK_ORDER:
        return peer_named(ONE_RANK_ORDER[kind], peers)
    return min(named, key=micro_batches, default=None)


HOST_BYTES_PER_PARAM = 28  # AdamW on the host: reads p, g, m, v and writes p, m, v (fp32)
# A deferring cell's forward holds waits for the host: its device work is measured by its twin that
# does not defer (same fetches, same compute), with the same options.
DEVICE_TWIN = {"hook_offload_overlap": "hook_offload"}


def device_twin(strategy):
    """The twin's name of a cell named without its precision: "hook_offload_overlap[resident=0]"
    -> "hook_offload[resident=0]"; None where the strategy has none."""
    base, bracket, rest = strategy.partition("[")
    return DEVICE_TWIN[base] + bracket + rest if base in DEVICE_TWIN else None


def host_bytes_per_param(r):
    """AdamW's bytes per parameter on the host; 2 more under bf16/fp16, whose pass also writes
    the travelling copy in the compute dtype (unless transfer=fp32)."""
    m = re.search(r"precision=([^;\]]*)", r["strategy"])
    low = m is not None and not m.group(1).startswith("fp32") and "transfer=fp32" not in m.group(1)
    return HOST_BYTES_PER_PARAM + (2 if low else 0)


def plain(strategy):
    """A cell's strategy without its precision option, for pairing strata with PyTorch's peers of
    the same run ("baseline[precision=bf16]" -> "baseline", "x[a=1;precision=bf16]" -> "x[a=1]")."""
    def drop(m):
        items = [i for i in m.group(1).split(";") if not i.startswith("precision=")]
        return f"[{';'.join(items)}]" if items else ""
    return re.sub(r"\[([^\]]*)\]", drop, strategy)


def deferred(r):
    """A cell whose forward waits for host updates of the step before (bench/METRICS.md)."""
    return (r.get("fetches_behind_host_updates") or 0) > 0


def host_busy_ms(r):
    """The host's own time applying a step's gradients (the optimizer phase where a run lacks it)."""
    return r.get("host_update_ms") or (None if deferred(r) else r["optimizer_ms"])


def host_parameters(r):
    """The parameters a host-stepped cell's optimizer pass updates: all of them, unless the cell
    says fewer (hook_offload with units trained on the device)."""
    return r.get("host_parameters") or r["parameters"]


def host_pass_GBps(r):
    """The rate of a host-stepped cell's optimizer pass (None when its host time is unknown)."""
    busy = host_busy_ms(r)
    return host_bytes_per_param(r) * host_parameters(r) / (busy / 1e3) / 1e9 if busy else None


def fastest_host_pass_GBps(rows):
    """The highest rate any host optimizer pass of the run reached, over every model: the host's
    memory bandwidth is at least that."""
    rates = [host_pass_GBps(r) for r in rows
             if r["source"] == "strata" and not r["failed"] and r.get("optimizer_on_host") and r.get("parameters")]
    return max((x for x in rates if x), default=0.0)


def reference_speed(rs, peers, triad, fastest=0.0):
    by_name = {r["strategy"]: r for r in rs if r["source"] == "strata" and not r["failed"]}
    mine = {plain(name): r for name, r in by_name.items()}
    out = []
    named = [(a, peer_named(b, peers), t) for a, b, t in REFERENCE_PAIRS if a in mine]
    pairs = [(a, b, t) for a, b, t in named if b]
    if pairs:
        out.append("\nReference speed, forward+backward against PyTorch's (target: at or below the ratio shown):\n")
        out.append("| strata | PyTorch | strata ms | PyTorch ms | ratio | target | |\n|---|---|---:|---:|---:|---:|---|")
        for a, b, target in pairs:
            ratio = mine[a]["fwd_bwd_ms"] / peers[b]["fwd_bwd_ms"]
            judged = f"{target:.2f} | {'met' if ratio <= target else 'missed'}" if target else "— | shown"
            if deferred(mine[a]):  # its forward waits for the host's updates: not device time alone
                judged = "— | holds host waits"
            out.append(f"| {a} | {b} | {mine[a]['fwd_bwd_ms']:.1f} | {peers[b]['fwd_bwd_ms']:.1f} | {ratio:.3f} | "
                       f"{judged} |")
    own = [(a, b, t) for a, b, t in OWN_COST_PAIRS if a in mine and b in mine]
    if own:
        out.append("\nThe machinery's own cost, forward+backward against the strata strategy that computes the same "
                   "in one process (target: at or below the ratio shown):\n")
        out.append("| strata | against | ms | against ms | ratio | target | |\n|---|---|---:|---:|---:|---:|---|")
        for a, b, target in own:
            ratio = mine[a]["fwd_bwd_ms"] / mine[b]["fwd_bwd_ms"]
            out.append(f"| {a} | {b} | {mine[a]['fwd_bwd_ms']:.1f} | {mine[b]['fwd_bwd_ms']:.1f} | {ratio:.3f} | "
                       f"{target:.2f} | {'met' if ratio <= target else 'missed'} |")
    host = [r for r in by_name.values() if r.get("optimizer_on_host") and r.get("parameters")]
    # A triad measured low (one moment of a busy host) must not make a floor that a pass of the same
    # run beats: the bandwidth is the larger of the triad and the run's fastest host pass.
    bandwidth = max(triad, fastest)
    if host and triad > 0:
        source = (f"triad {triad:.1f} GB/s, on the host optimizer's threads" if bandwidth == triad else
                  f"{bandwidth:.1f} GB/s, the fastest host pass of this run, above the triad measured beside it "
                  f"({triad:.1f} GB/s, on the host optimizer's threads)")
        out.append(f"\nHost optimizer against the host's memory bandwidth ({source}; "
                   f"{HOST_BYTES_PER_PARAM} bytes per parameter, 30 where a bf16/fp16 travelling copy is written; "
                   "floor = max(device fwd+bwd, host pass at that bandwidth); host busy = the host's own time applying "
                   "the gradients per step (`host_update_ms`; the optimizer phase where a run lacks it), and the "
                   "rate of its pass; host parameters = those the host steps, fewer than the model's where units "
                   "train on the device ((model's): the cell does not count them, so every parameter is taken); "
                   "a cell whose updates overlap the next step takes its device fwd+bwd from the cell that "
                   "does not overlap them, with the same options):\n")
        out.append("| strata | host parameters | host pass floor ms | host busy ms | host pass GB/s | device fwd+bwd ms | "
                   "floor ms | step ms | step / floor |\n|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for r in sorted(host, key=lambda r: r["strategy"]):
            nbytes = host_bytes_per_param(r)
            host_ms = nbytes * host_parameters(r) / (bandwidth * 1e9) * 1e3
            busy = host_busy_ms(r)
            # The twin's device time wherever the run has the twin, also for a repetition in which no
            # fetch happened to wait: the overlapped cell's own forward+backward still runs beside the
            # host's updates, so as its own floor it would read 1.00 x by construction.
            twin = by_name.get(device_twin(r["strategy"]) or "")  # the twin of the same precision
            if twin and not deferred(twin):
                device = twin["fwd_bwd_ms"]
            else:
                device = None if deferred(r) else r["fwd_bwd_ms"]
            floor = max(device or 0.0, host_ms)
            rate = f"{host_pass_GBps(r):.1f}" if busy else "—"
            counted = f"{host_parameters(r):,.0f}" + ("" if r.get("host_parameters") else " (model's)")
            out.append(f"| {r['strategy']} | {counted} | {host_ms:.1f} | "
                       f"{f'{busy:.1f}' if busy else '—'} | {rate} | {f'{device:.1f}' if device else '—'} | "
                       f"{floor:.1f} | {r['real_time']:.1f} | {r['real_time'] / floor:.2f} |")
    return out


# The README's tables: one model, the seed's GPT of 871M parameters, which every machine's matrix
# runs; a machine's bf16 folder ("reports/h200-bf16" beside "reports/h200") adds two columns.
README_MODEL = "gpt-871m"
README_OPEN = "<!-- generated: python3 reports/make_report.py --readme-table "
README_CLOSE = "<!-- end of generated -->"


def committed_rows(folder):
    """The context and rows of a committed report folder: its bench.json and, if present, peers.json."""
    context, rows = load(os.path.join(folder, "bench.json"), "strata")
    peers = os.path.join(folder, "peers.json")
    if os.path.exists(peers):
        rows += load(peers, "peer")[1]
    return context, rows


def readme_table(folder):
    """The README's table for the machine whose committed report is in `folder`, as lines: a line
    naming the machine and linking its reports, then step time and peak allocated memory of every
    cell of README_MODEL (strata's, then PyTorch's peers), in fp32 and, where `folder`-bf16
    exists, in bf16. `folder` as the README names it, relative to the repository's root."""
    folder = folder.rstrip("/")
    root = readme_table.root
    context, rows = committed_rows(os.path.join(root, folder))
    bf16 = folder + "-bf16"
    has_bf16 = os.path.exists(os.path.join(root, bf16, "bench.json"))
    low = committed_rows(os.path.join(root, bf16))[1] if has_bf16 else []
    name = os.path.basename(folder)
    links = f"[report]({folder}/report.md)" + (f", [bf16 report]({bf16}/report.md)" if has_bf16 else "")
    out = [f"**{name}**: {context.get('device_name', '?')}, host {context.get('host_cpu', '?')}, "
           f"LibTorch {context.get('torch_version', '?')}, {str(context.get('date', ''))[:10]}; {links}", ""]
    head = "| strategy | step ms | peak GiB |" + (" bf16 step ms | bf16 peak GiB |" if has_bf16 else "")
    out += [head, "|---|" + "---:|" * (head.count("|") - 2)]

    def cell(r):
        if r is None:
            return "— | — |"
        if r["failed"]:
            return f"{status(r)} | — |"
        peak = r.get("peak_allocated_bytes")
        return f"{r['real_time']:.1f} | {fmt(peak / GIB if peak else None, '.2f')} |"

    def keyed(source, table):
        return {plain(r["strategy"]): r for r in table if r["model"] == README_MODEL and r["source"] == source}

    for source in ("strata", "peer"):
        mine, theirs = keyed(source, rows), keyed(source, low)
        for key in list(mine) + [k for k in theirs if k not in mine]:
            label = f"`{key}`" + (" (PyTorch)" if source == "peer" else "")
            out.append(f"| {label} | {cell(mine.get(key))}" + (f" {cell(theirs.get(key))}" if has_bf16 else ""))
    return out + [""]  # a blank line ends the table before the closing mark


readme_table.root = "."


def readme_blocks(lines):
    """(folder, first line, end line) of every generated table between README_OPEN and README_CLOSE."""
    blocks = []
    for i, line in enumerate(lines):
        if line.startswith(README_OPEN):
            folder = line[len(README_OPEN):].split(" ")[0]
            end = lines.index(README_CLOSE, i)
            blocks.append((folder, i + 1, end))
    return blocks


def update_readme(path):
    """Rewrites every generated table of the README at `path` from the committed JSON."""
    readme_table.root = os.path.dirname(os.path.abspath(path))
    lines = open(path).read().splitlines()
    for folder, start, end in reversed(readme_blocks(lines)):
        lines[start:end] = readme_table(folder)
    with open(path, "w") as f:
        f.write("\n".join(lines) + "\n")
    print(f"make_report.py: rewrote {len(readme_blocks(lines))} tables in {path}")


def capacity_section(paths, out_dir):
    """The 'Largest that trains' section for strata_capacity JSON files: per search, a table (strategy,
    largest size, its parameters, step time and peaks there, what ran out next, the memory model's
    prediction); per --fit run, the strategies that train the model, fastest first; and a plot of
    the frontier (parameters against step time, per strategy, over the probes that trained)."""
    out = ["\n## Largest that trains\n",
           "strata_capacity: each probe a process of its own, a few full steps (optimizer included) after a "
           "parity check of the strategy on the tiny model. Predicted: bench/memory_model.h from the config "
           "alone; 'predicted / measured' compares its bytes at the largest size with the device allocator's peak "
           "and with the host's peak resident memory above the probe's start (on a CPU device, the two parts "
           "with the host's peak).\n"]
    frontier = []
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        ctx, rows = data.get("context", {}), data.get("benchmarks", [])
        gib = lambda b: f"{b / GIB:.2f}" if b else "-"
        device = f"{ctx.get('device_name', '?')}, {ctx.get('device_memory_bytes', 0) / GIB:.3g} GiB" + (
            " emulated" if ctx.get("device_memory_emulated") else "")
        host = f"host {ctx.get('host_memory_bytes', 0) / GIB:.3g} GiB" + (
            " capped" if ctx.get("host_memory_capped") else " available")
        what = (f"{ctx.get('model', '?')} along {ctx.get('axis', '?')}" if ctx.get("mode") == "search"
                else f"which strategies train {ctx.get('model', '?')}")
        out.append(f"### {what}: {device}, {host}\n")
        out.append(f"`{ctx.get('model_config', '')}`, batch {ctx.get('batch', '?')}, {ctx.get('precision', '?')}, "
                   f"{ctx.get('optimizer', '?')}, {ctx.get('steps', '?')} timed step{'' if ctx.get('steps') == 1 else 's'} a probe.\n")
        on_cpu = str(ctx.get("strata_device", "")).startswith("cpu")
        if ctx.get("mode") == "search":
            out.append("'x baseline': parameters at the largest against the baseline's; 'host used': the peak host "
                       "memory there against what the host had (capped or available), where a strategy bound by "
                       "host memory reaches its bound.\n")
            out.append("| strategy | largest | parameters | x baseline | step ms | peak device GiB | peak host GiB | "
                       "host used | next: ran out | predicted largest | predicted / measured device | "
                       "predicted / measured host |")
            out.append("|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|")
            base = next((r.get("parameters", 0) for r in rows if r.get("strategy") == "baseline"), 0)
            host_total = ctx.get("host_memory_bytes", 0)
            for r in rows:
                if "error_message" in r and r.get("largest", -1) < 0:
                    out.append(f"| {r.get('strategy', r['name'])} | {r['error_message'][:80]} |||||||||||| ")
                    continue
                ratio = lambda p, m: f"{p / m:.2f}" if m and p else "-"
                if on_cpu:  # one memory: the host's peak holds both parts
                    device_ratio = ratio(r.get("predicted_device_bytes", 0) + r.get("predicted_host_bytes", 0),
                                         r.get("peak_host_bytes", 0))
                    host_ratio = "-"
                else:
                    device_ratio = ratio(r.get("predicted_device_bytes", 0), r.get("peak_device_bytes", 0))
                    host_ratio = ratio(r.get("predicted_host_bytes", 0), r.get("peak_host_bytes", 0))
                largest, params, peak_host = r.get("largest", -1), r.get("parameters", 0), r.get("peak_host_bytes", 0)
                nxt = f"{r['next']}: " if r.get("next", -1) > 0 else ""
                out.append(f"| {r['strategy']} | {largest if largest > 0 else 'none'} | "
                           f"{params / 1e9:.3f}B | {f'{params / base:.2f}x' if base and params else '-'} | "
                           f"{fmt(r.get('step_ms'))} | {gib(r.get('peak_device_bytes', 0))} | {gib(peak_host)} | "
                           f"{f'{100 * peak_host / host_total:.0f}%' if host_total and peak_host else '-'} | "
                           f"{nxt}{r.get('next_outcome', '')} | "
                           f"{r.get('predicted_largest', -1) if r.get('predicted_largest', -1) > 0 else '-'} | {device_ratio} | "
                           f"{host_ratio} |")
                if "error_message" in r:
                    out.append(f"| | {r['error_message'][:100]} |||||||||||| ")
        else:
            trains = sorted((r for r in rows if r.get("outcome") == "trains"), key=lambda r: r.get("step_ms", 0))
            out.append("| strategy | trains | step ms | peak device GiB | peak host GiB |")
            out.append("|---|---|---:|---:|---:|")
            for r in trains + [r for r in rows if r.get("outcome") != "trains"]:
                out.append(f"| {r.get('strategy', r['name'])} | {r.get('outcome', r.get('error_message', ''))} | "
                           f"{fmt(r.get('step_ms')) if r.get('outcome') == 'trains' else '-'} | "
                           f"{gib(r.get('peak_device_bytes', 0))} | {gib(r.get('peak_host_bytes', 0))} |")
        out.append("")
        for p in data.get("probes", []):
            if p.get("outcome") == "trains":
                frontier.append((f"{p['strategy']} ({os.path.basename(path)})", p["parameters"], p["step_ms"]))
    if frontier and plt is not None and out_dir:
        fig, ax = plt.subplots(figsize=(8, 5))
        for label in sorted({f[0] for f in frontier}):
            pts = sorted((x, y) for l, x, y in frontier if l == label)
            ax.plot([x / 1e9 for x, _ in pts], [y for _, y in pts], marker="o", label=label)
        ax.set_xlabel("parameters (billions)")
        ax.set_ylabel("step ms")
        ax.set_title("Probes that trained: size against step time")
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, "capacity.png"), dpi=110)
        plt.close(fig)
        out.append("![Capacity frontier](capacity.png)\n")
    return out


def checkpoint_section(paths):
    """The 'Checkpoints' section for strata_checkpoint bench and bench/peers.py --checkpoint-dir JSON
    files: per model, each strategy's and peer's save and load (time and GB/s of the state's bytes
    on disk), the wait an asynchronous save costs the step (and its share of the synchronous save),
    the step while the file is written, and the save against DCP's (dcp_fsdp2, else dcp_model)."""
    rows, devices = [], []
    for path in paths:
        with open(path) as f:
            data = json.load(f)
        ctx = data.get("context", {})
        devices.append(ctx.get("device_name") or ctx.get("peers_device") or "?")
        for r in data.get("benchmarks", []):
            kind, who, model = (r["name"].split("/", 2) + ["", ""])[:3]
            rows.append(dict(r, kind=kind, who=who, model=model))
    out = ["\n## Checkpoints\n",
           "strata_checkpoint bench (the whole training state after one AdamW step: training_state(), then "
           "state_files::save; the load must bring back the saved parameters after another step moved them) and "
           f"bench/peers.py --checkpoint-dir (DCP, torch.save), on {', '.join(sorted(set(devices)))}. GB/s: the "
           "files' bytes over the time. strata's save and DCP's (sync_files, its default) end with every file "
           "on the disk (fsync); torch.save's ends in the page cache. Async: what the step waits for before "
           "the file is written in the background.\n"]
    for model in dict.fromkeys(r["model"] for r in rows):
        mine = [r for r in rows if r["model"] == model]
        who = list(dict.fromkeys(r["who"] for r in mine))
        get = lambda w, k: next((r for r in mine if r["who"] == w and r["kind"] == k), None)
        dcp = next((w for w in ("dcp_fsdp2", "dcp_model") if get(w, "checkpoint_save")
                    and not get(w, "checkpoint_save").get("error_occurred")), None)
        out.append(f"### {model}\n")
        unit, div = byte_unit([r.get("bytes", 0) or 0 for r in mine])
        head = (f"| strategy or peer | state {unit} | save ms | save GB/s | load ms | load GB/s | async: step waits ms "
                "| of its sync save | step ms while writing |" + (f" save / {dcp}'s |" if dcp else ""))
        out += [head, "|" + "---|" * (head.count("|") - 1)]
        for w in who:
            save, load, wait = (get(w, k) for k in ("checkpoint_save", "checkpoint_load", "checkpoint_async_blocked"))
            if save and save.get("error_occurred"):
                out.append(f"| {w} | {save.get('error_message', 'error')} |")
                continue
            num = lambda r, k, f="{:.1f}": f.format(r[k]) if r and r.get(k) is not None else "-"
            size = f"{save['bytes'] / div:.2f}" if save and save.get("bytes") else "-"
            line = (f"| {w} | {size} | "
                    f"{num(save, 'real_time')} | {num(save, 'GB_per_s', '{:.2f}')} | {num(load, 'real_time')} | "
                    f"{num(load, 'GB_per_s', '{:.2f}')} | {num(wait, 'real_time')} | {num(wait, 'of_sync_save', '{:.0%}')} | "
                    f"{num(wait, 'step_ms_while_writing')} |")
            if dcp:
                line += f" {save['real_time'] / get(dcp, 'checkpoint_save')['real_time']:.2f}x |" if save else " - |"
            out.append(line)
        out.append("")
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--strata")
    ap.add_argument("--peers")
    ap.add_argument("--out")
    ap.add_argument("--machine", default="")
    ap.add_argument("--command", default="")
    ap.add_argument("--note", default="", help="shown in bold under the header (e.g. that the run was not gated)")
    ap.add_argument("--capacity", action="append", default=[], metavar="JSON",
                    help="strata_capacity JSON: a 'Largest that trains' section (repeatable)")
    ap.add_argument("--checkpoints", action="append", default=[], metavar="JSON",
                    help="strata_checkpoint bench or peers.py --checkpoint-dir JSON: a 'Checkpoints' section (repeatable)")
    ap.add_argument("--readme-table", metavar="FOLDER", help="print the README's table for a committed report folder")
    ap.add_argument("--update-readme", metavar="README", help="rewrite the README's generated tables")
    args = ap.parse_args()
    if args.readme_table:
        print("\n".join(readme_table(args.readme_table)))
        return
    if args.update_readme:
        update_readme(args.update_readme)
        return
    if (args.capacity or args.checkpoints) and not args.strata and args.out:
        os.makedirs(args.out, exist_ok=True)
        title = " and ".join(t for t, on in (("capacity", args.capacity), ("checkpoints", args.checkpoints)) if on)
        out = [f"# strata {title}: {args.machine}\n"] if args.machine else [f"# strata {title}\n"]
        if args.note:
            out.append(f"**{args.note}**\n")
        if args.command:
            out.append(f"Produced by:\n\n```sh\n{args.command}\n```\n")
        if args.capacity:
            out += capacity_section(args.capacity, args.out)
        if args.checkpoints:
            out += checkpoint_section(args.checkpoints)
        with open(os.path.join(args.out, "report.md"), "w") as f:
            f.write("\n".join(out) + "\n")
        print(f"make_report.py: wrote {os.path.join(args.out, 'report.md')}")
        return
    if not args.strata or not args.out:
        ap.error("--strata (or --capacity) and --out are needed to write a report")
    if plt is None:
        ap.error("writing a report needs matplotlib (Debian: python3-matplotlib)")
    os.makedirs(args.out, exist_ok=True)
    context, rows = load(args.strata, "strata")
    peer_context = {}
    if args.peers and os.path.exists(args.peers):
        peer_context, peer_rows = load(args.peers, "peer")
        rows += peer_rows
    models = sorted({r["model"] for r in rows}, key=lambda m: [r["model"] for r in rows].index(m))
    link = float(context.get("h2d_link_GBps", 0) or 0)
    peak = float(context.get("peak_tflops", 0) or 0)

    out = []
    out.append(f"# strata report: {args.machine or context.get('strata_device', '')}\n")
    if args.command:
        out.append(f"Produced by:\n\n```sh\n{args.command}\n```\n")
    sheet = float(context.get("datasheet_tflops", 0) or 0)
    matmul_text = (f"matmul peak {sheet:.4g} TFLOP/s per GPU by datasheet (MFU's denominator, times the GPUs a "
                   f"cell uses) and {peak:.3g} measured (the 'of measured matmul' column's)" if sheet else
                   f"no datasheet matmul figure for this device (MFU not reported); matmul measured at "
                   f"{peak:.3g} TFLOP/s (the 'of measured matmul' column's)")
    link_text = f"; pinned host-to-device link {link:.1f} GB/s" if link else ""
    dispatch = float(context.get("host_dispatch_us", 0) or 0)
    per_cell = [r["host_dispatch_us"] for r in rows
                if r["source"] == "strata" and (r.get("host_dispatch_us") or 0) > 0]
    readings = ([f"{dispatch:.2f} us before the first cell"] if dispatch else []) + (
        [f"{min(per_cell):.2f}-{max(per_cell):.2f} us as the cells start (median "
         f"{statistics.median(per_cell):.2f})"] if per_cell else [])
    if readings:  # ci/gate.py takes the median of a precision's cells as the host's
        link_text += "; the host dispatches an operator in " + " and ".join(readings)
    out.append(f"Device {context.get('strata_device', '?')} ({context.get('device_name', '?')}), host CPU "
               f"{context.get('host_cpu', '?')}, LibTorch {context.get('torch_version', '?')}; "
               f"{matmul_text}{link_text}; "
               f"{context.get('date', '')}. Counters and formulas: bench/METRICS.md. Peers: PyTorch "
               f"{peer_context.get('torch_version', '—')} on the same model and batch. Figures are medians over "
               f"{max((r['repetitions'] for r in rows if r['source'] == 'strata'), default=1)} repetitions where "
               f"the run repeated.\n")
    if args.note:
        out.append(f"**{args.note}**\n")
    for model in models:
        rs = [r for r in rows if r["model"] == model]
        # Peers by their plain names: a run under one precision pairs with peers under the same one
        # ("torch_checkpoint[precision=bf16]" is the torch_checkpoint of a bf16 run).
        base = {plain(r["strategy"]): r for r in rs if r["source"] == "peer" and not r["failed"]}
        out.append(f"\n## {model}\n")
        ran = [r for r in rs if not r["failed"]]
        # Allocator peaks exist on GPUs; on the CPU the strategies' own accounting of the parameter
        # bytes they hold on the device is what differs between them.
        has_allocator = any(r.get("peak_allocated_bytes", 0) for r in ran)
        mem_keys = ["peak_allocated_bytes", "peak_reserved_bytes"] if has_allocator else ["peak_param_bytes"]
        mem_unit, mem_div = byte_unit([r.get(k, 0) or 0 for r in ran for k in mem_keys])
        mem_head = (f"peak alloc {mem_unit} | peak reserved {mem_unit}" if has_allocator
                    else f"peak resident params {mem_unit} (strategy accounting) |")
        if has_allocator:
            mem_head += " |"
        xfer_unit, xfer_div = rate_unit([r.get(k) or 0 for r in ran for k in ("h2d_bytes_per_step", "d2h_bytes_per_step")])
        head = (f"| strategy | | step ms | fwd+bwd ms | optim ms | items/s | {mem_head} "
                f"H2D {xfer_unit}/step | D2H {xfer_unit}/step | H2D GB/s | MFU | of measured matmul |")
        peers_cols = [p for p in ("torch_baseline", "torch_checkpoint", "fsdp2", "fsdp2_cpu_offload") if p in base]
        for p in peers_cols:
            head += f" step / {p} | peak / {p} |"
        out.append(head)
        out.append("|" + "---|" * (head.count("|") - 1))
        for r in rs:
            if r["failed"]:
                out.append(f"| {r['strategy']} ({r['source']}) | {status(r)} |" + " |" * (head.count("|") - 3))
                continue
            line = (f"| {r['strategy']}{'' if r['source'] == 'strata' else ' (peer)'} | {status(r)} | {fmt(r.get('real_time'))} | "
                    f"{fmt(r.get('fwd_bwd_ms'))} | {fmt(r.get('optimizer_ms'))} | {fmt(r.get('items_per_second'), '.0f')} | "
                    + "".join(f"{fmt((r.get(k, 0) or 0) / mem_div, '.2f')} | " for k in mem_keys) +
                    f"{fmt((r.get('h2d_bytes_per_step') or 0) / xfer_div, '.2f')} | {fmt((r.get('d2h_bytes_per_step') or 0) / xfer_div, '.2f')} | "
                    f"{fmt(r.get('h2d_GBps'))} | {fmt(r.get('mfu'), '.2f')} | {fmt(r.get('matmul_fraction'), '.2f')} |")
            for p in peers_cols:
                line += (f" {r['real_time'] / base[p]['real_time']:.2f} | "
                         f"{r['peak_allocated_bytes'] / max(base[p]['peak_allocated_bytes'], 1):.2f} |")
            out.append(line)
        spread = [r for r in rs if not r["failed"] and any(k.startswith("peak_allocated_bytes.") for k in r)]
        if spread:
            out.append("\nPeak memory per device (allocated / reserved GiB):\n")
            out.append("| strategy | " + " | ".join(["device", "allocated", "reserved"]) + " |\n|---|---|---:|---:|")
            for r in spread:
                for k in sorted(k for k in r if k.startswith("peak_allocated_bytes.")):
                    dev = k.split(".", 1)[1]
                    out.append(f"| {r['strategy']} | {dev} | {r[k] / GIB:.2f} | "
                               f"{r.get('peak_reserved_bytes.' + dev, 0) / GIB:.2f} |")
        out += reference_speed(rs, base, float(context.get("host_triad_GBps", 0) or 0), fastest_host_pass_GBps(rows))
        offl = [r for r in rs if "offloaded_params_on_device" in r]
        if offl:
            out.append("\nOffloaded parameters left on the GPU after a step (peers):\n")
            out.append("| peer | offloaded parameters | still on the GPU |\n|---|---:|---:|")
            for r in offl:
                out.append(f"| {r['strategy']} | {r.get('offloaded_params', 0):,} | {r['offloaded_params_on_device']:,} |")
    bar_chart(rows, models, "items_per_second", "items/s", "Throughput", os.path.join(args.out, "throughput.png"))
    # Allocator peaks exist on GPUs only; on a CPU machine plot the strategies' own accounting.
    allocator = any(r.get("peak_allocated_bytes", 0) for r in rows if not r["failed"])
    memory_key = "peak_allocated_bytes" if allocator else "peak_param_bytes"
    unit, div = byte_unit([r.get(memory_key, 0) or 0 for r in rows if not r["failed"]])
    memory_label = f"peak allocated {unit}" if allocator else f"peak resident parameter {unit} (strategy accounting)"
    bar_chart(rows, models, memory_key, unit, "Peak device memory" if allocator else "Peak resident parameters",
              os.path.join(args.out, "memory.png"), 1.0 / div)
    # Memory against speed: lower-left is better.
    # Points carry numbers, named in a key beside the panel: names written at the points ran into
    # each other where strategies land close together.
    fig, axes = panels(len(models))
    for ax, model in zip(axes, models):
        key = []
        for r in rows:
            if r["model"] != model or r["failed"]:
                continue
            y = (r.get(memory_key) or 0) / div
            key.append(f"{len(key) + 1:>2}  {r['strategy']}")
            ax.scatter(r["real_time"], y, c="#4c72b0" if r["source"] == "strata" else "#dd8452")
            ax.annotate(str(len(key)), (r["real_time"], y), xytext=(3, 3), textcoords="offset points", fontsize=7)
        ax.text(1.02, 1.0, "\n".join(key), transform=ax.transAxes, va="top", ha="left", fontsize=6.5,
                family="monospace")
        ax.set_xlabel("step ms")
        ax.set_ylabel(memory_label)
        readable_ticks(ax.xaxis)
        ax.set_title(model)
    fig.suptitle("Memory against speed (lower left is better)")
    fig.tight_layout()
    fig.savefig(os.path.join(args.out, "tradeoff.png"), dpi=110)
    plt.close(fig)
    # Achieved H2D bandwidth of the strategies that move bytes, against the link.
    moving = [r for r in rows if not r["failed"] and (r.get("h2d_GBps") or 0) > 0.01]
    if moving:
        fig, ax = plt.subplots(figsize=(9, 0.45 * len(moving) + 1.5))
        labels = [f"{r['strategy']} / {r['model']}" for r in moving]
        ax.barh(labels, [r["h2d_GBps"] for r in moving], color="#4c72b0")
        if link:
            ax.axvline(link, color="red", linestyle="--", label=f"pinned link {link:.1f} GB/s")
            ax.legend()
        ax.set_xlabel("GB/s host-to-device,\naveraged over a whole training step")
        ax.invert_yaxis()
        fig.tight_layout()
        fig.savefig(os.path.join(args.out, "bandwidth.png"), dpi=110)
        plt.close(fig)
    if args.capacity:
        out += capacity_section(args.capacity, args.out)
    if args.checkpoints:
        out += checkpoint_section(args.checkpoints)
    out.append("\n## Plots\n")
    for png, title in (("throughput.png", "Throughput"), ("memory.png", "Peak memory"),
                       ("tradeoff.png", "Memory against speed"), ("bandwidth.png", "Achieved H2D bandwidth")):
        if os.path.exists(os.path.join(args.out, png)):
            out.append(f"![{title}]({png})\n")
    with open(os.path.join(args.out, "report.md"), "w") as f:
        f.write("\n".join(out) + "\n")
    print(f"make_report.py: wrote {os.path.join(args.out, 'report.md')}")


if __name__ == "__main__":
    main()
