#!/usr/bin/env python3
"""The Python path's cost: hyperparallel.context_parallel_attention from PyTorch against
`hp-bench cp` on the same shape, measured in one run.

Each step is one forward + backward of the CP attention on every rank (B, S, H, D as given;
inputs created once; the step time is rank 0's wall time, the median over --iters after one
warm-up step), exactly what `hp-bench cp` times, on loopback gloo with the same cores per rank.

    PYTHONPATH=build/python python3 bench/python/cp_bench.py --seq 8192 --cp 2 \\
        --algorithm ulysses --causal --hp-bench build/tools/hp-bench

prints both medians, their ratio and one JSON line (--json only the JSON).
"""

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def rank_main(rank, args, port, out_path):
    import hyperparallel as hp

    torch.set_num_threads(max(1, (os.cpu_count() or 1) // args.cp))
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=args.cp)
    g = torch.Generator().manual_seed(rank)
    s_local = args.seq // args.cp
    # BNSD, as hp-bench cp lays its tensors out.
    shape_q = (args.batch, args.heads, s_local, args.head_dim)
    shape_kv = (args.batch, args.kv_heads, s_local, args.head_dim)
    q = torch.randn(shape_q, generator=g).requires_grad_(True)
    k = torch.randn(shape_kv, generator=g).requires_grad_(True)
    v = torch.randn(shape_kv, generator=g).requires_grad_(True)
    dout = torch.randn(shape_q, generator=g)
    times = []
    for i in range(args.iters + 1):
        dist.barrier()
        start = time.perf_counter()
        out = hp.context_parallel_attention(q, k, v, algorithm=args.algorithm,
                                            ulysses_degree=args.ulysses_degree,
                                            causal=args.causal, schedule=args.schedule,
                                            layout="bnsd")
        out.backward(dout)
        dist.barrier()
        if i > 0:
            times.append(time.perf_counter() - start)
        q.grad = k.grad = v.grad = None
    if rank == 0:
        with open(out_path, "w") as f:
            json.dump(times, f)
    dist.destroy_process_group()


def python_median(args):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory() as d:
        out_path = os.path.join(d, "times.json")
        mp.spawn(rank_main, args=(args, port, out_path), nprocs=args.cp)
        with open(out_path) as f:
            times = json.load(f)
    return statistics.median(times), times


def hp_bench_median(args):
    cmd = [args.hp_bench, "cp", "--seq", str(args.seq), "--heads", str(args.heads),
           "--kv-heads", str(args.kv_heads), "--head-dim", str(args.head_dim),
           "--batch", str(args.batch), "--cp", str(args.cp), "--cp-algo", args.algorithm,
           "--schedule", args.schedule, "--iters", str(args.iters), "--json"]
    if args.ulysses_degree:
        cmd += ["--ulysses-degree", str(args.ulysses_degree)]
    if args.causal:
        cmd.append("--causal")
    run = subprocess.run(cmd, capture_output=True, text=True, check=True)
    results = json.loads(run.stdout.strip().splitlines()[-1])["results"]  # async: sync first
    result = [r for r in results if r["schedule"] == args.schedule][-1]
    return result, "hp-bench " + " ".join(cmd[1:])


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seq", type=int, default=8192)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--cp", type=int, default=2)
    p.add_argument("--algorithm", default="ulysses")
    p.add_argument("--ulysses-degree", type=int, default=None)
    p.add_argument("--schedule", default="sync")
    p.add_argument("--causal", action="store_true")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--hp-bench", default="", help="also run this hp-bench binary's cp command")
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    py_median, py_times = python_median(args)
    out = {"python_step_s": py_median, "python_times_s": py_times}
    if args.hp_bench:
        result, command = hp_bench_median(args)
        out["hp_bench"] = command
        out["hp_bench_step_s"] = result["step_time_s"]
        out["python_over_hp_bench"] = py_median / result["step_time_s"]
    if not args.json:
        print(f"python  context_parallel_attention: median step {py_median:.3f} s "
              f"({args.iters} iters)")
        if args.hp_bench:
            print(f"{out['hp_bench']}: median step {out['hp_bench_step_s']:.3f} s")
            print(f"python / hp-bench = {out['python_over_hp_bench']:.3f}")
    print(json.dumps(out))


if __name__ == "__main__":
    sys.exit(main())
