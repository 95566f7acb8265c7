"""context_parallel_attention from Python on 2 and 4 gloo ranks: outputs and gradients of q, k
and v equal a float64 single-process attention for every algorithm, causal and not, BSHD and
BNSD, sync and async, with head-tail balance where the algorithm has it, packed documents, GQA;
and a DeepSpeed-style Ulysses in plain PyTorch (the peer of bench/python/peer_bench.py) gives
the same numbers (drop-in)."""

import os
import sys

import pytest
import torch
import torch.distributed as dist

import hyperparallel as hp
import reference
from hp_dist import run_ranks

# The peer of bench/python/peer_bench.py (DeepSpeed-Ulysses' pattern in plain PyTorch): tested
# here as a drop-in, so the peer table compares layers that compute the same numbers.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench",
                                "python"))
from peer_bench import deepspeed_ulysses  # noqa: E402

B, S, HQ, HKV, D = 2, 32, 4, 4, 8


def make_inputs(seed, b=B, s=S, hq=HQ, hkv=HKV, d=D):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(b, s, hq, d, generator=g, dtype=torch.float64)
    k = torch.randn(b, s, hkv, d, generator=g, dtype=torch.float64)
    v = torch.randn(b, s, hkv, d, generator=g, dtype=torch.float64)
    dout = torch.randn(b, s, hq, d, generator=g, dtype=torch.float64)
    return q, k, v, dout


def cases(p):
    algorithms = ["ulysses", "all_gather", "ring"] + (["hybrid", "usp"] if p == 4 else [])
    balanced = {"all_gather", "hybrid", "ring", "usp"}
    for algorithm in algorithms:
        for causal in (False, True):
            for layout in ("bshd", "bnsd"):
                for schedule in ("sync", "async"):
                    yield dict(algorithm=algorithm, causal=causal, layout=layout,
                               schedule=schedule, load_balance=False)
        if algorithm in balanced:
            for schedule in ("sync", "async"):
                yield dict(algorithm=algorithm, causal=True, layout="bshd", schedule=schedule,
                           load_balance=True)
        if algorithm in ("ring", "usp"):  # forward keeps the blocks, backward sends accumulators
            yield dict(algorithm=algorithm, causal=True, layout="bnsd", schedule="async",
                       load_balance=True, ring_keep_blocks=True)
            # multi-head here: auto sends the queries in backward; the blocks on request
            yield dict(algorithm=algorithm, causal=True, layout="bshd", schedule="sync",
                       load_balance=True, ring_backward="blocks")
        if algorithm == "ulysses":  # the last head group's output in 3 row parts
            for causal in (False, True):
                yield dict(algorithm=algorithm, causal=causal, layout="bshd", schedule="async",
                           load_balance=False, row_parts=3)


def run_case(rank, p, case, seed, hkv=HKV, mask=None, dtype=torch.float64):
    """This rank's errors against the reference for one case (max abs over out, dq, dk, dv)."""
    q, k, v, dout = make_inputs(seed, hkv=hkv)
    doc_ids = None
    if mask is not None:
        doc_ids = reference_doc_ids(mask)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref = reference.attention(*leaves, causal=case["causal"], doc_ids=doc_ids)
    ref.backward(dout)
    lb = case["load_balance"]
    bnsd = case["layout"] == "bnsd"

    def to_layout(t):
        return t.transpose(1, 2) if bnsd else t

    seq_dim = 2 if bnsd else 1
    shards = [hp.shard_sequence(to_layout(t), seq_dim, load_balance=lb).to(dtype).detach()
              .requires_grad_(True) for t in (q, k, v)]
    algorithm = case["algorithm"]
    degree = 2 if algorithm in ("hybrid", "usp") else None
    out = hp.context_parallel_attention(*shards, ulysses_degree=degree, mask=mask, **case)
    out.backward(hp.shard_sequence(to_layout(dout), seq_dim, load_balance=lb).to(dtype))
    errors = {}
    for name, got, want in (("out", out, ref), ("dq", shards[0].grad, leaves[0].grad),
                            ("dk", shards[1].grad, leaves[1].grad),
                            ("dv", shards[2].grad, leaves[2].grad)):
        want = hp.shard_sequence(to_layout(want.detach()), seq_dim, load_balance=lb)
        errors[name] = (got.detach().double() - want).abs().max().item()
    return errors


def reference_doc_ids(cu_seqlens):
    ids = torch.zeros(1, S, dtype=torch.long)
    for i in range(len(cu_seqlens) - 1):
        ids[:, cu_seqlens[i]:cu_seqlens[i + 1]] = i
    return ids


def sweep(rank, p):
    results = []
    for i, case in enumerate(cases(p)):
        results.append((case, run_case(rank, p, case, seed=i)))
    return results


