"""use_caching_host_allocator: CPU tensors reuse freed blocks, what stays resident stays under
1.25x the peak of live bytes, and CP attention computes the same result through it."""

import torch

import hyperparallel as hp
from hp_dist import run_ranks


def test_freed_blocks_are_reused_and_the_footprint_stays_near_the_peak():
    assert hp.host_cache_stats() is None  # nothing installed before the call
    hp.use_caching_host_allocator()
    hp.use_caching_host_allocator()  # once per process; a second call changes nothing
    a = torch.ones(1024, 1024)  # 4 MiB
    first = a.data_ptr()
    del a
    before = hp.host_cache_stats()
    b = torch.zeros(1024, 1024)
    after = hp.host_cache_stats()
    assert b.data_ptr() == first
    assert after["hits"] == before["hits"] + 1
    assert float(b.sum()) == 0.0
    for n in (1, 3, 2, 5, 4, 1, 5):
        x = torch.empty(n * 1024 * 1024)
        s = hp.host_cache_stats()
        assert s["live_bytes"] + s["cached_bytes"] <= 1.25 * s["budget_bytes"]
        assert s["live_bytes"] + s["cached_bytes"] <= s["arena_bytes"]
        del x
    hp.release_host_cache()
    assert hp.host_cache_stats()["cached_bytes"] == 0


def same_output(rank, p):
    g = torch.Generator().manual_seed(1)
    q, k, v = [torch.randn(1, 2048, 8, 64, generator=g) for _ in range(3)]  # 4 MiB each
    ref = hp.context_parallel_attention(q, k, v, algorithm="all_gather", causal=True)
    hp.use_caching_host_allocator()
    outs = [hp.context_parallel_attention(q, k, v, algorithm="all_gather", causal=True)
            for _ in range(3)]
    return all(torch.equal(o, ref) for o in outs) and hp.host_cache_stats()["hits"] > 0


def test_cp_attention_computes_the_same_through_the_cache():
    assert all(run_ranks(2, same_output))
