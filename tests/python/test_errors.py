"""Bad inputs cross the boundary as Python exceptions naming the problem, raised before anything
is communicated (every rank gets the same error and the group stays usable); non-contiguous
inputs are not a mistake: they give the contiguous result."""

import json
import subprocess
import sys
import textwrap

import pytest
import torch

import hyperparallel as hp
from hp_dist import run_ranks


def good(b=1, s=8, h=4, d=8, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(b, s, h, d, generator=g, dtype=dtype) for _ in range(3)]


def message(fn):
    """The error fn raises, and the bytes sent before it (none: refused before any collective)."""
    hp.reset_counters()
    try:
        fn()
    except (ValueError, RuntimeError) as e:
        return type(e).__name__ + ": " + str(e) + f" [sent {hp.bytes_sent()} bytes]"
    return "no error"


def mistakes(rank, p):
    q, k, v = good()
    seen = {}
    seen["dtype"] = message(lambda: hp.context_parallel_attention(
        q.long(), k.long(), v.long()))
    seen["not_a_tensor"] = message(lambda: hp.context_parallel_attention(q.tolist(), k, v))
    seen["mixed_dtypes"] = message(lambda: hp.context_parallel_attention(q, k.double(), v))
    seen["three_dims"] = message(lambda: hp.context_parallel_attention(q[0], k[0], v[0]))
    seen["head_dims_differ"] = message(lambda: hp.context_parallel_attention(
        q, k[..., :4], v))
    seen["batch_differs"] = message(lambda: hp.context_parallel_attention(
        q, torch.cat([k, k]), torch.cat([v, v])))
    seen["meta_device"] = message(lambda: hp.context_parallel_attention(
        q.to("meta"), k.to("meta"), v.to("meta")))
    seen["algorithm"] = message(lambda: hp.context_parallel_attention(
        q, k, v, algorithm="ringo"))
    seen["layout"] = message(lambda: hp.context_parallel_attention(q, k, v, layout="sbhd"))
    seen["heads"] = message(lambda: hp.context_parallel_attention(
        q[:, :, :3], k[:, :, :3], v[:, :, :3], algorithm="ulysses"))
    seen["hybrid_degree"] = message(lambda: hp.context_parallel_attention(
        q, k, v, algorithm="hybrid", ulysses_degree=2))
    seen["odd_balanced"] = message(lambda: hp.context_parallel_attention(
        q[:, :7], k[:, :7], v[:, :7], algorithm="all_gather", load_balance=True, causal=True))
    seen["bool_mask"] = message(lambda: hp.context_parallel_attention(
        q, k, v, mask=torch.ones(16, 16, dtype=torch.bool)))
    seen["group"] = message(lambda: hp.context_parallel_attention(q, k, v, group="cp"))
    seen["shard_length"] = message(lambda: hp.shard_sequence(torch.zeros(1, 7), 1))
    seen["mask_rows"] = message(lambda: hp.context_parallel_attention(
        q, k, v, mask=torch.zeros(3, 16, dtype=torch.long)))
    seen["linear_mask_rows"] = message(lambda: hp.LinearAttentionCP("gdn")(
        q, k, v, torch.zeros(1, 8, 4), torch.zeros(1, 8, 4),
        mask=torch.zeros(3, 16, dtype=torch.long)))
    seen["scale"] = message(lambda: hp.context_parallel_attention(q, k, v, scale=float("nan")))
    seen["auto_tuned"] = message(lambda: hp.context_parallel_attention(
        q, k, v, algorithm="auto", schedule="async", ulysses_degree=7))
    seen["unshard_odd"] = message(lambda: hp.unshard_sequence(
        torch.zeros(1, 7), 1, load_balance=True))
    # After every mistake the group still works, and non-contiguous inputs are fine.
    qt = q.transpose(1, 2).contiguous().transpose(1, 2)  # same values, BNSD memory
    assert not qt.is_contiguous()
    a = hp.context_parallel_attention(q, k, v, causal=True)
    b = hp.context_parallel_attention(qt, k, v, causal=True)
    seen["non_contiguous_diff"] = (a - b).abs().max().item()
    return seen


