#!/usr/bin/env python3
"""PyTorch's own equivalents of strata's strategies, timed on the same GPT in the same JSON shape
as strata_bench (Google Benchmark's), so the report can show strata's figures as ratios to them.

Models: strata's GPT presets and seed 000's BERT (bert-base-6m; bert-tiny for the parity checks).
Peers: the all-GPU baseline (plain and with per-block checkpointing), FSDP2 at world size 1
(fsdp2: fully_shard per block and on the root, blocks checkpointed as strata's sharded recomputes
them; fsdp2_cpu_offload: the same with CPUOffloadPolicy), and seed 003's offload.py (given by path, never copied; it needs per-block
checkpointing). Before it is timed, each peer's loss and gradients on gpt-tiny are checked against
one process running the plain model on the same weights (parity_ok, parity_rel_diff); a peer that
fails is not timed. For the offloading peers it also counts the offloaded blocks' parameters still
on the GPU after a step. Exit status 1 when a peer errored or failed parity (out of memory is a
result).

Under torchrun with several ranks it runs the data-parallel peers instead — DDP, FSDP2
(fully_shard per block and on the root) and FSDP2 with CPUOffloadPolicy — one GPU per rank, each
first checked on gpt-tiny against one process on the whole batch; with --peers=torch_pp_gpipe,
torch_pp_1f1b,torch_pp_interleaved,torch_pp_zbv, torch.distributed.pipelining's schedules over the
ranks (the whole batch in --micro-batches), checked the same way. The schedules with two stages
per rank also run on one rank (torchrun --nproc-per-node=1: both stages on one GPU, as strata's
pipelines share one): torch_pp_interleaved, torch_pp_zbv, and torch_pp_looped_bfs, whose order on
one rank is GPipe's (every micro-batch's forward through stage 0, then through stage 1, then the
backwards in reverse), GPipe's own schedule needing a rank per stage. Under --precision=bf16 every
stage computes under autocast and passes its activations on in bf16.

  python3 bench/peers.py --model=gpt-871m --offload-py=PATH/offload.py --out=peers.json
  torchrun --nproc-per-node=2 bench/peers.py --model=gpt-871m --out=peers-x2.json
  torchrun --nproc-per-node=2 bench/peers.py --model=gpt-871m --peers=torch_pp_1f1b --micro-batches=8 --out=pp.json
  torchrun --nproc-per-node=1 bench/peers.py --peers=torch_pp_interleaved,torch_pp_zbv,torch_pp_looped_bfs --precision=bf16 --out=pp1.json
  python3 bench/peers.py --self-test [--offload-py=PATH]   # the parity check fails a wrong peer, passes right ones
  python3 bench/peers.py --model=gpt-871m --checkpoint-dir=DIR --out=ckpt-peers.json

With --checkpoint-dir, the peers of `strata_checkpoint bench` instead: a training state (the model
after one AdamW step, and the optimizer's) saved and loaded on that disk by torch.distributed.
checkpoint (DCP) from FSDP2 at world size 1 (dcp_fsdp2; where FSDP2 is missing, torch < 2.4, DCP
saves the plain model's: dcp_model), and by torch.save / torch.load of the plain model's
(torch_save); each also through DCP's async_save, timing what the step waits for. Rows
checkpoint_save/, checkpoint_load/ and checkpoint_async_blocked/PEER/MODEL, as strata's. On a
machine without CUDA they run on the host.
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
    # Seed 000's BERT-like encoder: one label per sequence over a very wide classifier.
    "bert-tiny": dict(kind="bert", depth=2, width=32, heads=4, vocab=64, seq_len=8, classes=100, batch=4),
    "bert-base-6m": dict(kind="bert", depth=12, width=768, heads=12, vocab=30522, seq_len=128, classes=6_000_000,
                         batch=32),
}


def is_bert(c):
    return c.get("kind") == "bert"


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
    """A transformer block: pre-norm and causal (the GPT), or post-norm and bidirectional (BERT),
    as strata's models/transformer.cpp."""
    def __init__(self, width, heads, bert=False):
        super().__init__()
        self.heads, self.bert = heads, bert
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.proj = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.fc1, self.fc2 = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def attention(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)
        if hasattr(F, "scaled_dot_product_attention"):
            y = F.scaled_dot_product_attention(q, k, v, is_causal=not self.bert)
        else:  # torch before 2.0 (Debian's 1.13): the same product written out
            scores = (q @ k.transpose(-2, -1)) / (C // self.heads) ** 0.5
            if not self.bert:
                scores = scores.masked_fill(torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
            y = scores.softmax(-1) @ v
        return self.proj(y.transpose(1, 2).reshape(B, T, C))

    def forward(self, x):
        if self.bert:
            h = self.ln1(x + self.attention(x))
            return self.ln2(h + self.fc2(F.gelu(self.fc1(h))))
        x = x + self.attention(self.ln1(x))
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


class BERT(nn.Module):
    """Learned token and position embeddings with a norm, post-norm bidirectional blocks, a tanh
    pooler on the first token and a linear classifier over c["classes"]; with checkpoint, the
    transformer blocks are recomputed in backward (the embedding, pooler and classifier are not)."""
    def __init__(self, c, checkpoint):
        super().__init__()
        w = c["width"]
        self.tokens = nn.Parameter(torch.empty(c["vocab"], w).normal_(0, 0.02))
        self.positions = nn.Parameter(torch.empty(c["seq_len"], w).normal_(0, 0.02))
        self.norm = nn.LayerNorm(w)
        self.blocks = nn.ModuleList(Block(w, c["heads"], bert=True) for _ in range(c["depth"]))
        self.pooler = nn.Linear(w, w)
        self.classifier = nn.Linear(w, c["classes"])
        with torch.no_grad():
            self.classifier.weight.normal_(0, 0.02)
            self.classifier.bias.zero_()
        self.checkpoint = checkpoint

    def forward(self, idx):
        x = self.norm(F.embedding(idx, self.tokens) + self.positions[: idx.shape[1]])
        for b in self.blocks:
            x = torch.utils.checkpoint.checkpoint(b, x, use_reentrant=False) if self.checkpoint else b(x)
        return self.classifier(torch.tanh(self.pooler(x[:, 0])))


def make_model(c, checkpoint, device=None):
    """The preset's model from the current seed, on `device` (None: the host). Initialised on the
    host, so every peer of a preset starts from the same values, except a classifier of millions
    of classes, which initialises on the device (seconds there, minutes on one host thread); the
    parity checks use the tiny presets."""
    wide = is_bert(c) and c["classes"] > 1_000_000 and device is not None
    with torch.device(device if wide else "cpu"):
        model = BERT(c, checkpoint) if is_bert(c) else GPT(c, checkpoint)
    return model.to(device) if device is not None else model


# --precision: "fp32", or "bf16" for PyTorch's own mixed precision (autocast to bf16 over fp32
# parameters; the loss inside autocast too, which takes cross-entropy in fp32 as strata does), the
# peer of strata's bf16 policy.
PRECISION = "fp32"


def forward_backward(model, idx, target, backward_ctx=None, vocab=None, scale=1.0):
    """The peer's forward, mean cross-entropy and backward (inside backward_ctx when the peer needs
    one); returns the loss."""
    # FSDP2 under bf16 casts by its own MixedPrecisionPolicy, not autocast.
    autocast = PRECISION == "bf16" and not getattr(model, "strata_mixed_precision", False)
    with torch.autocast(idx.device.type, dtype=torch.bfloat16, enabled=autocast):
        out = model(idx)
        loss = F.cross_entropy(out.reshape(-1, vocab or out.shape[-1]), target.reshape(-1)) * scale
    if backward_ctx:
        with backward_ctx():
            loss.backward()
    else:
        loss.backward()
    return loss


def timed_steps(model, opt, idx, target, steps, backward_ctx=None, vocab=None, scale=1.0):
    fb, op = [], []
    for i in range(steps + 2):  # 2 warm-up steps, as strata_bench
        if i == 2:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        e0, e1, e2 = (torch.cuda.Event(enable_timing=True) for _ in range(3))
        e0.record()
        forward_backward(model, idx, target, backward_ctx, vocab, scale)
        e1.record()
        opt.step()
        opt.zero_grad(set_to_none=True)
        e2.record()
        torch.cuda.synchronize()
        if i >= 2:
            fb.append(e0.elapsed_time(e1))
            op.append(e1.elapsed_time(e2))
    return fb, op


def profile_step(model, idx, target, path, backward_ctx=None, vocab=None):
    """One forward+backward under torch.profiler, written as a Chrome trace (bench/kernel_table.py
    reads it beside strata_compare --profile's)."""
    from torch.profiler import ProfilerActivity, profile, record_function
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function("peer::forward_backward"):
            forward_backward(model, idx, target, backward_ctx, vocab)
            torch.cuda.synchronize()
    prof.export_chrome_trace(path)
    model.zero_grad(set_to_none=True)


def entry(name, c, fb, op, extra=None):
    step = statistics.mean(fb) + statistics.mean(op)
    items = c["batch"] if is_bert(c) else c["batch"] * c["seq_len"]  # sequences, or tokens (as strata_bench)
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
    if is_bert(c):  # a label per sequence
        tokens = torch.randint(c["vocab"], (c["batch"], c["seq_len"]), generator=g)
        return tokens.to(device), torch.randint(c["classes"], (c["batch"],), generator=g).to(device)
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
        model = make_model(c, checkpoint=kind == "torch_checkpoint", device=dev)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4), None, None
    if kind in ("fsdp2", "fsdp2_cpu_offload"):
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
        init_distributed()
        offload = kind == "fsdp2_cpu_offload"
        model = make_model(c, checkpoint=True, device=None if offload else dev)
        policy = {"offload_policy": CPUOffloadPolicy()} if offload else {}
        root = dict(policy)
        if PRECISION == "bf16":
            # bf16 parameters in forward and backward, gradients reduced in fp32, the output (the
            # logits) in fp32 for the loss: strata's bf16 policy.
            policy["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
            root["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32,
                                                     output_dtype=torch.float32)
            model.strata_mixed_precision = True
        for b in model.blocks:
            fully_shard(b, **policy)
        fully_shard(model, **root)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4), None, list(model.blocks) if offload else None
    if kind == "seed_offload":
        if is_bert(c):
            raise ValueError("seed_offload runs the GPT only")
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
    if kind == SELF_TEST_BROKEN:
        # Deliberately wrong, for --self-test: the plain model whose every gradient arrives doubled.
        model = make_model(c, checkpoint=False, device=dev)
        for p in model.parameters():
            p.register_hook(lambda g: g * 2)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4), None, None
    raise ValueError(f"unknown peer {kind}")


