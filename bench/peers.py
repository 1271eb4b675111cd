#!/usr/bin/env python3
"""PyTorch's own equivalents of strata's strategies, timed on the same GPT in the same JSON shape
as strata_bench (Google Benchmark's), so the report can show strata's figures as ratios to them.

Peers: the all-GPU baseline (plain and with per-block checkpointing), FSDP2 with CPUOffloadPolicy
at world size 1, and seed 003's offload.py (given by path, never copied; it needs per-block
checkpointing). Before it is timed, each peer's loss and gradients on gpt-tiny are checked against
one process running the plain model on the same weights (parity_ok, parity_rel_diff); a peer that
fails is not timed. For the offloading peers it also counts the offloaded blocks' parameters still
on the GPU after a step. Exit status 1 when a peer errored or failed parity (out of memory is a
result).

Under torchrun with several ranks it runs the data-parallel peers instead — DDP, FSDP2
(fully_shard per block and on the root) and FSDP2 with CPUOffloadPolicy — one GPU per rank, each
first checked on gpt-tiny against one process on the whole batch.

  python3 bench/peers.py --model=gpt-871m --offload-py=PATH/offload.py --out=peers.json
  torchrun --nproc-per-node=2 bench/peers.py --model=gpt-871m --out=peers-x2.json
"""
import argparse
import importlib.util
import json
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint

# Same sizes as strata's presets (models/model.cpp).
PRESETS = {
    "gpt-tiny": dict(depth=2, width=32, heads=4, vocab=64, seq_len=8, batch=4),
    "gpt-small": dict(depth=4, width=256, heads=4, vocab=4096, seq_len=128, batch=8),
    "gpt-medium": dict(depth=8, width=1024, heads=16, vocab=32000, seq_len=512, batch=8),
    "gpt-871m": dict(depth=16, width=2048, heads=16, vocab=32000, seq_len=1024, batch=8),
}


def sinusoidal(T, d, device, dtype):
    pos = torch.arange(T, device=device, dtype=dtype).unsqueeze(1)
    i = torch.arange(d, device=device, dtype=dtype).unsqueeze(0)
    angle = pos / torch.pow(10000.0, (2.0 * torch.floor(i / 2.0)) / d)
    even = (torch.arange(d, device=device) % 2) == 0
    return torch.where(even, torch.sin(angle), torch.cos(angle))


class Embedding(nn.Module):
    def __init__(self, vocab, width):
        super().__init__()
        self.tokens = nn.Parameter(torch.empty(vocab, width).normal_(0, 0.02))

    def forward(self, idx):
        x = F.embedding(idx, self.tokens)
        return x + sinusoidal(idx.shape[1], self.tokens.shape[1], x.device, x.dtype)


class Block(nn.Module):
    def __init__(self, width, heads):
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(B, T, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(B, T, C))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class Head(nn.Module):
    def __init__(self, width, weight):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.weight = weight  # tied: the embedding's Parameter

    def forward(self, x):
        return self.norm(x) @ self.weight.t()


class GPT(nn.Module):
    def __init__(self, c, checkpoint):
        super().__init__()
        self.embedding = Embedding(c["vocab"], c["width"])
        self.blocks = nn.ModuleList(Block(c["width"], c["heads"]) for _ in range(c["depth"]))
        self.head = Head(c["width"], self.embedding.tokens)
        self.checkpoint = checkpoint

    def forward(self, idx):
        x = self.embedding(idx)
        for b in self.blocks:
            x = torch.utils.checkpoint.checkpoint(b, x, use_reentrant=False) if self.checkpoint else b(x)
        return self.head(x)


def timed_steps(model, opt, idx, target, steps, backward_ctx=None, vocab=None, scale=1.0):
    fb, op = [], []
    for i in range(steps + 2):  # 2 warm-up steps, as strata_bench
        if i == 2:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        e0, e1, e2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        e0.record()
        out = model(idx)
        loss = F.cross_entropy(out.reshape(-1, vocab or out.shape[-1]), target.reshape(-1)) * scale
        if backward_ctx:
            with backward_ctx():
                loss.backward()
        else:
            loss.backward()
        e1.record()
        opt.step()
        opt.zero_grad(set_to_none=True)
        e2.record()
        torch.cuda.synchronize()
        if i >= 2:
            fb.append(e0.elapsed_time(e1))
            op.append(e1.elapsed_time(e2))
    return fb, op


