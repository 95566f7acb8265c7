"""The planner from Python (the summary; every fail-fast error a ValueError with the planner's
message, the same hp-train prints), shard/unshard_sequence (round trip and gradient),
LinearAttentionCP against the float64 token recurrence, and algorithm='auto' on a calibration."""

import json
import os
import subprocess

import pytest
import torch

import hyperparallel as hp
import reference
from hp_dist import run_ranks

HP_TRAIN = os.environ.get("HP_TRAIN_BINARY", "")


def test_plan_summary():
    p = hp.plan(8, tp=2, cp=2, dp_shard=2, algorithm="ulysses", heads=4, kv_heads=4,
                seq_len=256)
    assert p["mesh"] == {"dp_replicate": 1, "dp_shard": 2, "cp": 2, "tp": 2}
    assert "ulysses" in p["cp"]
    assert "mesh (" in p["summary"] and "hsdp" in p["summary"]
    assert any(kind == "attention" for kind in p["modules"].values())
    assert p["memory_per_rank_bytes"] > 0
    moe = hp.plan(4, arch="qwen3-moe", cp=2, dp_shard=2, ep=4, experts=8, seq_len=64)
    assert "ep=4" in moe["summary"], moe["summary"]
    assert moe["ep"] == 4 and moe["has_moe"]
    parts = hp.plan(2, cp=2, algorithm="ulysses", schedule="async", row_parts=2)
    assert "ulysses_row_parts=2" in parts["cp"], parts["cp"]
    ring = hp.plan(2, cp=2, algorithm="ring", ring_backward="queries")
    assert "ring_backward=queries" in ring["cp"], ring["cp"]


# (world size, options, the same layout as hp-train flags; None: hp-train refuses it earlier,
# in its own words, e.g. the product of the sizes against --nproc)
ILLEGAL = [
    (4, dict(cp=3), None),
    (2, dict(cp=2, algorithm="ulysses", heads=3, kv_heads=3, head_dim=16, hidden=48),
     ["--nproc", "2", "--cp", "2", "--cp-algo", "ulysses", "--heads", "3", "--kv-heads", "3",
      "--head-dim", "16", "--hidden", "48"]),
    (3, dict(cp=3, seq_len=512), ["--nproc", "3", "--cp", "3", "--seq-len", "512"]),
    (4, dict(arch="qwen3-moe", experts=6, ep=4, dp_shard=4),
     ["--nproc", "4", "--arch", "qwen3-moe", "--experts", "6", "--ep", "4", "--dp-shard", "4"]),
    (1, dict(arch="qwen3.5", layers=2), ["--arch", "qwen3.5", "--layers", "2"]),
    (1, dict(arch="kimi-linear", experts=0), ["--arch", "kimi-linear", "--experts", "0"]),
    (2, dict(cp=2, algorithm="ulysses", row_parts=2),
     ["--nproc", "2", "--cp", "2", "--cp-algo", "ulysses", "--ulysses-row-parts", "2"]),
    (2, dict(cp=2, algorithm="ring", ring_keep_blocks=True, ring_backward="queries"),
     ["--nproc", "2", "--cp", "2", "--cp-algo", "ring", "--ring-keep-blocks", "--ring-backward",
      "queries"]),
]


@pytest.mark.parametrize("world,options,flags", ILLEGAL)
def test_plan_errors_are_value_errors_with_the_planners_message(world, options, flags):
    with pytest.raises(ValueError) as info:
        hp.plan(world, **options)
    text = str(info.value)
    assert text
    if HP_TRAIN and flags:
        run = subprocess.run([HP_TRAIN, *flags, "--steps", "1"], capture_output=True, text=True,
                             timeout=120)
        assert run.returncode != 0
        assert text in run.stderr, (text, run.stderr)


def test_plan_refuses_unknown_options():
    with pytest.raises(ValueError, match="unknown option 'cpp'"):
        hp.plan(2, cpp=2)


def test_plan_refuses_what_would_not_run():
    # CP settings without CP, and sizes that size nothing, were planned silently.
    with pytest.raises(ValueError, match="plan: algorithm, schedule configure context "
                                         "parallelism, but cp is 1 .no CP runs.; drop them"):
        hp.plan(1, algorithm="ring", schedule="async")
    for key in ("seq_len", "batch"):
        with pytest.raises(ValueError, match=f"plan: {key}=0 must be >= 1"):
            hp.plan(2, cp=2, **{key: 0})


