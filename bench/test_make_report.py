#!/usr/bin/env python3
"""Self-test of reports/make_report.py on synthetic runs: a CPU run (no allocator statistics) gets
its memory from the strategies' own accounting, in a unit that fits kilobytes, and no MFU claim;
a GPU run keeps allocator peaks in GiB. Runs in CI (ctest: cpu.make_report_self_test).

  python3 bench/test_make_report.py
"""
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
MAKE_REPORT = os.path.join(HERE, "..", "reports", "make_report.py")


def cell(strategy, model, **counters):
    row = {"name": f"{strategy}/{model}/iterations:2/manual_time", "run_type": "iteration", "real_time": 5.0,
           "fwd_bwd_ms": 4.0, "optimizer_ms": 1.0, "items_per_second": 1000.0, "parity_ok": 1}
    row.update(counters)
    return row


def report(context, cells, peers=None):
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "bench.json")
        with open(path, "w") as f:
            json.dump({"context": context, "benchmarks": cells}, f)
        extra = []
        if peers:
            extra = ["--peers", os.path.join(d, "peers.json")]
            with open(extra[1], "w") as f:
                json.dump({"context": {}, "benchmarks": peers}, f)
        subprocess.run([sys.executable, MAKE_REPORT, "--strata", path, "--out", d] + extra, check=True,
                       stdout=subprocess.DEVNULL)
        with open(os.path.join(d, "report.md")) as f:
            return f.read()


def report_from(flag, files, plot="capacity.png"):
    """make_report's report of stored JSON files given with `flag` (repeated), and whether `plot` was drawn."""
    with tempfile.TemporaryDirectory() as d:
        paths = []
        for i, data in enumerate(files):
            paths += [flag, os.path.join(d, f"in{i}.json")]
            with open(paths[-1], "w") as f:
                json.dump(data, f)
        subprocess.run([sys.executable, MAKE_REPORT, "--out", d, "--machine", "test GPU"] + paths, check=True,
                       stdout=subprocess.DEVNULL)
        with open(os.path.join(d, "report.md")) as f:
            return f.read(), os.path.exists(os.path.join(d, plot))


def ckpt_rows(who, save_ms, load_ms, wait_ms, nbytes=14 * 2**30):
    name = lambda kind: f"checkpoint_{kind}/{who}/gpt-871m"
    return [{"name": name("save"), "real_time": save_ms, "bytes": nbytes, "GB_per_s": nbytes / 1e9 / (save_ms / 1e3)},
            {"name": name("load"), "real_time": load_ms, "bytes": nbytes, "GB_per_s": nbytes / 1e9 / (load_ms / 1e3)},
            {"name": name("async_blocked"), "real_time": wait_ms, "bytes": nbytes, "of_sync_save": wait_ms / save_ms,
             "step_ms_while_writing": 800.0}]


# strata_checkpoint bench's rows for two strategies, one failed, and the DCP and torch.save peers'.
CKPT_STRATA = {"context": {"device_name": "NVIDIA H100 80GB HBM3"},
               "benchmarks": ckpt_rows("baseline", 10000.0, 8000.0, 900.0)
               + [{"name": "checkpoint_save/manual_split/gpt-871m", "error_occurred": True,
                   "error_message": "error: out of memory"}]}
CKPT_PEERS = {"context": {"peers_device": "NVIDIA H100 80GB HBM3"},
              "benchmarks": ckpt_rows("dcp_fsdp2", 12500.0, 9000.0, 2000.0) + ckpt_rows("torch_save", 20000.0, 15000.0, 6000.0)}