EXPECTED = {
    "dtype": ["ValueError", "floating dtype"],
    "not_a_tensor": ["ValueError", "q must be a torch.Tensor"],
    "mixed_dtypes": ["ValueError", "share one dtype"],
    "three_dims": ["ValueError", "must be 4-d"],
    "head_dims_differ": ["ValueError", "q [1,8,4,8] and k [1,8,4,4] must share the per-head feature size"],
    "batch_differs": ["ValueError", "k [2,8,4,8] differ in dim 0"],
    "meta_device": ["ValueError", "gloo"],
    "algorithm": ["ValueError", "algorithm='ringo' is not valid; valid: ulysses"],
    "layout": ["ValueError", "layout='sbhd' is not valid"],
    "heads": ["ValueError", "heads"],
    "hybrid_degree": ["ValueError", "hybrid"],
    "odd_balanced": ["ValueError", "load"],
    "bool_mask": ["ValueError", "only document masks"],
    "group": ["ValueError", "expected a torch.distributed ProcessGroup, got str"],
    "shard_length": ["ValueError", "7"],
    "mask_rows": ["ValueError", "mask: document ids of shape [3, 16] do not fit a batch of 1"],
    "linear_mask_rows": ["ValueError", "do not fit a batch of 1"],
    "scale": ["ValueError", "scale=nan must be a finite number"],
    "auto_tuned": ["ValueError", "so ulysses_degree=7, schedule='async' would not run"],
    "unshard_odd": ["ValueError", "has 7 positions (odd)"],
}


def test_each_mistake_names_the_problem():
    results = run_ranks(2, mistakes)
    wrong = []
    for rank, seen in enumerate(results):
        for key, words in EXPECTED.items():
            if not all(w in seen[key] for w in words):
                wrong.append(f"rank {rank} {key}: expected {words} in: {seen[key]}")
            if "[sent 0 bytes]" not in seen[key]:
                wrong.append(f"rank {rank} {key}: refused after sending: {seen[key]}")
    assert not wrong, "\n".join(wrong)
    assert all(seen["non_contiguous_diff"] < 1e-6 for seen in results)


def test_no_process_group_is_a_clear_error():
    q, k, v = good()
    with pytest.raises(ValueError, match="torch.distributed is not initialized"):
        hp.context_parallel_attention(q, k, v)


def one_rank_mistakes(rank, p):
    q, k, v = good()
    return {
        "balanced_ulysses": message(lambda: hp.context_parallel_attention(
            q, k, v, causal=True, load_balance=True)),
        "repeat_all_gather": message(lambda: hp.context_parallel_attention(
            q, k, v, algorithm="all_gather", kv_head_policy="repeat")),
        "sync_head_groups": message(lambda: hp.context_parallel_attention(
            q, k, v, head_groups=2)),
        # Legal on any number of ranks: one rank runs the plain attention.
        "balanced_all_gather": message(lambda: hp.context_parallel_attention(
            q, k, v, algorithm="all_gather", causal=True, load_balance=True)),
        "auto_repeat": message(lambda: hp.context_parallel_attention(
            q, k, v, algorithm="auto", kv_head_policy="repeat")),
    }


def test_one_rank_refuses_what_every_group_size_would():
    """Code tried on one rank is refused there for the settings no group size allows, not only
    once it runs on more ranks."""
    seen = run_ranks(1, one_rank_mistakes)[0]
    assert "load_balance=true requires" in seen["balanced_ulysses"], seen
    assert "kv_head_policy=repeat applies to" in seen["repeat_all_gather"], seen
    assert "schedule=async" in seen["sync_head_groups"], seen
    assert seen["balanced_all_gather"] == "no error", seen
    assert seen["auto_repeat"] == "no error", seen


CYCLES = textwrap.dedent("""
    import gc, json, os, socket
    import torch, torch.distributed as dist
    import hyperparallel as hp

    def free_port():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    os.environ["MASTER_ADDR"] = "127.0.0.1"
    seen = []
    for i in range(4):
        os.environ["MASTER_PORT"] = str(free_port())
        dist.init_process_group("gloo", rank=0, world_size=1)
        hp.shard_sequence(torch.zeros(1, 8), 1)
        q = torch.randn(1, 8, 2, 4)
        hp.context_parallel_attention(q, q, q, causal=True)
        dist.destroy_process_group()
        gc.collect()
        seen.append([len(os.listdir("/proc/self/task")), len(os.listdir("/proc/self/fd"))])
    print(json.dumps(seen))
""")


def test_destroyed_groups_release_their_threads_and_sockets():
    # init, use, destroy, four times in one process: hyperparallel's caches held every group
    # (its gloo threads and sockets) forever; a destroyed group's entries now go at the next call.
    run = subprocess.run([sys.executable, "-c", CYCLES], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    assert all(c == seen[1] for c in seen[1:]), seen


def absent_peer(rank, p):
    import datetime
    import time
    group = torch.distributed.new_group(list(range(p)), timeout=datetime.timedelta(seconds=2))
    if rank == 1:
        time.sleep(6)  # never joins: rank 0's collective waits out the group's timeout
        return ""
    q, k, v = good()
    return message(lambda: hp.context_parallel_attention(q, k, v, group=group))


def test_a_timeout_names_the_torch_groups_own_timeout():
    # The message said 1800000 ms whatever timeout the torch group had.
    text = run_ranks(2, absent_peer)[0]
    assert "group timeout of 2000 ms" in text, text