def check(results, tol):
    bad = []
    for rank_results in results:
        for case, errors in rank_results:
            worst = max(errors.values())
            if not worst < case.get("tol", tol):
                bad.append(f"{case}: {errors}")
    assert not bad, "cases off the reference:\n" + "\n".join(bad)


@pytest.mark.parametrize("p", [2, 4])
def test_every_algorithm_equals_the_float64_reference(p):
    results = run_ranks(p, sweep)
    assert len(results[0]) >= (12 if p == 2 else 24)
    check(results, 1e-10)


def special_cases(rank, p):
    out = []
    # GQA: 4 query heads over 2 K/V heads.
    for algorithm in ("all_gather", "ulysses", "ring"):
        case = dict(algorithm=algorithm, causal=True, layout="bshd", schedule="sync",
                    load_balance=False)
        out.append((dict(case, hkv=2), run_case(rank, p, case, seed=100, hkv=2)))
    # Packed documents (boundaries inside and across shards), every algorithm at P=2.
    for algorithm in ("all_gather", "ulysses", "ring"):
        case = dict(algorithm=algorithm, causal=True, layout="bshd", schedule="async",
                    load_balance=False)
        out.append((dict(case, mask="cu"), run_case(rank, p, case, seed=101,
                                                    mask=[0, 5, 19, 20, 32])))
    # float32 against the float64 reference.
    case = dict(algorithm="ulysses", causal=True, layout="bshd", schedule="sync",
                load_balance=False)
    out.append((dict(case, dtype="float32", tol=1e-5),
                run_case(rank, p, case, seed=102, dtype=torch.float32)))
    return out


def test_gqa_documents_and_float32():
    check(run_ranks(2, special_cases), 1e-10)


def drop_in(rank, p):
    q, k, v, dout = make_inputs(7)
    errs = {}
    grads = []
    for fn in ("deepspeed", "hyperparallel"):
        shards = [hp.shard_sequence(t, 1).detach().requires_grad_(True) for t in (q, k, v)]
        if fn == "deepspeed":
            out = deepspeed_ulysses(*shards, causal=True)
        else:
            out = hp.context_parallel_attention(*shards, algorithm="ulysses", causal=True)
        out.backward(hp.shard_sequence(dout, 1))
        grads.append([out.detach()] + [s.grad for s in shards])
    for name, a, b in zip(("out", "dq", "dk", "dv"), *grads):
        errs[name] = (a - b).abs().max().item()
    return errs


@pytest.mark.parametrize("p", [2, 4])
def test_deepspeed_style_ulysses_gives_the_same_numbers(p):
    for errs in run_ranks(p, drop_in):
        assert max(errs.values()) < 1e-12, errs


def counted_bytes(rank, p):
    q, k, v, _ = make_inputs(3)
    shards = [hp.shard_sequence(t, 1) for t in (q, k, v)]
    hp.reset_counters()
    hp.context_parallel_attention(*shards, algorithm="all_gather")
    return hp.bytes_sent()


def test_bytes_are_counted_on_the_torch_group():
    # all_gather forward, no grad: K and V of this rank to each other rank.
    per_rank = run_ranks(2, counted_bytes)
    shard = B * (S // 2) * HKV * D * 8
    assert per_rank == [2 * shard, 2 * shard]


def on_a_sub_group(rank, p):
    """World of 4; the CP group is global ranks {1, 3} (group rank != global rank); ranks 0 and 2
    only take part in new_group, as torch.distributed requires."""
    group = dist.new_group([1, 3])
    if rank not in (1, 3):
        return None
    q, k, v, dout = make_inputs(11)
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref = reference.attention(*leaves, causal=True)
    ref.backward(dout)
    errors = {}
    for algorithm in ("ulysses", "all_gather", "ring"):
        shards = [hp.shard_sequence(t, 1, group=group, load_balance=algorithm != "ulysses")
                  .detach().requires_grad_(True) for t in (q, k, v)]
        out = hp.context_parallel_attention(*shards, group=group, algorithm=algorithm,
                                            causal=True,
                                            load_balance=algorithm != "ulysses")
        lb = algorithm != "ulysses"
        out.backward(hp.shard_sequence(dout, 1, group=group, load_balance=lb))
        full = hp.unshard_sequence(out.detach(), 1, group=group, load_balance=lb)
        errors[algorithm] = max((full - ref.detach()).abs().max().item(),
                                (shards[0].grad - hp.shard_sequence(
                                    leaves[0].grad, 1, group=group, load_balance=lb))
                                .abs().max().item())
    return errors


def test_a_sub_group_of_the_world():
    results = run_ranks(4, on_a_sub_group)
    assert results[0] is None and results[2] is None
    for errors in (results[1], results[3]):
        assert len(errors) == 3 and max(errors.values()) < 1e-10, errors