SELF_TEST_BROKEN = "self_test_doubled_gradients"


def load_strata_state(model, c, state):
    """strata's canonical names onto this GPT: "0.tokens" the embedding (and the tied head), "1." to
    "<depth>." the blocks, "<depth + 1>.norm" the head's norm. Every parameter must be there, whole."""
    depth = c["depth"]
    names = {"0.tokens": model.embedding.tokens}
    for i, block in enumerate(model.blocks):
        for n, p in block.named_parameters():
            names[f"{i + 1}.{n}"] = p
    for n, p in model.head.norm.named_parameters():
        names[f"{depth + 1}.norm.{n}"] = p
    with torch.no_grad():
        for name, p in names.items():
            assert name in state, f"{name} is not in the strata state"
            assert tuple(state[name].shape) == tuple(p.shape), f"{name}: {tuple(state[name].shape)} in strata's, {tuple(p.shape)} here"
            p.copy_(state[name])


def check_strata_state(model_name, state_path, eval_path):
    """A strata checkpoint (its consolidated state.pt, or a parameters file) in this GPT: on the batch
    strata_train evaluated (eval.pt), the logits and the loss equal strata's to fp32 rounding."""
    c = PRESETS[model_name]
    assert not is_bert(c), "the check maps strata's GPT"
    model = GPT(c, checkpoint=False)
    load_strata_state(model, c, torch.load(state_path, weights_only=True))
    ev = torch.load(eval_path, weights_only=True)
    with torch.no_grad():
        logits = model(ev["input"])
    theirs = ev["logits"]
    rel = ((logits - theirs).abs().max() / theirs.abs().max()).item()
    loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ev["target"].reshape(-1)).item()
    strata_loss = F.cross_entropy(theirs.reshape(-1, theirs.shape[-1]), ev["target"].reshape(-1)).item()
    ok = rel < 1e-5 and abs(loss - strata_loss) <= 1e-5 * abs(strata_loss)
    print(f"peers.py: strata's checkpoint in PyTorch's GPT: loss {loss:.7f} (strata {strata_loss:.7f}), "
          f"largest relative logit difference {rel:.3g}: {'same' if ok else 'DIFFERENT'}")
    return ok