def entry(name, c, fb, op, extra=None):
    step = statistics.mean(fb) + statistics.mean(op)
    items = c["batch"] * c["seq_len"]
    out = {
        "name": name,
        "run_name": name,
        "run_type": "iteration",
        "iterations": len(fb),
        "real_time": step,
        "cpu_time": step,
        "time_unit": "ms",
        "fwd_bwd_ms": statistics.mean(fb),
        "optimizer_ms": statistics.mean(op),
        "items_per_second": items / (step / 1e3),
        "peak_allocated_bytes": float(torch.cuda.max_memory_allocated()),
        "peak_reserved_bytes": float(torch.cuda.max_memory_reserved()),
        "oom": 0,
    }
    out.update(extra or {})
    return out


def failed(name, message):
    """An errored row, its outcome first in the message as strata_bench writes it."""
    oom = "out of memory" in message.lower()
    if oom:
        message = "out of memory: " + message
    elif not message.startswith("parity failed"):
        message = "error: " + message
    return {"name": name, "run_name": name, "run_type": "iteration", "error_occurred": True,
            "error_message": message[:300], "oom": int(oom), "time_unit": "ms"}


def batch(c, device):
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(c["vocab"], (c["batch"], c["seq_len"] + 1), generator=g)
    return tokens[:, :-1].contiguous().to(device), tokens[:, 1:].contiguous().to(device)


def on_device_count(modules):
    n = 0
    for m in modules:
        for p in m.parameters():
            t = p.to_local() if hasattr(p, "to_local") else p
            if t.device.type == "cuda":
                n += p.numel()
    return n


def init_distributed():
    import torch.distributed as dist
    if not dist.is_initialized():
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29517")
        dist.init_process_group("cpu:gloo,cuda:nccl", rank=0, world_size=1)


def build_peer(kind, c, dev, offload_py):
    """The peer's model (initialised from torch.manual_seed(0), like the reference), its optimizer,
    the context its backward needs, and the modules whose parameters it offloads."""
    torch.manual_seed(0)
    if kind in ("torch_baseline", "torch_checkpoint"):
        model = GPT(c, checkpoint=kind == "torch_checkpoint").to(dev)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4), None, None
    if kind == "fsdp2_cpu_offload":
        from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
        init_distributed()
        model = GPT(c, checkpoint=True)
        for b in model.blocks:
            fully_shard(b, offload_policy=CPUOffloadPolicy())
        fully_shard(model, offload_policy=CPUOffloadPolicy())
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4), None, list(model.blocks)
    if kind == "seed_offload":
        spec = importlib.util.spec_from_file_location("seed_offload", offload_py)
        offload = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(offload)
        model = GPT(c, checkpoint=True)  # the seed requires gradient checkpointing
        model.embedding.to(dev)
        model.head.norm.to(dev)
        blocks = list(model.blocks)
        offload.offload(*blocks[:-1])
        offload.offload(blocks[-1], merge_forward_backward=True)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False), offload.backward, blocks
    raise ValueError(f"unknown peer {kind}")