# A stored strata_capacity search on an emulated 8 GiB card, and a --fit run.
SEARCH = {"context": {"strata_device": "cuda:0", "device_name": "NVIDIA H100 80GB HBM3", "device_memory_bytes": 8 * 2**30,
                      "device_memory_emulated": True, "host_memory_bytes": 120 * 2**30, "host_memory_capped": False,
                      "model": "gpt-871m", "model_config": "gpt(depth=16 width=2048 heads=16 vocab=32000 seq_len=1024 tied=1)",
                      "axis": "depth", "mode": "search", "batch": 8, "precision": "fp32", "optimizer": "adamw", "steps": 2},
          "benchmarks": [{"name": "capacity/baseline/gpt-871m/depth", "strategy": "baseline", "axis": "depth", "largest": 3,
                          "parameters": 217000000, "step_ms": 80.5, "peak_device_bytes": 7 * 2**30, "peak_host_bytes": 2**30,
                          "predicted_device_bytes": 7.7 * 2**30, "predicted_host_bytes": 1.5 * 2**30, "next": 4,
                          "next_outcome": "device out of memory", "predicted_largest": 3},
                         {"name": "capacity/hook_offload/gpt-871m/depth", "strategy": "hook_offload", "axis": "depth",
                          "largest": 40, "parameters": 2100000000, "step_ms": 900.0, "peak_device_bytes": 6 * 2**30,
                          "peak_host_bytes": 40 * 2**30, "next": -1, "next_outcome": "the upper end trains",
                          "predicted_largest": 20},
                         {"name": "capacity/sharded/gpt-871m/depth", "strategy": "sharded", "axis": "depth", "largest": 2,
                          "parameters": 170000000, "step_ms": 70.0, "peak_device_bytes": 7 * 2**30, "next": 5,
                          "next_outcome": "device out of memory", "predicted_largest": 3,
                          "error_message": "error: size 3: the probe ended without a result"}],
          "probes": [{"strategy": "baseline", "size": 1, "outcome": "trains", "parameters": 117000000, "step_ms": 40.0},
                     {"strategy": "baseline", "size": 3, "outcome": "trains", "parameters": 217000000, "step_ms": 80.5},
                     {"strategy": "baseline", "size": 4, "outcome": "device out of memory", "parameters": 0, "step_ms": 0}]}
FIT = {"context": dict(SEARCH["context"], mode="fit", model="bert-base-6m", axis="classes"),
       "benchmarks": [{"name": "fit/baseline/bert-base-6m", "strategy": "baseline", "outcome": "device out of memory"},
                      {"name": "fit/sharded_offload/bert-base-6m", "strategy": "sharded_offload", "outcome": "trains",
                       "step_ms": 1950.9, "peak_device_bytes": 35.16 * 2**30, "peak_host_bytes": 80 * 2**30},
                      {"name": "fit/hook_offload_overlap/bert-base-6m", "strategy": "hook_offload_overlap",
                       "outcome": "trains", "step_ms": 1637.7, "peak_device_bytes": 34.69 * 2**30,
                       "peak_host_bytes": 79 * 2**30}]}