def shard_round_trip(rank, p):
    x = torch.arange(2 * 16 * 3, dtype=torch.float64).view(2, 16, 3)
    out = {}
    for lb in (False, True):
        mine = hp.shard_sequence(x, 1, load_balance=lb).requires_grad_(True)
        full = hp.unshard_sequence(mine, 1, load_balance=lb)
        out[lb] = bool(torch.equal(full.detach(), x))
        (full * (rank + 1)).sum().backward()
        # d/d(shard) of sum_r (r+1) * sum(full): every rank's weight, summed.
        out[f"grad{lb}"] = bool(torch.equal(mine.grad, torch.full_like(mine, p * (p + 1) / 2)))
    return out


def test_shard_and_unshard_round_trip_with_gradients():
    for res in run_ranks(2, shard_round_trip):
        assert all(res.values()), res


def linear_case(rank, p, packed=False):
    results = {}
    for kind in ("gdn", "kda"):
        g = torch.Generator().manual_seed(5)
        b, t, h, hv, kd, vd = 1, 16, 2, 4, 4, 4
        q = torch.randn(b, t, h, kd, generator=g, dtype=torch.float64)
        k = torch.nn.functional.normalize(torch.randn(b, t, h, kd, generator=g,
                                                      dtype=torch.float64), dim=-1)
        v = torch.randn(b, t, hv, vd, generator=g, dtype=torch.float64)
        gshape = (b, t, hv) if kind == "gdn" else (b, t, hv, kd)
        gate = -torch.rand(*gshape, generator=g, dtype=torch.float64)
        beta = torch.rand(b, t, hv, generator=g, dtype=torch.float64)
        h0 = torch.randn(b, hv, kd, vd, generator=g, dtype=torch.float64)
        dout = torch.randn(b, t, hv, vd, generator=g, dtype=torch.float64)
        leaves = [x.clone().requires_grad_(True) for x in (q, k, v, gate, beta, h0)]
        # Packed: documents [0, 3) [3, 11) [11, 16), the middle one across the rank boundary.
        cu = [0, 3, 11, 16] if packed else None
        resets = None
        if packed:
            resets = torch.zeros(b, t, dtype=torch.bool)
            resets[:, [3, 11]] = True
        ref, ref_final = reference.delta_rule(*leaves[:5], initial_state=leaves[5],
                                              resets=resets)
        ref.backward(dout)
        for mode in ("state_passing", "ulysses"):
            mixer = hp.LinearAttentionCP(kind, mode)
            shards = [hp.shard_sequence(x, 1).detach().requires_grad_(True)
                      for x in (q, k, v, gate, beta)]
            state = h0.clone().requires_grad_(True)
            out, final = mixer(*shards, initial_state=state, output_final_state=True, mask=cu)
            out.backward(hp.shard_sequence(dout, 1))
            errs = [(out - hp.shard_sequence(ref.detach(), 1)).abs().max().item(),
                    (final - ref_final.detach()).abs().max().item()]
            for s, leaf in zip(shards, leaves[:5]):
                errs.append((s.grad - hp.shard_sequence(leaf.grad, 1)).abs().max().item())
            # The initial state's gradient: each rank holds its part; their sum is the whole.
            total = (state.grad if state.grad is not None
                     else torch.zeros_like(state)).clone()
            torch.distributed.all_reduce(total)
            errs.append((total - leaves[5].grad).abs().max().item())
            results[(kind, mode)] = max(errs)
    return results


def test_linear_attention_cp_equals_the_token_recurrence():
    for res in run_ranks(2, linear_case):
        assert len(res) == 4
        for key, err in res.items():
            assert err < 1e-9, (key, err)


def test_linear_attention_cp_takes_packed_documents():
    for res in run_ranks(2, linear_case, True):
        assert len(res) == 4
        for key, err in res.items():
            assert err < 1e-9, (key, err)


def auto_case(rank, p, calibration, heads=4, seed=1, kv_heads=None, kv_head_policy="error"):
    """algorithm='auto' on a causal float64 layer: (max error against the reference, the
    choice: algorithm, degree, schedule, ring_keep_blocks, description, K/V head policy)."""
    os.environ["HP_CALIBRATION"] = calibration
    g = torch.Generator().manual_seed(seed)
    kv_heads = heads if kv_heads is None else kv_heads
    q = torch.randn(1, 16, heads, 8, generator=g, dtype=torch.float64)
    k, v = (torch.randn(1, 16, kv_heads, 8, generator=g, dtype=torch.float64) for _ in range(2))
    shards = [hp.shard_sequence(t, 1) for t in (q, k, v)]
    out = hp.context_parallel_attention(*shards, algorithm="auto", causal=True,
                                        kv_head_policy=kv_head_policy)
    want = hp.shard_sequence(reference.attention(q, k, v, causal=True), 1)
    choice = [c for key, c in hp._auto.items() if key[3] == heads and key[4] == kv_heads]
    return (out - want).abs().max().item(), choice[0]