def full(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().float().cpu()


def check_parity(kind, offload_py):
    """Loss and every gradient of the peer on gpt-tiny against one process running the plain model
    on the same weights and batch, in full fp32. Returns (ok, largest relative difference).
    torch_baseline is that reference itself: nothing to check."""
    if kind == "torch_baseline":
        return None, None
    c, dev = PRESETS["gpt-tiny"], torch.device("cuda:0")
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        idx, target = batch(c, dev)
        results = []
        for k in ("torch_baseline", kind):
            model, _, ctx, _ = build_peer(k, c, dev, offload_py)
            loss = F.cross_entropy(model(idx).reshape(-1, c["vocab"]), target.reshape(-1))
            if ctx:
                with ctx():
                    loss.backward()
            else:
                loss.backward()
            torch.cuda.synchronize()
            grads = {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
            results.append((loss.item(), grads))
        (ref_loss, ref), (loss, got) = results
        if set(ref) != set(got):
            return False, float("inf")
        # fp32 in another order (checkpointing, offloaded copies): a few ulp; a bug is far larger.
        worst = abs(loss - ref_loss) / abs(ref_loss)
        for n in ref:
            scale = ref[n].abs().max().item() or 1.0
            worst = max(worst, (got[n] - ref[n]).abs().max().item() / scale)
        return worst < 1e-4, worst
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


def run_peer(kind, c, steps, offload_py, model_name):
    dev = torch.device("cuda:0")
    idx, target = batch(c, dev)
    name = f"{kind}/{model_name}"
    torch.cuda.empty_cache()
    parity, worst = check_parity(kind, offload_py)
    if parity is False:
        return failed(name, f"parity failed: largest relative difference {worst:.3g} on gpt-tiny")
    torch.cuda.empty_cache()
    model, opt, ctx, offloaded = build_peer(kind, c, dev, offload_py)
    fb, op = timed_steps(model, opt, idx, target, steps, backward_ctx=ctx)
    extra = {"parity_ok": 1 if parity else None, "parity_rel_diff": worst}
    if kind == "torch_baseline":
        extra["parity_ok"] = 1  # the reference the others are checked against
    if offloaded is not None:
        extra.update(offloaded_params_on_device=on_device_count(offloaded),
                     offloaded_params=sum(p.numel() for m in offloaded for p in m.parameters()))
    return entry(name, c, fb, op, {k: v for k, v in extra.items() if v is not None})


def build_distributed_peer(kind, c, dev, local):
    """DDP, FSDP2 (fully_shard per block and on the root: the tied embedding and head share the root's
    group) or FSDP2 with CPUOffloadPolicy, each rank on its own GPU; models from torch.manual_seed(0)."""
    torch.manual_seed(0)
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(GPT(c, checkpoint=False).to(dev), device_ids=[local])
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4)
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard
    offload = kind == "fsdp2_cpu_offload"
    model = GPT(c, checkpoint=offload)
    if not offload:
        model.to(dev)
    policy = {"offload_policy": CPUOffloadPolicy()} if offload else {}
    for b in model.blocks:
        fully_shard(b, **policy)
    fully_shard(model, **policy)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4)


def distributed_parity(kind, dev, local, rank, world):
    """Every rank runs its slice of a global batch of 2 x world on gpt-tiny; the peer's full
    gradients (all-reduced by DDP, gathered from FSDP2's shards) must equal one process's on the
    whole batch, in full fp32."""
    c = dict(PRESETS["gpt-tiny"], batch=2 * world)
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        idx, target = batch(c, dev)
        torch.manual_seed(0)
        ref = GPT(c, checkpoint=False).to(dev)
        F.cross_entropy(ref(idx).reshape(-1, c["vocab"]), target.reshape(-1)).backward()
        expected = {n: p.grad.detach().float().cpu() for n, p in ref.named_parameters()}
        model, _ = build_distributed_peer(kind, c, dev, local)
        mine = slice(rank * 2, rank * 2 + 2)
        out = model(idx[mine])
        F.cross_entropy(out.reshape(-1, c["vocab"]), target[mine].reshape(-1)).backward()
        torch.cuda.synchronize()
        got = {n.replace("module.", ""): full(p.grad) for n, p in model.named_parameters()}
        worst = 0.0
        for n, g in expected.items():
            if n not in got:
                return False, float("inf")
            worst = max(worst, (got[n] - g).abs().max().item() / (g.abs().max().item() or 1.0))
        return worst < 1e-4, worst
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


