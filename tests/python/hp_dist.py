"""Runs a function on N gloo ranks (spawned processes over loopback) for the package's tests.

    results = run_ranks(2, worker, arg)    # worker(rank, world_size, arg) on every rank

Each rank initialises torch.distributed (gloo, tcp://127.0.0.1:<free port>) with its share of
the cores, calls the worker, and hands back what it returned (anything torch.save takes). A rank
that raises fails the call with its traceback; a rank that hangs is killed at the timeout.
"""

import datetime
import os
import socket
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank, world_size, port, out_dir, fn, args, timeout):
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    result = {}
    try:
        # A rank whose peer failed stops waiting well before the harness gives up on it.
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout / 2))
        result["value"] = fn(rank, world_size, *args)
        dist.barrier()
        dist.destroy_process_group()
    except BaseException:  # noqa: B902 - report everything to the parent
        result["error"] = traceback.format_exc()
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))


def run_ranks(world_size, fn, *args, timeout=600):
    ctx = mp.get_context("spawn")
    port = _free_port()
    with tempfile.TemporaryDirectory() as out_dir:
        procs = [ctx.Process(target=_rank_main,
                             args=(r, world_size, port, out_dir, fn, args, timeout))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for r in hung:
            procs[r].kill()  # by its own handle: only the ranks this call started
            procs[r].join()
        results, errors = [], []
        if hung:
            errors.append(f"ranks {hung} of {world_size} did not finish in {timeout} s")
        for r in range(world_size):
            path = os.path.join(out_dir, f"rank{r}.pt")
            if not os.path.exists(path):
                if r not in hung:
                    errors.append(f"rank {r} exited with code {procs[r].exitcode} and no result")
                continue
            res = torch.load(path)
            if "error" in res:
                errors.append(f"rank {r}:\n{res['error']}")
            results.append(res.get("value"))
        if errors:
            raise AssertionError("\n".join(errors))
        return results
