#!/usr/bin/env python3
"""A small PyTorch language model whose attention is hyperparallel's context parallelism.

Each rank holds one shard of every sequence (head-tail balanced); its attention calls
hyperparallel.context_parallel_attention over the torch.distributed (gloo) group; everything
else is plain PyTorch. Parameters are replicated, so their gradients are summed over the ranks
(the loss is the mean over all ranks' tokens). The task: copy the first half of each sequence
into the second half (the loss falls once attention learns to look back).

    python3 examples/train_with_torch.py --nproc 2           # spawns 2 local ranks
    torchrun --nproc_per_node 2 examples/train_with_torch.py   # or any RANK/WORLD_SIZE launcher

Needs the package on the path: PYTHONPATH=build/python (scripts/build.sh builds it).
"""

import argparse
import os
import socket
import sys
import time

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "build",
                                "python"))
import hyperparallel as hp  # noqa: E402


def rope(x, pos, theta=10000.0):
    """Rotary embedding of x [B, S, H, D] at global positions pos [S]."""
    d = x.size(-1)
    freqs = theta ** (-torch.arange(0, d, 2, dtype=torch.float32) / d)
    angles = pos[:, None].float() * freqs[None, :]  # [S, D/2]
    cos, sin = angles.cos()[None, :, None, :], angles.sin()[None, :, None, :]
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2)


class Block(nn.Module):
    def __init__(self, hidden, heads, kv_heads, cp_options):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, hidden // heads
        self.norm1, self.norm2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.q = nn.Linear(hidden, heads * self.head_dim, bias=False)
        self.kv = nn.Linear(hidden, 2 * kv_heads * self.head_dim, bias=False)
        self.o = nn.Linear(heads * self.head_dim, hidden, bias=False)
        self.mlp = nn.Sequential(nn.Linear(hidden, 4 * hidden), nn.GELU(),
                                 nn.Linear(4 * hidden, hidden))
        # The one line that differs from a single-process model: CP attention.
        self.attention = hp.ContextParallelAttention(causal=True, layout="bshd", **cp_options)

    def forward(self, x, pos):
        b, s, _ = x.shape
        h = self.norm1(x)
        q = rope(self.q(h).view(b, s, self.heads, self.head_dim), pos)
        k, v = self.kv(h).view(b, s, 2, self.kv_heads, self.head_dim).unbind(2)
        a = self.attention(q, rope(k, pos), v)
        x = x + self.o(a.reshape(b, s, -1))
        return x + self.mlp(self.norm2(x))


class Model(nn.Module):
    def __init__(self, vocab, hidden, heads, kv_heads, layers, cp_options):
        super().__init__()
        self.embed = nn.Embedding(vocab, hidden)
        self.blocks = nn.ModuleList(Block(hidden, heads, kv_heads, cp_options)
                                    for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids, pos):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x, pos)
        return self.head(self.norm(x))


def copy_batch(gen, batch, seq, vocab):
    """Random first halves, copied into the second halves; only the copies are predicted."""
    half = seq // 2
    first = torch.randint(1, vocab, (batch, half), generator=gen)
    ids = torch.cat([first, first], dim=1)
    labels = torch.full_like(ids, -100)
    labels[:, half - 1:seq - 1] = ids[:, half:]
    return ids, labels


def train(rank, world, args):
    torch.manual_seed(args.seed)  # the same initial parameters on every rank
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    cp_options = dict(algorithm=args.algorithm, schedule=args.schedule,
                      load_balance=args.load_balance)
    model = Model(args.vocab, args.hidden, args.heads, args.kv_heads, args.layers, cp_options)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    gen = torch.Generator().manual_seed(args.seed + 1)  # the same batches on every rank
    shard = lambda t: hp.shard_sequence(t, 1, load_balance=args.load_balance)  # noqa: E731
    pos = shard(torch.arange(args.seq_len)[None])[0]  # global positions of this rank's tokens
    losses = []
    for step in range(1, args.steps + 1):
        start = time.perf_counter()
        ids, labels = copy_batch(gen, args.batch, args.seq_len, args.vocab)
        ids, labels = shard(ids), shard(labels)
        logits = model(ids, pos)
        loss_sum = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100,
                                   reduction="sum")
        count = (labels != -100).sum().float()
        total = count.clone()
        dist.all_reduce(total)
        (loss_sum / total).backward()
        for p in model.parameters():  # replicated parameters: sum the ranks' gradients
            dist.all_reduce(p.grad)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss = loss_sum.detach().clone()
        dist.all_reduce(loss)
        losses.append((loss / total).item())
        if rank == 0 and (step == 1 or step % args.log_every == 0 or step == args.steps):
            print(f"step {step:4d}  loss {losses[-1]:.4f}  "
                  f"({time.perf_counter() - start:.2f} s)", flush=True)
    return losses


def run_rank(rank, world, args, init_method):
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world)
    try:
        losses = train(rank, world, args)
        if rank == 0:
            print(f"loss {losses[0]:.4f} -> {losses[-1]:.4f} over {len(losses)} steps on {world} "
                  f"ranks ({args.algorithm}/{args.schedule})", flush=True)
    finally:
        dist.destroy_process_group()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=0,
                   help="local ranks to spawn (0: take RANK/WORLD_SIZE from the launcher)")
    p.add_argument("--algorithm", default="ulysses", choices=hp.ALGORITHMS)
    p.add_argument("--schedule", default="sync", choices=("sync", "async"))
    p.add_argument("--load-balance", action="store_true")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--vocab", type=int, default=16)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-every", type=int, default=10)
    args = p.parse_args()
    if args.nproc > 0:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        torch.multiprocessing.spawn(run_rank, args=(args.nproc, args,
                                                    f"tcp://127.0.0.1:{port}"),
                                    nprocs=args.nproc)
    elif "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        run_rank(int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), args, "env://")
    else:
        p.error("give --nproc N, or start under torchrun (RANK, WORLD_SIZE, MASTER_ADDR, "
                "MASTER_PORT)")


if __name__ == "__main__":
    main()