def run_distributed(args):
    """Under torchrun: the data-parallel peers on one GPU per rank, each rank on its slice of the
    global batch; a step is the slowest rank's; rank 0 writes the JSON."""
    import torch.distributed as dist
    rank, world, local = (int(os.environ[k]) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK"))
    torch.cuda.set_device(local)
    dev = torch.device("cuda", local)
    dist.init_process_group("cpu:gloo,cuda:nccl")
    torch.backends.cuda.matmul.allow_tf32 = True
    c = PRESETS[args.model]
    if c["batch"] % world:
        sys.exit(f"peers.py: the global batch of {c['batch']} does not split evenly over {world} ranks")
    per = c["batch"] // world
    results = []
    for kind in args.peers.split(","):
        name = f"{kind}[ranks={world}]/{args.model}"
        t0 = time.time()
        try:
            ok, worst = distributed_parity(kind, dev, local, rank, world)
            if not ok:
                results.append(failed(name, f"parity failed: largest relative difference {worst:.3g} on gpt-tiny"))
                continue
            torch.cuda.empty_cache()
            idx, target = batch(c, dev)
            model, opt = build_distributed_peer(kind, c, dev, local)
            mine = slice(rank * per, (rank + 1) * per)
            fb, op = timed_steps(model, opt, idx[mine], target[mine], args.steps, vocab=c["vocab"])
            times = torch.tensor([statistics.mean(fb), statistics.mean(op)], device=dev)
            dist.all_reduce(times, op=dist.ReduceOp.MAX)
            peaks = torch.zeros(2, world, device=dev)
            peaks[0, rank], peaks[1, rank] = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
            dist.all_reduce(peaks)
            r = entry(name, c, [times[0].item()], [times[1].item()], {"parity_ok": 1, "parity_rel_diff": worst})
            for k in range(world):
                r[f"peak_allocated_bytes.rank{k}"] = peaks[0, k].item()
                r[f"peak_reserved_bytes.rank{k}"] = peaks[1, k].item()
            r["peak_allocated_bytes"], r["peak_reserved_bytes"] = peaks[0].max().item(), peaks[1].max().item()
            results.append(r)
            if rank == 0:
                print(f"peers.py: {name}: {r['real_time']:.1f} ms/step, peak per rank {r['peak_allocated_bytes'] / 2**30:.2f}"
                      f" GiB ({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
            del model, opt
        except Exception as e:
            results.append(failed(name, f"{type(e).__name__}: {e}"))
            print(f"peers.py: rank {rank}: {name} failed: {type(e).__name__}: {str(e)[:300]}", file=sys.stderr, flush=True)
        torch.cuda.empty_cache()
    if rank == 0:
        context = {"peers_device": torch.cuda.get_device_name(0), "torch_version": torch.__version__, "ranks": world,
                   "date": time.strftime("%Y-%m-%d %H:%M:%S")}
        with open(args.out, "w") as f:
            json.dump({"context": context, "benchmarks": results}, f, indent=1)
    dist.destroy_process_group()
    bad = [r["name"] for r in results if r.get("error_occurred") and not r["error_message"].startswith("out of memory")]
    return 1 if bad else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt-871m", choices=sorted(PRESETS))
    ap.add_argument("--peers", default="torch_baseline,torch_checkpoint,fsdp2_cpu_offload,seed_offload")
    ap.add_argument("--offload-py", help="path to seed 003's offload.py (needed by the seed_offload peer)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("peers.py: needs a CUDA device")
    if "RANK" in os.environ and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        if args.peers == ap.get_default("peers"):
            args.peers = "ddp,fsdp2,fsdp2_cpu_offload"
        return run_distributed(args)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    c = PRESETS[args.model]
    results = []
    for kind in args.peers.split(","):
        if kind == "seed_offload" and not (args.offload_py and os.path.exists(args.offload_py)):
            results.append(failed(f"{kind}/{args.model}", f"--offload-py not given or missing: {args.offload_py}"))
            continue
        print(f"peers.py: {kind} on {args.model}", file=sys.stderr, flush=True)
        t0 = time.time()
        try:
            results.append(run_peer(kind, c, args.steps, args.offload_py, args.model))
            r = results[-1]
            if r.get("error_occurred"):
                print(f"peers.py: {kind}: {r['error_message']}", file=sys.stderr, flush=True)
                continue
            print(f"peers.py: {kind}: {r['real_time']:.1f} ms/step, peak {r['peak_allocated_bytes'] / 2**30:.2f} GiB"
                  f" ({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
        except Exception as e:  # an out-of-memory or a broken peer is a result; the others still run
            results.append(failed(f"{kind}/{args.model}", f"{type(e).__name__}: {e}"))
            print(f"peers.py: {kind} failed: {type(e).__name__}: {str(e)[:300]}", file=sys.stderr, flush=True)
        torch.cuda.empty_cache()
    context = {"peers_device": torch.cuda.get_device_name(0), "torch_version": torch.__version__,
               "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    with open(args.out, "w") as f:
        json.dump({"context": context, "benchmarks": results}, f, indent=1)
    # Out of memory is a result; a peer that errored or failed parity fails the run.
    bad = [r["name"] for r in results if r.get("error_occurred") and not r["error_message"].startswith("out of memory")]
    if bad:
        print("peers.py: failed: " + ", ".join(bad), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
