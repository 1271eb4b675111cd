#!/usr/bin/env python3
"""A trace of whole steps (strata_compare --profile=DIR --profile-steps=N) read along one time axis:
the strata annotations (forward+backward, optimizer step, hook_offload's host updates), the
compute stream's idle stretches longer than a threshold, every copy over a size with its rate,
and each forward+backward's tail: how long it went on after the compute stream's last kernel in it,
in copies still landing and then in host work alone (a tied matrix's rows added on the host, say).
What an overlapped optimizer makes the next forward wait for is read off by setting the stretches
beside the copies and the host updates.

  step_trace.py TRACE.json [--idle-us 300] [--min-mb 50]

Times are in ms from the trace's first GPU activity. The compute stream is the (device, stream)
that ran the most kernels; its idle stretches are those between two of its kernels (not before its
first or after its last). TRACE may be gzipped (.gz)."""
import argparse
import gzip
import json
import sys


def events(path):
    try:
        with (gzip.open(path, "rt") if path.endswith(".gz") else open(path)) as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        sys.exit(f"step_trace.py: cannot read {path}: {e}")
    return data["traceEvents"] if isinstance(data, dict) else data


def stream_of(e):
    """A GPU event's (device, stream): stream numbers repeat across devices."""
    args = e.get("args", {})
    return (args.get("device", e.get("pid")), args.get("stream", -1))


def read(path, idle_us=300.0, min_mb=50.0):
    """The trace as a dict: t0 (us), compute stream, annotations [(name, start ms, end ms)], host
    updates [(name, start ms, end ms)], idle [(start ms, end ms)], copies [(kind, start ms, ms,
    MB, GB/s)], tails [(start ms, last kernel's end ms, last copy's end ms, end ms, MB copied)]: one
    for each strata::forward_backward holding a compute kernel, the copies (any size) those that end
    after that kernel and by the annotation's end (the last copy's end is the kernel's where none)."""
    ev = [e for e in events(path) if e.get("ph") == "X"]
    gpu = [e for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")]
    if not gpu:
        sys.exit(f"step_trace.py: {path} holds no GPU activity (was it recorded on a GPU?)")
    t0 = min(float(e["ts"]) for e in gpu)
    ms = lambda us: (float(us) - t0) / 1e3  # noqa: E731
    ends = lambda e: ms(float(e["ts"]) + float(e["dur"]))  # noqa: E731
    kernels_on = {}
    for e in gpu:
        if e["cat"] == "kernel":
            s = stream_of(e)
            kernels_on[s] = kernels_on.get(s, 0) + 1
    compute = max(kernels_on, key=kernels_on.get) if kernels_on else None
    notes = sorted((e for e in ev if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith("strata::")),
                   key=lambda e: float(e["ts"]))
    spans = [(e["name"], ms(e["ts"]), ends(e)) for e in notes]
    out = {"t0": t0, "compute": compute,
           "annotations": [s for s in spans if not s[0].startswith("strata::host_update")],
           "host_updates": [s for s in spans if s[0].startswith("strata::host_update")],
           "idle": [], "copies": [], "tails": []}
    busy = sorted((e for e in gpu if e["cat"] == "kernel" and stream_of(e) == compute),
                  key=lambda e: float(e["ts"]))
    if busy:
        end = float(busy[0]["ts"])
        for e in busy:
            start = float(e["ts"])
            if start - end > idle_us:
                out["idle"].append((ms(end), ms(start)))
            end = max(end, start + float(e["dur"]))
    for e in sorted((e for e in gpu if e["cat"] == "gpu_memcpy"), key=lambda e: float(e["ts"])):
        nbytes = float(e.get("args", {}).get("bytes", 0))
        dur = float(e["dur"])
        if nbytes >= min_mb * 1e6 and dur > 0:
            kind = "HtoD" if "HtoD" in e["name"] else "DtoH" if "DtoH" in e["name"] else e["name"].split("(")[0].strip()
            out["copies"].append((kind, ms(e["ts"]), dur / 1e3, nbytes / 1e6, nbytes / dur / 1e3))
    for name, a, b in out["annotations"]:
        if name != "strata::forward_backward":
            continue
        inside = [ends(e) for e in busy if a <= ms(e["ts"]) <= b]
        if not inside:
            continue
        last = max(inside)
        landing = [e for e in gpu if e["cat"] == "gpu_memcpy" and last < ends(e) <= b]
        copied = sum(float(e.get("args", {}).get("bytes", 0)) for e in landing) / 1e6
        out["tails"].append((a, last, max([last] + [ends(e) for e in landing]), b, copied))
    return out


def report(t, idle_us, min_mb):
    lines = [f"compute stream (device, stream) {t['compute']}; times in ms from the first GPU activity"]
    tails = {a: (last, landed, b, mb) for a, last, landed, b, mb in t["tails"]}
    for name, a, b in t["annotations"]:
        lines.append(f"{name:32s} {a:10.2f} .. {b:10.2f}")
        if name == "strata::forward_backward" and a in tails:
            last, landed, end, mb = tails[a]
            lines.append(f"  after its last kernel ({last:.2f}): {end - last:.2f} ms, copies landing for "
                         f"{landed - last:.2f} ms ({mb:.1f} MB), then {end - landed:.2f} ms with none")
    idle = sum(b - a for a, b in t["idle"])
    lines.append(f"compute idle over {idle_us:g} us: {len(t['idle'])} stretches, {idle:.2f} ms")
    lines += [f"  idle {a:10.2f} .. {b:10.2f} ({b - a:.2f} ms)" for a, b in t["idle"]]
    lines.append(f"host updates: {len(t['host_updates'])}")
    lines += [f"  {name:44s} {a:10.2f} .. {b:10.2f} ({b - a:.2f} ms)" for name, a, b in t["host_updates"]]
    lines.append(f"copies of {min_mb:g} MB or more: {len(t['copies'])}")
    lines += [f"  {k} {a:10.2f}  {d:6.2f} ms  {mb:8.1f} MB  {r:5.1f} GB/s" for k, a, d, mb, r in t["copies"]]
    return "\n".join(lines)


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("trace")
    p.add_argument("--idle-us", type=float, default=300.0, help="shortest compute idle stretch listed (us)")
    p.add_argument("--min-mb", type=float, default=50.0, help="smallest copy listed (MB)")
    a = p.parse_args()
    if a.idle_us < 0 or a.min_mb < 0:
        p.error("--idle-us and --min-mb must not be negative")
    print(report(read(a.trace, a.idle_us, a.min_mb), a.idle_us, a.min_mb))


if __name__ == "__main__":
    main()