def write_calibration(tmp_path, fits, **extra):
    """A calibration file for 2 ranks with fits[kind] for each collective kind (and any other
    calibration field given by name)."""
    calibration = {
        "link": "loopback", "cores": 2, "attention_gflops": 10.0, "matmul_gflops": 50.0,
        "collectives": {kind: {"2": fit} for kind, fit in fits.items()},
        **extra,
    }
    path = tmp_path / "calibration.json"
    path.write_text(json.dumps(calibration))
    return str(path)


def test_auto_uses_the_calibration(tmp_path):
    fit = {"latency_s": 1e-4, "seconds_per_byte": 1e-9}
    path = write_calibration(tmp_path, {kind: fit for kind in
                                        ("all_gather", "reduce_scatter", "all_to_all",
                                         "all_reduce")})
    for err, _ in run_ranks(2, auto_case, path):
        assert err < 1e-10


def test_auto_ranks_the_kept_ring(tmp_path):
    # 3 heads on 2 ranks: no Ulysses; the ring's shifts cost far less than the gathers.
    slow = {"latency_s": 1e-4, "seconds_per_byte": 1e-6}
    fast = {"latency_s": 1e-4, "seconds_per_byte": 1e-8}
    path = write_calibration(tmp_path, {"all_gather": slow, "reduce_scatter": slow,
                                        "all_to_all": fast, "all_reduce": slow})
    for err, choice in run_ranks(2, auto_case, path, 3, 2):
        _, _, _, keep, described, policy = choice
        assert err < 1e-10
        assert keep, described
        assert "ring(kept)" in described, described
        assert policy == "error", described


def test_auto_takes_the_repeat_policy(tmp_path):
    # One K/V head on 2 ranks: Ulysses is a candidate only with kv_head_policy='repeat'. The
    # gathers cost far more than the all-to-alls and the ring's attention is made 100x dearer,
    # so the repeating Ulysses must rank first and run with the policy (without the policy it
    # would be refused by the strategy); with the default policy auto must not choose it.
    # (The layer is tiny, so the all-to-alls' latency is made small too: Ulysses runs more
    # collectives than the ring's one shift.)
    slow = {"latency_s": 1e-4, "seconds_per_byte": 1e-6}
    fast = {"latency_s": 1e-6, "seconds_per_byte": 1e-9}
    path = write_calibration(tmp_path, {"all_gather": slow, "reduce_scatter": slow,
                                        "all_to_all": fast, "all_reduce": slow},
                             ring_attention_factor=100.0)
    for err, choice in run_ranks(2, auto_case, path, 4, 3, 1, "repeat"):
        algorithm, _, _, _, described, policy = choice
        assert err < 1e-10
        assert algorithm == "ulysses", described
        assert policy == "repeat", described
    for err, choice in run_ranks(2, auto_case, path, 4, 3, 1):
        algorithm, _, _, _, described, policy = choice
        assert err < 1e-10
        assert algorithm != "ulysses", described
        assert policy == "error", described


def auto_on_one_rank(rank, p):
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(1, 16, 4, 8, generator=g, dtype=torch.float64) for _ in range(3))
    os.environ["HP_CALIBRATION"] = "/nonexistent/calibration.json"  # not needed on one rank
    out = hp.context_parallel_attention(q, k, v, algorithm="auto", causal=True)
    return (out - reference.attention(q, k, v, causal=True)).abs().max().item()


def test_auto_on_one_rank_is_plain_attention():
    # As every algorithm on a group of one: no cost model, no calibration, the reference.
    for err in run_ranks(1, auto_on_one_rank):
        assert err < 1e-10


def test_plan_auto_refuses_the_settings_it_chooses():
    with pytest.raises(ValueError, match="so ulysses_degree, schedule would not run; drop them"):
        hp.plan(4, cp=4, algorithm="auto", ulysses_degree=2, schedule="async")
    for key, value in (("load_balance", "yes"), ("ulysses_degree", "2"), ("head_groups", 2.5),
                       ("arch", 3)):
        with pytest.raises(ValueError, match=f"option '{key}' has the wrong type"):
            hp.plan(2, cp=2, **{key: value})


def missing_calibration(rank, p, path):
    os.environ["HP_CALIBRATION"] = path
    q = torch.randn(1, 8, 4, 8)
    try:
        hp.context_parallel_attention(q, q, q, algorithm="auto")
    except ValueError as e:
        return str(e)
    return "no error"


def test_auto_without_a_calibration_names_the_command(tmp_path):
    for text in run_ranks(2, missing_calibration, str(tmp_path / "none.json")):
        assert "hp-bench calibrate" in text, text