def self_test(offload_py):
    """The parity check must fail a peer that is wrong and pass one that is right: a peer whose
    gradients are doubled, then torch_checkpoint (and seed_offload when its file is given)."""
    ok = True
    broken, worst = check_parity(SELF_TEST_BROKEN, offload_py)
    print(f"peers.py: self-test: doubled gradients -> parity {'passed' if broken else 'failed'} "
          f"(largest relative difference {worst:.3g})", file=sys.stderr, flush=True)
    if broken is not False:
        print("peers.py: self-test FAILED: the parity check passed a peer with doubled gradients", file=sys.stderr)
        ok = False
    right = ["torch_checkpoint"] + (["seed_offload"] if offload_py and os.path.exists(offload_py) else [])
    for kind in right:
        passed, worst = check_parity(kind, offload_py)
        print(f"peers.py: self-test: {kind} -> parity {'passed' if passed else 'failed'} "
              f"(largest relative difference {worst:.3g})", file=sys.stderr, flush=True)
        if not passed:
            print(f"peers.py: self-test FAILED: the parity check failed {kind}", file=sys.stderr)
            ok = False
    return 0 if ok else 1


def full(t):
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().float().cpu()


def check_parity(kind, offload_py, bert=False):
    """Loss and every gradient of the peer on gpt-tiny against one process running the plain model
    on the same weights and batch, in full fp32 (under --precision=bf16 both under the same
    autocast: the same bf16 operations). Returns (ok, largest relative difference).
    torch_baseline is that reference itself: nothing to check."""
    if kind == "torch_baseline":
        return None, None
    c, dev = PRESETS["bert-tiny" if bert else "gpt-tiny"], torch.device("cuda:0")
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        idx, target = batch(c, dev)
        results = []
        for k in ("torch_baseline", kind):
            model, _, ctx, _ = build_peer(k, c, dev, offload_py)
            loss = forward_backward(model, idx, target, ctx, None if bert else c["vocab"])
            torch.cuda.synchronize()
            grads = {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None}
            results.append((loss.item(), grads))
        (ref_loss, ref), (loss, got) = results
        if set(ref) != set(got):
            return False, float("inf")
        # fp32 in another order (checkpointing, offloaded copies): a few ulp; a bug is far larger.
        # FSDP2's bf16 casts every operation where autocast keeps some in fp32: within bf16's
        # rounding (2^-8) over the tiny model's depth, still far below a doubled gradient's 1.0.
        worst = abs(loss - ref_loss) / abs(ref_loss)
        for n in ref:
            scale = ref[n].abs().max().item() or 1.0
            worst = max(worst, (got[n] - ref[n]).abs().max().item() / scale)
        tolerance = 0.1 if PRECISION == "bf16" and kind.startswith("fsdp2") else 1e-4
        return worst < tolerance, worst
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


