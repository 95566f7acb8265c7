#!/usr/bin/env python3
"""The peer table: a DeepSpeed-Ulysses-style layer in plain PyTorch against `hp-bench cp`
(ulysses), same shapes, measured in one run.

The peer is DeepSpeed's DistributedAttention pattern written here (DeepSpeed itself is not
installed): a seq->head all_to_all_single of q, k and v over a gloo group, the local attention
in plain PyTorch (explicit scores, causal mask, softmax, fp32: torch 1.13 has no fused CPU
attention), and the head->seq all-to-all of the output; autograd through both. Each step is one
forward + backward on every rank (B, H, D as given, BSHD as DeepSpeed lays them out), rank 0's
wall time, median over --iters after one warm-up; peak memory is the largest ru_maxrss of the
ranks (the torch import included, as LibTorch is in hp-bench's figure). `hp-bench cp` runs the
same shape with --cp-algo ulysses (its own median and peak RSS).

    PYTHONPATH=build/python python3 bench/python/peer_bench.py --seqs 4096,8192 --cps 2,4 \\
        --causal --iters 3 --hp-bench build/tools/hp-bench

prints one markdown row per (S, P) and one JSON line.
"""

import argparse
import json
import math
import os
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


class _SeqAllToAll(torch.autograd.Function):
    """DeepSpeed-Ulysses' all-to-all: scatter `scatter_dim` over the ranks, gather `gather_dim`."""

    @staticmethod
    def forward(ctx, x, scatter_dim, gather_dim):
        ctx.dims = (scatter_dim, gather_dim)
        p = dist.get_world_size()
        send = torch.stack(x.chunk(p, dim=scatter_dim)).contiguous()  # chunk j to rank j
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send)
        return torch.cat(recv.unbind(0), dim=gather_dim)

    @staticmethod
    def backward(ctx, grad):
        scatter_dim, gather_dim = ctx.dims
        return _SeqAllToAll.apply(grad, gather_dim, scatter_dim), None, None


def local_attention(q, k, v, causal, mask=None):
    """Plain PyTorch attention, BSHD [B, S, h, D]; `mask` (True above the diagonal) is built
    when not given."""
    scale = 1.0 / math.sqrt(q.shape[-1])
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    if causal:
        if mask is None:
            mask = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, dim=-1), v)


def deepspeed_ulysses(q, k, v, causal, mask=None):
    """DistributedAttention(local_attention) as DeepSpeed-Ulysses does it, on this rank's BSHD
    sequence shards [B, S/P, H, D] (the package's drop-in test checks it against hyperparallel,
    so the table compares two layers that compute the same numbers)."""
    qh, kh, vh = (_SeqAllToAll.apply(t, 2, 1) for t in (q, k, v))
    return _SeqAllToAll.apply(local_attention(qh, kh, vh, causal, mask), 1, 2)


def rank_main(rank, args, seq, cp, port, out_path):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // cp))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=cp)
    g = torch.Generator().manual_seed(rank)
    s_local = seq // cp
    shape = (args.batch, s_local, args.heads, args.head_dim)
    q, k, v = (torch.randn(shape, generator=g).requires_grad_(True) for _ in range(3))
    dout = torch.randn(shape, generator=g)
    mask = torch.ones(seq, seq, dtype=torch.bool).triu(1) if args.causal else None
    times = []
    for i in range(args.iters + 1):
        dist.barrier()
        start = time.perf_counter()
        deepspeed_ulysses(q, k, v, args.causal, mask).backward(dout)
        dist.barrier()
        if i > 0:
            times.append(time.perf_counter() - start)
        q.grad = k.grad = v.grad = None
    peak = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0])
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump({"times": times, "peak_rss_bytes": peak.item()}, f)
    dist.destroy_process_group()


def peer(args, seq, cp):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        out_path = os.path.join(d, "peer.json")
        mp.spawn(rank_main, args=(args, seq, cp, port, out_path), nprocs=cp)
        with open(out_path) as f:
            r = json.load(f)
    return statistics.median(r["times"]), r["peak_rss_bytes"]


def hp_bench(args, seq, cp):
    cmd = [args.hp_bench, "cp", "--seq", str(seq), "--heads", str(args.heads),
           "--kv-heads", str(args.heads), "--head-dim", str(args.head_dim),
           "--batch", str(args.batch), "--cp", str(cp), "--cp-algo", "ulysses",
           "--iters", str(args.iters), "--json"]
    if args.causal:
        cmd.append("--causal")
    run = subprocess.run(cmd, capture_output=True, text=True, check=True)
    result = json.loads(run.stdout.strip().splitlines()[-1])["results"][-1]
    return result["step_time_s"], result["peak_rss_bytes"], " ".join(cmd[1:])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seqs", default="4096,8192")
    p.add_argument("--cps", default="2,4")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--causal", action="store_true")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--hp-bench", required=True, help="the hp-bench binary")
    args = p.parse_args()
    rows = []
    print("| S | P | DeepSpeed-style Ulysses step s | peak MiB | hp-bench cp ulysses step s "
          "| peak MiB | speed-up | memory ratio |")
    print("|---|---|---|---|---|---|---|---|")
    for seq in (int(x) for x in args.seqs.split(",")):
        for cp in (int(x) for x in args.cps.split(",")):
            peer_s, peer_peak = peer(args, seq, cp)
            hp_s, hp_peak, command = hp_bench(args, seq, cp)
            row = {"seq": seq, "cp": cp, "peer_step_s": peer_s, "peer_peak_rss_bytes": peer_peak,
                   "hp_bench": "hp-bench " + command, "hp_step_s": hp_s,
                   "hp_peak_rss_bytes": hp_peak, "speedup": peer_s / hp_s,
                   "memory_ratio": peer_peak / hp_peak}
            rows.append(row)
            print(f"| {seq} | {cp} | {peer_s:.3f} | {peer_peak / 2**20:.0f} | {hp_s:.3f} "
                  f"| {hp_peak / 2**20:.0f} | {row['speedup']:.2f}x | {row['memory_ratio']:.1f}x |",
                  flush=True)
    print(json.dumps({"causal": args.causal, "heads": args.heads, "head_dim": args.head_dim,
                      "batch": args.batch, "iters": args.iters, "rows": rows}))


if __name__ == "__main__":
    sys.exit(main())