def main():
    capacity, capacity_plot = report_from("--capacity", [SEARCH, FIT])
    checkpoints, _ = report_from("--checkpoints", [CKPT_STRATA, CKPT_PEERS])
    cpu = report({"strata_device": "cpu", "peak_tflops": 0.05},
                 [cell("baseline", "gpt-tiny", peak_param_bytes=110080, peak_allocated_bytes=0,
                       h2d_bytes_per_step=512),
                  cell("hook_offload", "gpt-tiny", peak_param_bytes=50812, peak_allocated_bytes=0,
                       h2d_bytes_per_step=234100, d2h_bytes_per_step=121100)])
    gpu = report({"strata_device": "cuda:0", "peak_tflops": 400, "datasheet_tflops": 494.7, "h2d_link_GBps": 55,
                  "host_dispatch_us": "6.0"},
                 [cell("baseline", "gpt-871m", peak_allocated_bytes=31 * 2**30, peak_reserved_bytes=32 * 2**30,
                       peak_param_bytes=3.5e9, mfu=0.38, host_dispatch_us=5.5),
                  cell("pipeline_zero_bubble", "gpt-871m", fwd_bwd_ms=300.0, peak_allocated_bytes=2**30,
                       host_dispatch_us=7.0),
                  cell("pipeline_interleaved", "gpt-871m", fwd_bwd_ms=240.0, peak_allocated_bytes=2**30),
                  cell("pipeline_gpipe", "gpt-871m", fwd_bwd_ms=330.0, peak_allocated_bytes=2**30),
                  cell("sharded", "gpt-871m", fwd_bwd_ms=290.0, peak_allocated_bytes=2**30),
                  cell("baseline_checkpoint", "gpt-871m", fwd_bwd_ms=280.0, peak_allocated_bytes=2**30)],
                 peers=[{"name": "torch_pp_zbv[m=4;ranks=1]/gpt-871m", "real_time": 270.0, "fwd_bwd_ms": 250.0,
                         "optimizer_ms": 20.0, "peak_allocated_bytes": 2**30, "parity_ok": 1},
                        {"name": "torch_pp_looped_bfs[m=4;ranks=1]/gpt-871m", "real_time": 320.0, "fwd_bwd_ms": 300.0,
                         "optimizer_ms": 20.0, "peak_allocated_bytes": 2**30, "parity_ok": 1},
                        {"name": "torch_pp_interleaved[m=8;ranks=2]/gpt-871m", "real_time": 200.0, "fwd_bwd_ms": 180.0,
                         "optimizer_ms": 20.0, "peak_allocated_bytes": 2**30, "parity_ok": 1},
                        {"name": "fsdp2[ranks=2]/gpt-871m", "real_time": 200.0, "fwd_bwd_ms": 180.0,
                         "optimizer_ms": 20.0, "peak_allocated_bytes": 2**30, "parity_ok": 1}])
    # A host pass of 28 B x 1e9 parameters in 350 ms runs at 80 GB/s: beside a triad measured at 50
    # its floor is that pass (350 ms), not the triad's 560; beside a triad of 100, the triad's 280.
    # The host is one for the run, so another model's floor uses that rate too.
    def host_run(triad, waits=3):
        return report({"strata_device": "cuda:0", "peak_tflops": 400, "host_triad_GBps": triad},
                      [cell("hook_offload", "gpt-871m", real_time=650.0, fwd_bwd_ms=300.0, optimizer_ms=350.0,
                            host_update_ms=350.0, parameters=1e9, optimizer_on_host=1, peak_allocated_bytes=2**30),
                       # another model's slower pass (60 GB/s): its floor too is at the run's fastest
                       cell("hook_offload", "gpt-medium", real_time=70.0, fwd_bwd_ms=20.0, optimizer_ms=50.0,
                            host_update_ms=2.8e3 / 60, parameters=1e8, optimizer_on_host=1, peak_allocated_bytes=2**30),
                       # a fifth of the parameters trained on the device: the host pass is the rest's,
                       # and the overlapped cell's device time is its twin's with the same options
                       cell("hook_offload[resident=0;resident_updates=device]", "gpt-871m", real_time=570.0,
                            fwd_bwd_ms=290.0, optimizer_ms=280.0, host_update_ms=280.0, parameters=1e9,
                            host_parameters=8e8, optimizer_on_host=1, peak_allocated_bytes=2**30),
                       cell("hook_offload_overlap[resident=0;resident_updates=device]", "gpt-871m", real_time=400.0,
                            fwd_bwd_ms=380.0, optimizer_ms=20.0, host_update_ms=280.0, parameters=1e9,
                            host_parameters=8e8, optimizer_on_host=1, fetches_behind_host_updates=waits,
                            peak_allocated_bytes=2**30)])
    low_triad, high_triad = host_run(50.0), host_run(100.0)
    no_waits = host_run(50.0, waits=0)
    # Both precisions in one file: each overlapped cell takes the twin of its own precision (bf16's
    # host pass writes 30 bytes a parameter: 300 ms at the run's fastest rate, 100 GB/s).
    mixed = report({"strata_device": "cuda:0", "peak_tflops": 400, "host_triad_GBps": 50.0},
                   [cell("hook_offload", "gpt-871m", real_time=650.0, fwd_bwd_ms=300.0, optimizer_ms=350.0,
                         host_update_ms=350.0, parameters=1e9, optimizer_on_host=1, peak_allocated_bytes=2**30),
                    cell("hook_offload[precision=bf16]", "gpt-871m", real_time=450.0, fwd_bwd_ms=150.0,
                         optimizer_ms=300.0, host_update_ms=300.0, parameters=1e9, optimizer_on_host=1,
                         peak_allocated_bytes=2**30),
                    cell("hook_offload_overlap[precision=bf16]", "gpt-871m", real_time=330.0, fwd_bwd_ms=320.0,
                         optimizer_ms=10.0, host_update_ms=300.0, parameters=1e9, optimizer_on_host=1,
                         peak_allocated_bytes=2**30)])
    checks = [
        ("capacity: a search's table names the emulated card and each strategy's row",
         "### gpt-871m along depth: NVIDIA H100 80GB HBM3, 8 GiB emulated, host 120 GiB available" in capacity
         and "| baseline | 3 | 0.217B | 1.00x | 80.5 | 7.00 | 1.00 | 1% | 4: device out of memory | 3 | 1.10 | 1.50 |" in capacity),
        ("capacity: a search whose upper end trains says so",
         "| hook_offload | 40 | 2.100B | 9.68x | 900.0 | 6.00 | 40.00 | 33% | the upper end trains | 20 | - | - |" in capacity),
        ("capacity: a search stopped by an error shows the error", "error: size 3: the probe ended" in capacity),
        ("capacity: a fit run lists what trains, fastest first, then what does not",
         capacity.index("| hook_offload_overlap | trains | 1637.7 |") < capacity.index("| sharded_offload | trains | 1950.9 |")
         < capacity.index("| baseline | device out of memory |")),
        ("capacity: the frontier plot", capacity_plot and "![Capacity frontier](capacity.png)" in capacity),
        ("checkpoints: each strategy and peer with its save against DCP's",
         "| baseline | 14.00 | 10000.0 | 1.50 | 8000.0 | 1.88 | 900.0 | 9% | 800.0 | 0.80x |" in checkpoints
         and "| dcp_fsdp2 | 14.00 | 12500.0 | 1.20 | 9000.0 | 1.67 | 2000.0 | 16% | 800.0 | 1.00x |" in checkpoints
         and "save / dcp_fsdp2's" in checkpoints and "state GiB" in checkpoints),
        ("checkpoints: a failed strategy shows its error", "| manual_split | error: out of memory |" in checkpoints),
        ("a triad below the run's own host pass: the floor is that pass (every parameter, marked so)",
         "| hook_offload | 1,000,000,000 (model's) | 350.0 | 350.0 | 80.0 | 300.0 | 350.0 | 650.0 | 1.86 |" in low_triad
         and "80.0 GB/s, the fastest host pass of this run" in low_triad),
        ("the fastest pass of the whole run, not of one model",
         "| hook_offload | 100,000,000 (model's) | 35.0 | 46.7 | 60.0 | 20.0 | 35.0 | 70.0 | 2.00 |" in low_triad),
        ("units trained on the device: the host pass over the host's parameters, device time from the twin",
         "| hook_offload_overlap[resident=0;resident_updates=device] | 800,000,000 | 280.0 | 280.0 | 80.0 | 290.0 "
         "| 290.0 | 400.0 | 1.38 |" in low_triad),
        ("the twin's device time also where no fetch waited in that run (not the cell's own 380 ms)",
         "| hook_offload_overlap[resident=0;resident_updates=device] | 800,000,000 | 280.0 | 280.0 | 80.0 | 290.0 "
         "| 290.0 | 400.0 | 1.38 |" in no_waits),
        ("each precision's overlapped cell beside its own precision's twin, every row kept",
         "| hook_offload_overlap[precision=bf16] | 1,000,000,000 (model's) | 300.0 | 300.0 | 100.0 | 150.0 | 300.0 "
         "| 330.0 | 1.10 |" in mixed and "| hook_offload | 1,000,000,000 (model's) |" in mixed),
        ("the host's dispatch readings, before the first cell and as the cells start",
         "dispatches an operator in 6.00 us before the first cell and 5.50-7.00 us as the cells start "
         "(median 6.25)" in gpu),
        ("a triad above it: the floor is the triad's",
         "| hook_offload | 1,000,000,000 (model's) | 280.0 | 350.0 | 80.0 | 300.0 | 300.0 | 650.0 | 2.17 |" in high_triad
         and "triad 100.0 GB/s" in high_triad),
        ("CPU memory from the strategies' accounting, in KiB", "peak resident params KiB (strategy accounting)" in cpu),
        ("CPU values that differ, not 0.00", "| 107.50 |" in cpu and "| 49.62 |" in cpu),
        ("CPU transfers in kB per step", "H2D kB/step" in cpu and "234.10" in cpu),
        ("no datasheet claim on the CPU", "no datasheet matmul figure" in cpu and "pinned host-to-device" not in cpu),
        ("GPU allocator peaks in GiB", "peak alloc GiB | peak reserved GiB" in gpu and "| 31.00 | 32.00 |" in gpu),
        ("GPU datasheet and link quoted", "494.7 TFLOP/s per GPU by datasheet" in gpu and "55.0 GB/s" in gpu),
        ("a pipeline beside the torch pipelining peer named with its settings",
         "| pipeline_zero_bubble | torch_pp_zbv[m=4;ranks=1] | 300.0 | 250.0 | 1.200 | — | shown |" in gpu),
        ("no pair with a pipeline peer over two GPUs", "| pipeline_interleaved | torch_pp" not in gpu),
        ("sharded's own cost: beside baseline_checkpoint of the same run, judged against 1.03",
         "| sharded | baseline_checkpoint | 290.0 | 280.0 | 1.036 | 1.03 | missed |" in gpu),
        ("GPipe beside the schedule that runs its order on one rank",
         "| pipeline_gpipe | torch_pp_looped_bfs[m=4;ranks=1] | 330.0 | 300.0 | 1.100 | — | shown |" in gpu),
    ]
    failed = [what for what, ok in checks if not ok]
    for what, ok in checks:
        print(f"{'ok  ' if ok else 'FAIL'} {what}")
    if failed:
        print("--- CPU report ---\n" + cpu + "\n--- GPU report ---\n" + gpu + "\n--- host reports ---\n" + low_triad
              + "\n" + high_triad)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