def peer_name(kind, model_name):
    """The row's name; a precision other than fp32 shows as strata_bench shows it."""
    return f"{kind}[precision={PRECISION}]/{model_name}" if PRECISION != "fp32" else f"{kind}/{model_name}"


def run_peer(kind, c, steps, offload_py, model_name, profile_dir=None):
    dev = torch.device("cuda:0")
    idx, target = batch(c, dev)
    name = peer_name(kind, model_name)
    torch.cuda.empty_cache()
    parity, worst = check_parity(kind, offload_py, bert=is_bert(c))
    if parity is False:
        tiny = "bert-tiny" if is_bert(c) else "gpt-tiny"
        return failed(name, f"parity failed: largest relative difference {worst:.3g} on {tiny}")
    torch.cuda.empty_cache()
    model, opt, ctx, offloaded = build_peer(kind, c, dev, offload_py)
    fb, op = timed_steps(model, opt, idx, target, steps, backward_ctx=ctx)
    if profile_dir:
        os.makedirs(profile_dir, exist_ok=True)
        path = os.path.join(profile_dir, f"{kind}.trace.json")
        profile_step(model, idx, target, path, backward_ctx=ctx)
        print(f"peers.py: {kind}: profiled forward+backward: {path}", file=sys.stderr, flush=True)
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


def reference_gradients(c, dev):
    """The batch, and one process's gradients on all of it (the model from torch.manual_seed(0));
    under --precision=bf16 under autocast, as torch_baseline."""
    idx, target = batch(c, dev)
    torch.manual_seed(0)
    ref = GPT(c, checkpoint=False).to(dev)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=PRECISION == "bf16"):
        loss = F.cross_entropy(ref(idx).reshape(-1, c["vocab"]), target.reshape(-1))
    loss.backward()
    return idx, target, {n: p.grad.detach().float().cpu() for n, p in ref.named_parameters()}


def distributed_parity(kind, dev, local, rank, world):
    """Every rank runs its slice of a global batch of 2 x world on gpt-tiny; the peer's full
    gradients (all-reduced by DDP, gathered from FSDP2's shards) must equal one process's on the
    whole batch, in full fp32."""
    c = dict(PRESETS["gpt-tiny"], batch=2 * world)
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        idx, target, expected = reference_gradients(c, dev)
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


# torch.distributed.pipelining's schedules, one pipeline rank per process. Stage k of S holds an
# even share of the blocks, the embedding on stage 0 and the head on stage S-1 with its own copy of
# the tied weight; the two copies' gradients are summed over the ranks before the step (torch
# leaves tied weights across stages to the user). Placement: stage k on rank k % world, except
# ZBV's V (rank r holds stages r and 2*world-1-r).
PIPELINES = {"torch_pp_gpipe": ("ScheduleGPipe", 1), "torch_pp_1f1b": ("Schedule1F1B", 1),
             "torch_pp_interleaved": ("ScheduleInterleaved1F1B", 2), "torch_pp_zbv": ("ScheduleZBVZeroBubble", 2),
             "torch_pp_looped_bfs": ("ScheduleLoopedBFS", 2)}


class StageModule(nn.Module):
    """Under --precision=bf16 a stage computes under autocast, as torch_baseline does in one
    process, and its activations (and their gradients) travel between stages in bf16, as strata's
    do: a received one is widened again, so the residual stream stays fp32 inside each stage.
    autocast around each stage's forward, as a user would write it, casts the stage's weights to
    bf16 once per micro-batch (its cast cache lives as long as the context); strata's pipelines
    cast once per step."""
    def __init__(self, embedding, blocks, head):
        super().__init__()
        self.embedding, self.blocks, self.head = embedding, nn.ModuleList(blocks), head
        self.bf16 = PRECISION == "bf16"

    def forward(self, x):
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=self.bf16):
            if self.embedding is not None:
                x = self.embedding(x)
            elif self.bf16:
                x = x.float()
            for b in self.blocks:
                x = b(x)
            if self.head is not None:
                return self.head(x)
        return x.to(torch.bfloat16) if self.bf16 else x


def build_pipeline_peer(kind, c, dev, rank, world, n_micro, total_tokens):
    """This rank's stage modules (from a model initialised like the reference), their names in the
    reference model, the schedule, and the tied copies' holders."""
    import inspect
    import torch.distributed.pipelining as pp
    cls_name, per_rank = PIPELINES[kind]
    if world * per_rank < 2:
        raise ValueError(f"{kind} runs one stage per rank, so one rank would be no pipeline; on one GPU "
                         "run torch_pp_looped_bfs (GPipe's order), torch_pp_interleaved or torch_pp_zbv (two stages "
                         "on the rank)")
    n_stages = world * per_rank
    if kind == "torch_pp_zbv":
        mine = [rank, 2 * world - 1 - rank]
    else:
        mine = [k for k in range(n_stages) if k % world == rank]
    torch.manual_seed(0)
    full_model = GPT(c, checkpoint=False)
    counts = [c["depth"] // n_stages + (1 if k < c["depth"] % n_stages else 0) for k in range(n_stages)]
    starts = [sum(counts[:k]) for k in range(n_stages)]
    modules, names, stages = [], [], []
    for k in mine:
        emb = full_model.embedding if k == 0 else None
        head = None
        if k == n_stages - 1:
            head = Head(c["width"], nn.Parameter(full_model.embedding.tokens.detach().clone()))
            head.norm.load_state_dict(full_model.head.norm.state_dict())
        blocks = [full_model.blocks[starts[k] + j] for j in range(counts[k])]
        m = StageModule(emb, blocks, head).to(dev)
        ref_names = {}
        for n, _ in m.named_parameters():
            if n.startswith("blocks."):
                j, rest = n.split(".", 2)[1:]
                ref_names[n] = f"blocks.{starts[k] + int(j)}.{rest}"
            elif n == "head.weight":
                ref_names[n] = "embedding.tokens"
            else:
                ref_names[n] = n
        modules.append(m)
        names.append(ref_names)
        stages.append(pp.PipelineStage(m, k, n_stages, dev))
    cls = getattr(pp, cls_name)
    # The loss in fp32 (under bf16 the head's logits arrive in bf16), as strata and autocast take it.
    kw = {"loss_fn": lambda out, tgt: F.cross_entropy(out.float().reshape(-1, c["vocab"]), tgt.reshape(-1),
                                                      reduction="sum") / total_tokens}
    if "scale_grads" in inspect.signature(cls.__init__).parameters:
        kw["scale_grads"] = False  # the loss is already the global batch's mean
    schedule = cls(stages[0] if per_rank == 1 else stages, n_micro, **kw)
    return modules, names, schedule, mine, n_stages


def pipeline_step(schedule, mine, n_stages, idx, target):
    losses = []
    args = [idx] if 0 in mine else []
    kwargs = {"target": target, "losses": losses} if n_stages - 1 in mine else {}
    schedule.step(*args, **kwargs)
    return losses


def sum_tied(modules, c):
    """The embedding's and the head's copies of the tied weight: their gradients summed over all
    ranks (zeros where absent), so both copies take the same step."""
    import torch.distributed as dist
    copies = [m.embedding.tokens for m in modules if m.embedding is not None]
    copies += [m.head.weight for m in modules if m.head is not None]
    ref = next(p for m in modules for p in m.parameters())
    total = torch.zeros((c["vocab"], c["width"]), device=ref.device)
    for p in copies:
        if p.grad is not None:
            total += p.grad
    dist.all_reduce(total)
    for p in copies:
        p.grad = total.clone()



def pipeline_parity(kind, dev, rank, world):
    """gpt-tiny (4 blocks), a global batch of 2 x world in as many micro-batches: every rank's
    stage gradients (the tied copies summed) against one process's on the whole batch."""
    import torch.distributed as dist
    c = dict(PRESETS["gpt-tiny"], depth=4, batch=2 * world)
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        idx, target, expected = reference_gradients(c, dev)
        modules, names, schedule, mine, n_stages = build_pipeline_peer(kind, c, dev, rank, world, 2 * world, idx.numel())
        pipeline_step(schedule, mine, n_stages, idx, target)
        sum_tied(modules, c)
        torch.cuda.synchronize()
        worst = 0.0
        for m, ref_names in zip(modules, names):
            for n, p in m.named_parameters():
                g = expected[ref_names[n]]
                got = p.grad.detach().float().cpu() if p.grad is not None else torch.zeros_like(g)
                worst = max(worst, (got - g).abs().max().item() / (g.abs().max().item() or 1.0))
        w = torch.tensor([worst], device=dev)
        dist.all_reduce(w, op=dist.ReduceOp.MAX)
        # bf16: activations rounded to bf16 at each stage boundary where the reference keeps fp32,
        # within bf16's rounding over the tiny model's depth, far below a doubled gradient's 1.0.
        return w.item() < (0.1 if PRECISION == "bf16" else 1e-4), w.item()
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved


def run_pipeline_peer(kind, c, dev, rank, world, steps, n_micro):
    import torch.distributed as dist
    idx, target = batch(c, dev)
    modules, _, schedule, mine, n_stages = build_pipeline_peer(kind, c, dev, rank, world, n_micro, idx.numel())
    params = [p for m in modules for p in m.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-4)
    fb, op = [], []
    for i in range(steps + 2):  # 2 warm-up steps, as strata_bench
        if i == 2:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        dist.barrier()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        pipeline_step(schedule, mine, n_stages, idx, target)
        sum_tied(modules, c)
        torch.cuda.synchronize()
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        if i >= 2:
            fb.append((t1 - t0) * 1e3)
            op.append((t2 - t1) * 1e3)
    return fb, op


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
        pipelined = kind in PIPELINES
        tag = "" if PRECISION == "fp32" else f";precision={PRECISION}"
        name = (f"{kind}[m={args.micro_batches};ranks={world}{tag}]/{args.model}" if pipelined
                else f"{kind}[ranks={world}{tag}]/{args.model}")
        t0 = time.time()
        model = opt = None
        try:
            if pipelined:
                ok, worst = pipeline_parity(kind, dev, rank, world)
            else:
                ok, worst = distributed_parity(kind, dev, local, rank, world)
            if not ok:
                results.append(failed(name, f"parity failed: largest relative difference {worst:.3g} on gpt-tiny"))
                continue
            torch.cuda.empty_cache()
            if pipelined:
                fb, op = run_pipeline_peer(kind, c, dev, rank, world, args.steps, args.micro_batches)
            else:
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
        context = {"peers_device": torch.cuda.get_device_name(0), "torch_version": torch.__version__, "precision": PRECISION, "ranks": world,
                   "date": time.strftime("%Y-%m-%d %H:%M:%S")}
        with open(args.out, "w") as f:
            json.dump({"context": context, "benchmarks": results}, f, indent=1)
    dist.destroy_process_group()
    bad = [r["name"] for r in results if r.get("error_occurred") and not r["error_message"].startswith("out of memory")]
    return 1 if bad else 0


def dir_bytes(path):
    total = 0
    for root, _, files in os.walk(path):
        total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    return total


def checkpoint_row(kind, peer, model_name, ms, reps, extra):
    name = f"checkpoint_{kind}/{peer}/{model_name}"
    out = {"name": name, "run_name": name, "run_type": "iteration", "iterations": reps, "real_time": ms,
           "cpu_time": ms, "time_unit": "ms"}
    out.update(extra)
    return out


def run_checkpoint_peer(peer, c, model_name, root, reps):
    """One peer's save, load and asynchronous-save rows (see the module's text). As strata's bench,
    a step moves the parameters between the save and the load, which must bring back those saved."""
    import shutil
    import types
    dcp = types.SimpleNamespace() if peer == "torch_save" else importlib.import_module("torch.distributed.checkpoint")
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    torch.manual_seed(0)
    fsdp = peer == "dcp_fsdp2"
    if fsdp:
        model, opt, _, _ = build_peer("fsdp2", c, dev, None)
    else:
        model = GPT(c, checkpoint=False).to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    idx, target = batch(c, dev)

    def step():
        forward_backward(model, idx, target, vocab=c["vocab"])
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()

    step()
    if fsdp:
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
        state = lambda: dict(zip(("model", "optim"), get_state_dict(model, opt)))
        restore = lambda sd: set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])
    else:
        state = lambda: {"model": model.state_dict(), "optim": opt.state_dict()}

        def restore(sd):
            model.load_state_dict(sd["model"])
            opt.load_state_dict(sd["optim"])

    def save(sd, path):
        if peer == "torch_save":
            torch.save(sd, os.path.join(path, "state.pt"))
        elif hasattr(dcp, "save"):
            dcp.save(sd, checkpoint_id=path)
        else:  # torch < 2.2
            dcp.save_state_dict(sd, storage_writer=dcp.FileSystemWriter(path), no_dist=True)

    def load(path):
        if peer == "torch_save":
            sd = torch.load(os.path.join(path, "state.pt"), map_location=dev)
        else:
            sd = state()  # DCP loads in place, into tensors of the right shapes and placement
            if hasattr(dcp, "load"):
                dcp.load(sd, checkpoint_id=path)
            else:
                dcp.load_state_dict(sd, storage_reader=dcp.FileSystemReader(path), no_dist=True)
        restore(sd)
        sync()

    save_ms, load_ms, blocked_ms, step_ms, nbytes = [], [], [], [], 0
    for r in range(reps):
        path = os.path.join(root, f"{peer}-{r}")
        shutil.rmtree(path, ignore_errors=True)
        os.makedirs(path)
        before = [p.detach().clone() for p in model.parameters()]
        t0 = time.perf_counter()
        save(state(), path)
        save_ms.append((time.perf_counter() - t0) * 1e3)
        nbytes = dir_bytes(path)
        step()  # the parameters move on; the load must bring back those saved
        t0 = time.perf_counter()
        load(path)
        load_ms.append((time.perf_counter() - t0) * 1e3)
        for a, b in zip(before, model.parameters()):
            if not torch.equal(full(a), full(b.detach())):
                raise RuntimeError("parity failed: a parameter differs after the load from what was saved")
        shutil.rmtree(path, ignore_errors=True)
        if peer == "torch_save" or hasattr(dcp, "async_save"):
            os.makedirs(path)
            t0 = time.perf_counter()
            if peer == "torch_save":  # torch.save has no asynchronous form: a copy, then a thread
                import threading
                copy = {k: v for k, v in state().items()}
                copy = torch.utils._pytree.tree_map(lambda t: t.to("cpu", copy=True) if torch.is_tensor(t) else t, copy)
                done = threading.Thread(target=torch.save, args=(copy, os.path.join(path, "state.pt")))
                done.start()
                finish = done.join
            else:
                finish = dcp.async_save(state(), checkpoint_id=path).result
            blocked_ms.append((time.perf_counter() - t0) * 1e3)
            t1 = time.perf_counter()
            step()
            step_ms.append((time.perf_counter() - t1) * 1e3)
            finish()
            shutil.rmtree(path, ignore_errors=True)
        print(f"peers.py: {peer}: save {save_ms[-1]:.0f} ms, load {load_ms[-1]:.0f} ms"
              + (f", async blocks {blocked_ms[-1]:.0f} ms" if blocked_ms else "") + f", {nbytes / 1e9:.2f} GB",
              file=sys.stderr, flush=True)
    gb = nbytes / 1e9
    rows = [checkpoint_row("save", peer, model_name, statistics.mean(save_ms), reps,
                           {"bytes": nbytes, "GB_per_s": gb / (statistics.mean(save_ms) / 1e3)}),
            checkpoint_row("load", peer, model_name, statistics.mean(load_ms), reps,
                           {"bytes": nbytes, "GB_per_s": gb / (statistics.mean(load_ms) / 1e3)})]
    if blocked_ms:
        rows.append(checkpoint_row("async_blocked", peer, model_name, statistics.mean(blocked_ms), reps,
                                   {"bytes": nbytes, "of_sync_save": statistics.mean(blocked_ms) / statistics.mean(save_ms),
                                    "step_ms_while_writing": statistics.mean(step_ms)}))
    return rows


def run_checkpoint_peers(args):
    c = PRESETS[args.model]
    if is_bert(c):
        sys.exit("peers.py: --checkpoint-dir runs the GPT presets")
    try:
        importlib.import_module("torch.distributed.checkpoint")
        try:
            from torch.distributed.fsdp import fully_shard  # noqa: F401
            default = "dcp_fsdp2,torch_save"
        except ImportError:
            default = "dcp_model,torch_save"
    except Exception as e:  # Debian's torch 1.13 under Python 3.11 cannot import DCP at all
        print(f"peers.py: no torch.distributed.checkpoint here ({type(e).__name__}): torch_save only",
              file=sys.stderr, flush=True)
        default = "torch_save"
    peers = default.split(",") if args.peers == "torch_baseline,torch_checkpoint,fsdp2_cpu_offload,seed_offload" \
        else args.peers.split(",")
    results, bad = [], []
    for peer in peers:
        if peer not in ("dcp_fsdp2", "dcp_model", "torch_save"):
            sys.exit(f"peers.py: --checkpoint-dir runs dcp_fsdp2, dcp_model and torch_save, not {peer}")
        try:
            results += run_checkpoint_peer(peer, c, args.model, args.checkpoint_dir, args.repetitions)
        except Exception as e:
            message = str(e) if str(e).startswith("parity failed") else f"{type(e).__name__}: {e}"
            results.append(failed(f"checkpoint_save/{peer}/{args.model}", message))
            print(f"peers.py: {peer} failed: {type(e).__name__}: {str(e)[:300]}", file=sys.stderr, flush=True)
            bad.append(peer)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    context = {"peers_device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
               "torch_version": torch.__version__, "checkpoint_dir": args.checkpoint_dir,
               "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    with open(args.out, "w") as f:
        json.dump({"context": context, "benchmarks": results}, f, indent=1)
    return 1 if bad else 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt-871m", choices=sorted(PRESETS))
    ap.add_argument("--peers", default="torch_baseline,torch_checkpoint,fsdp2_cpu_offload,seed_offload")
    ap.add_argument("--offload-py", help="path to seed 003's offload.py (needed by the seed_offload peer)")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batch", type=int, help="the batch, where not the preset's (the rows are then named "
                                               "MODEL[batch=N], as strata_bench names its cells)")
    ap.add_argument("--precision", default="fp32", choices=["fp32", "bf16"],
                    help="bf16: torch_baseline and torch_checkpoint under torch.autocast(bfloat16), fsdp2 and "
                         "fsdp2_cpu_offload under FSDP2's MixedPrecisionPolicy (the default peer list becomes "
                         "those four; torch_pp_* peers under torchrun: every stage under autocast)")
    ap.add_argument("--micro-batches", type=int, default=8, help="for the torch_pp_* pipeline peers")
    ap.add_argument("--out", help="the JSON to write (required unless --self-test)")
    ap.add_argument("--strata-state", metavar="PT",
                    help="a strata checkpoint's consolidated state.pt: check it in this GPT against --strata-eval")
    ap.add_argument("--strata-eval", metavar="PT", help="strata_train's eval.pt (a batch and strata's logits)")
    ap.add_argument("--checkpoint-dir", metavar="DIR",
                    help="time checkpoints of a training state written to DIR instead (see above)")
    ap.add_argument("--repetitions", type=int, default=3, help="with --checkpoint-dir: saves and loads per peer")
    ap.add_argument("--self-test", action="store_true",
                    help="only show that the parity check fails a deliberately wrong peer and passes right ones")
    ap.add_argument("--profile", metavar="DIR",
                    help="after timing, record one forward+backward of each one-process peer into DIR/<peer>.trace.json")
    args = ap.parse_args()
    if args.checkpoint_dir:
        if not args.out:
            ap.error("--out is required")
        return run_checkpoint_peers(args)
    if args.strata_state:  # on the host: any machine with PyTorch
        sys.exit(0 if check_strata_state(args.model, args.strata_state, args.strata_eval) else 1)
    if not torch.cuda.is_available():
        sys.exit("peers.py: needs a CUDA device")
    if args.self_test:
        return self_test(args.offload_py)
    if not args.out:
        ap.error("--out is required")
    global PRECISION
    PRECISION = args.precision
    # Pipeline peers also run on one rank (torchrun --nproc-per-node=1): two stages on one GPU.
    pipelines_only = all(k in PIPELINES for k in args.peers.split(","))
    if "RANK" in os.environ and (int(os.environ.get("WORLD_SIZE", "1")) > 1 or pipelines_only):
        if is_bert(PRESETS[args.model]):
            ap.error("the data-parallel and pipeline peers run the GPT presets only")
        if args.peers == ap.get_default("peers"):
            args.peers = "ddp,fsdp2,fsdp2_cpu_offload"
        if PRECISION != "fp32" and not pipelines_only:
            ap.error(f"--precision={PRECISION} over ranks runs the torch_pp_* pipeline peers only")
        return run_distributed(args)
    if PRECISION != "fp32":
        mixed = ("torch_baseline", "torch_checkpoint", "fsdp2", "fsdp2_cpu_offload")
        if args.peers == ap.get_default("peers"):
            args.peers = ",".join(mixed)
        other = [k for k in args.peers.split(",") if k not in mixed]
        if other:
            ap.error(f"--precision={PRECISION} runs {', '.join(mixed)} only, not {','.join(other)}")
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    c = PRESETS[args.model]
    model_name = args.model
    if args.batch and args.batch != c["batch"]:
        c = dict(c, batch=args.batch)
        model_name = f"{args.model}[batch={args.batch}]"
    results = []
    for kind in args.peers.split(","):
        if kind == "seed_offload" and not (args.offload_py and os.path.exists(args.offload_py)):
            results.append(failed(f"{kind}/{model_name}", f"--offload-py not given or missing: {args.offload_py}"))
            continue
        print(f"peers.py: {kind} on {model_name}", file=sys.stderr, flush=True)
        t0 = time.time()
        try:
            results.append(run_peer(kind, c, args.steps, args.offload_py, model_name, args.profile))
            r = results[-1]
            if r.get("error_occurred"):
                print(f"peers.py: {kind}: {r['error_message']}", file=sys.stderr, flush=True)
                continue
            print(f"peers.py: {kind}: {r['real_time']:.1f} ms/step, peak {r['peak_allocated_bytes'] / 2**30:.2f} GiB"
                  f" ({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
        except Exception as e:  # an out-of-memory or a broken peer is a result; the others still run
            results.append(failed(peer_name(kind, model_name), f"{type(e).__name__}: {e}"))
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
