"""hyperparallel from PyTorch: context-parallel attention, linear-attention mixers and the planner.

Every function takes a ``torch.distributed`` process group (``None``: the default group) and
uses its C++ object directly: no second rendezvous, the same gloo (or nccl) connections.
Tensors are this rank's shard of the sequence (``shard_sequence``); results are this rank's
shard; autograd flows through every collective, so ``loss.backward()`` on any rank's output
gives the gradients of q, k and v the single-process attention would give (the loss being the
sum of the ranks' losses).

    import hyperparallel as hp
    out = hp.context_parallel_attention(q, k, v, group=cp_group, algorithm="ulysses",
                                        causal=True, layout="bshd")

Bad inputs and configurations raise ``ValueError`` with the library's message (what was wrong
and what to change) before anything is communicated. Build: ``scripts/build.sh``; then put
``build/python`` on ``PYTHONPATH``.
"""

import math

import torch
import torch.distributed as dist

from . import _C

__all__ = [
    "ALGORITHMS",
    "ContextParallelAttention",
    "LinearAttentionCP",
    "bytes_sent",
    "context_parallel_attention",
    "host_cache_stats",
    "plan",
    "release_host_cache",
    "reset_counters",
    "shard_sequence",
    "unshard_sequence",
    "use_caching_host_allocator",
]

ALGORITHMS = ("ulysses", "all_gather", "hybrid", "ring", "usp", "auto")
LAYOUTS = ("bshd", "bnsd")

# Per process: torch group -> its hyperparallel group (built once; the topologies of its CP
# configurations live in it), and the attention modules installed per configuration. Kept while
# torch.distributed knows the group: a destroyed group's entries (and the sub-groups, threads and
# sockets they hold) go at the next call.
_groups = {}
_attention = {}
_auto = {}


def _torch_groups():
    """The process groups torch.distributed has not destroyed (None: not knowable here)."""
    c10d = dist.distributed_c10d
    world = getattr(c10d, "_world", None)  # torch 2.x
    pg_map = getattr(world, "pg_map", None) if world is not None else None
    if pg_map is None:
        pg_map = getattr(c10d, "_pg_map", None)  # torch 1.x
    return pg_map


def _timeout_seconds(group):
    """The torch group's own timeout (what its collectives wait), for hyperparallel's messages."""
    timeout = getattr(getattr(group, "options", None), "_timeout", None)
    if timeout is None:
        timeout = getattr(dist, "default_pg_timeout", None)
    return timeout.total_seconds() if timeout is not None else 1800.0


def _drop_destroyed_groups():
    live = _torch_groups()
    if live is None:
        return
    for group in [g for g in _groups if g not in live]:
        wrapped = _groups.pop(group)
        for cache in (_attention, _auto):
            for key in [key for key in cache if key[0] is wrapped]:
                del cache[key]


def _group(group):
    """The hyperparallel group over ``group`` (None: the default group)."""
    if group is None:
        if not dist.is_available() or not dist.is_initialized():
            raise ValueError(
                "group: torch.distributed is not initialized; call "
                "torch.distributed.init_process_group(...) first or pass a group")
        group = dist.distributed_c10d._get_default_group()
    if group is dist.GroupMember.NON_GROUP_MEMBER:
        raise ValueError("group: this process is not a member of the group; call hyperparallel "
                         "only on the ranks of the group you pass")
    if not isinstance(group, dist.ProcessGroup):
        raise ValueError(
            f"group: expected a torch.distributed ProcessGroup, got {type(group).__name__}; "
            "pass a group from torch.distributed.new_group or None for the default group")
    wrapped = _groups.get(group)
    if wrapped is None:
        global_rank = getattr(dist, "get_global_rank", None) or \
            dist.distributed_c10d._get_global_rank  # public from torch 2.0
        ranks = [global_rank(group, i) for i in range(group.size())]  # in group-rank order
        _drop_destroyed_groups()
        wrapped = _C.Group(group, ranks, dist.get_rank(), timeout_s=_timeout_seconds(group))
        _groups[group] = wrapped
    return wrapped


def _check_tensor(name, t):
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")


def _check_scale(scale):
    if scale is not None and not (math.isfinite(float(scale)) and float(scale) > 0):
        raise ValueError(f"scale={scale!r} must be a finite number > 0 (None: 1/sqrt(D))")


def _choice(name, value, valid):
    if value not in valid:
        raise ValueError(f"{name}={value!r} is not valid; valid: {', '.join(valid)}")


def _document_ids(mask, q, layout, group_size):
    """``mask`` as the document ids of the whole (global) sequence, or None."""
    if mask is None:
        return None
    seq_local = q.size(1 if layout == "bshd" else 2)
    total = seq_local * group_size
    if isinstance(mask, torch.Tensor):
        if mask.dtype in (torch.bool,) or mask.is_floating_point():
            raise ValueError(
                "mask: only document masks are supported under context parallelism: pass the "
                "document id of every token of the whole sequence (an integer tensor [S] or "
                "[B, S]) or the cumulative document lengths (cu_seqlens, a list of ints); "
                f"got a {mask.dtype} tensor")
        ids = mask if mask.dim() == 2 else mask.reshape(1, -1)
        if mask.dim() > 2 or ids.size(0) not in (1, q.size(0)):
            raise ValueError(
                f"mask: document ids of shape {list(mask.shape)} do not fit a batch of "
                f"{q.size(0)}; pass [S] (every row alike) or [{q.size(0)}, S] ids of the whole "
                "sequence")
        if ids.size(-1) != total:
            raise ValueError(
                f"mask: document ids cover {ids.size(-1)} tokens but the whole sequence has "
                f"{total} ({seq_local} per rank x {group_size} ranks)")
        return ids.to(torch.long)
    try:
        cu = [int(x) for x in mask]
    except TypeError:
        raise ValueError(
            "mask: expected document ids (an integer tensor) or cu_seqlens (a list of ints), "
            f"got {type(mask).__name__}") from None
    return _C.document_ids(cu, total)


def context_parallel_attention(q, k, v, *, group=None, algorithm="ulysses", ulysses_degree=None,
                               causal=False, layout="bshd", load_balance=False, schedule="sync",
                               scale=None, mask=None, kv_head_policy="error", head_groups=0,
                               primitive="blockwise", ring_keep_blocks=False, row_parts=0,
                               ring_backward="auto"):
    """Attention of this rank's queries over the whole sequence held by ``group``'s ranks.

    q [B, S/P, Hq, D], k and v [B, S/P, Hkv, D] (``layout='bshd'``; ``'bnsd'``: heads before
    the sequence), each rank holding its shard in rank order, or in the head-tail order of
    ``shard_sequence(..., load_balance=True)`` when ``load_balance``. Returns this rank's shard of
    the output, differentiable in q, k and v.

    algorithm: ulysses | all_gather | hybrid | ring | usp | auto (the cost model's fastest for
    these sizes; needs a calibration, ``hp-bench calibrate``). ulysses_degree: hybrid's and usp's
    Ulysses sub-group size U (1 < U < P). schedule: sync | async. scale: default 1/sqrt(D).
    mask: None, or packed documents: the document id of every token of the global sequence
    ([S] or [B, S] integers) or cu_seqlens ([0, L1, L1+L2, ..., S]); attention never crosses a
    document. kv_head_policy: error | repeat (K/V heads fewer than the Ulysses degree;
    ``algorithm='auto'`` then weighs the Ulysses strategies too, and uses the policy only where
    its choice repeats).
    head_groups: async ulysses, hybrid or usp, this rank's heads in that many groups whose output
    all-to-alls fly while the next group is attended (ulysses and hybrid: their Q/K/V
    all-to-alls too, and hybrid's co-group K/V gathers; usp: its Q/K/V pieces and a ring per
    group); async all_gather, K/V gathered in that many head groups, each group's remote keys
    attended while the later groups' travel (0: automatic; usp's automatic count is 2, or 1
    where 2 does not divide the heads or a rank holds fewer than 4096 tokens).
    ring_keep_blocks: ring or usp, forward keeps the K/V blocks that arrived so backward sends
    only the dK/dV accumulators (all_gather's bytes and memory with the ring's overlap).
    ``algorithm='auto'`` weighs it with the rest and sets it when the kept ring ranks first.
    row_parts: async ulysses, the last head group's output all-to-all in that many row parts,
    each sent while the next is attended (0: automatic, 2 where each part keeps 2048 of the
    rank's rows; 1: whole).
    ring_backward: ring or usp, what the backward passes around the ring: 'blocks' (the K/V
    blocks again with their dK/dV accumulators), 'queries' ([q | dout] and the softmax
    statistics with their dQ accumulators; dK/dV stay home) or 'auto' (whichever sends fewer
    bytes: the queries for multi-head attention, the blocks for GQA).
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t)
    _choice("algorithm", algorithm, ALGORITHMS)
    _choice("layout", layout, LAYOUTS)
    _choice("schedule", schedule, ("sync", "async"))
    _check_scale(scale)
    if algorithm == "auto":
        # auto chooses these itself and runs each strategy's defaults for the rest.
        given = [f"{name}={value!r}" for name, value, default in (
            ("ulysses_degree", ulysses_degree, None), ("schedule", schedule, "sync"),
            ("ring_keep_blocks", ring_keep_blocks, False), ("head_groups", head_groups, 0),
            ("row_parts", row_parts, 0), ("ring_backward", ring_backward, "auto"))
            if value != default]
        if given:
            raise ValueError(
                "algorithm='auto' chooses the strategy, its schedule, its Ulysses degree and "
                f"ring_keep_blocks, with each strategy's defaults, so {', '.join(given)} would "
                "not run; drop them or name the algorithm")
    g = _group(group)
    docs = _document_ids(mask, q, layout, g.size)
    if algorithm == "auto" and g.size == 1:
        # One rank: plain attention, as every algorithm there; auto would repeat K/V heads only
        # where its choice needs it, and all_gather never does.
        algorithm, kv_head_policy = "all_gather", "error"
    if algorithm == "auto":
        if q.dim() != 4 or k.dim() != 4:
            raise ValueError(f"q and k must be 4-d ({layout}); got {q.dim()} and {k.dim()} dims")
        seq_dim, head_dim = (1, 2) if layout == "bshd" else (2, 1)
        key = (g, q.size(0), q.size(seq_dim), q.size(head_dim), k.size(head_dim), q.size(3),
               causal, load_balance, primitive, kv_head_policy)
        if key not in _auto:
            _auto[key] = _C.auto_config(g, q.size(seq_dim) * g.size, q.size(head_dim),
                                        k.size(head_dim), q.size(3), q.size(0), causal,
                                        load_balance, primitive, kv_head_policy)
        algorithm, ulysses_degree, schedule, ring_keep_blocks, _, kv_head_policy = _auto[key]
    args = (algorithm, ulysses_degree, bool(causal), layout, bool(load_balance), schedule,
            None if scale is None else float(scale), kv_head_policy, int(head_groups), primitive,
            bool(ring_keep_blocks), int(row_parts), ring_backward)
    key = (g,) + args
    attn = _attention.get(key)
    if attn is None:  # installed once per configuration (it must outlive its backward)
        attn = _C.CPAttention(g, *args)
        _attention[key] = attn
    return attn(q, k, v, docs)


class ContextParallelAttention(torch.nn.Module):
    """``context_parallel_attention`` as a module (the place DeepSpeed's DistributedAttention or
    yunchang's LongContextAttention takes in a model): forward(q, k, v) -> out."""

    def __init__(self, group=None, **options):
        super().__init__()
        self.group = group
        self.options = options

    def forward(self, q, k, v, mask=None):
        return context_parallel_attention(q, k, v, group=self.group, mask=mask, **self.options)


class LinearAttentionCP(torch.nn.Module):
    """A linear-attention mixer (kind gdn: Gated DeltaNet, kda: Kimi Delta Attention) under
    context parallelism. mode: state_passing (each rank keeps its shard; the initial states
    travel, state_exchange all_gather | p2p) or ulysses (heads all-to-all; heads % P == 0).

    forward(q, k, v, g, beta, initial_state=None, output_final_state=False, mask=None) -> (out,
    final_state or None) on this rank's contiguous shard, BSHD: q, k [B, T/P, H, K];
    v [B, T/P, HV, V]; g [B, T/P, HV] (gdn) or [B, T/P, HV, K] (kda); beta [B, T/P, HV];
    initial_state [B, HV, K, V] (the same tensor on every rank). mask: None, or packed
    documents as for context_parallel_attention (document ids of the whole sequence, [S] or
    [B, S], or cu_seqlens): the state restarts at every document, and the initial state reaches
    only the first. Outputs and every gradient equal the single-process kernel on the whole
    sequence.
    """

    def __init__(self, kind="gdn", mode="state_passing", *, group=None,
                 state_exchange="all_gather", kernel="chunked", scale=None, chunk_size=64):
        super().__init__()
        _choice("kind", kind, ("gdn", "kda"))
        _choice("mode", mode, ("state_passing", "ulysses"))
        _choice("state_exchange", state_exchange, ("all_gather", "p2p"))
        _choice("kernel", kernel, ("chunked", "recurrent"))
        _check_scale(scale)
        self.kind, self.mode, self.group = kind, mode, group
        self.state_exchange, self.kernel = state_exchange, kernel
        self.scale, self.chunk_size = scale, int(chunk_size)

    def forward(self, q, k, v, g, beta, initial_state=None, output_final_state=False,
                mask=None):
        for name, t in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta)):
            _check_tensor(name, t)
        if initial_state is not None:
            _check_tensor("initial_state", initial_state)
        group = _group(self.group)
        docs = _document_ids(mask, q, "bshd", group.size)
        return _C.linear_attention_cp(
            group, self.kind, self.mode, self.state_exchange, self.kernel, q, k, v,
            g, beta, initial_state, bool(output_final_state),
            None if self.scale is None else float(self.scale), self.chunk_size, docs)


def shard_sequence(x, dim, group=None, load_balance=False):
    """This rank's part of the full sequence ``x`` along ``dim``: the contiguous slice r of P,
    or with ``load_balance`` the head-tail chunks {r, 2P-1-r} of 2P (equal causal work)."""
    _check_tensor("x", x)
    return _C.shard_sequence(x, int(dim), _group(group), bool(load_balance))


def unshard_sequence(x, dim, group=None, load_balance=False):
    """Every rank's shard gathered back into the full sequence in natural order (differentiable:
    its backward hands each rank the gradient of its shard, summed over the ranks)."""
    _check_tensor("x", x)
    g = _group(group)
    if load_balance and x.dim() > 0 and x.size(int(dim)) % 2 != 0:
        raise ValueError(
            f"x: a head-tail shard holds two equal chunks, but dim {dim} has {x.size(int(dim))} "
            "positions (odd); pass the shard shard_sequence(..., load_balance=True) returned")
    return _C.unshard_sequence(x, int(dim), g, bool(load_balance))


def bytes_sent(group=None):
    """Bytes this process handed the transport for other ranks over ``group`` (and the CP
    sub-groups built on it) since the last ``reset_counters``."""
    return _group(group).bytes_sent()


def reset_counters(group=None):
    _group(group).reset_counters()


def use_caching_host_allocator():
    """From now on this process's CPU tensors come from hyperparallel's cache of freed blocks
    (what hp-train and hp-bench use): blocks of 1 MiB or more come from one arena whose freed
    ranges keep their pages and are handed out again (best fit, split and merged), instead of
    being unmapped and faulted in again on the next step. Live plus cached bytes stay under
    1.25x the largest live total so far. Tensors made before keep their own allocator. Once per
    process; cannot be undone (``release_host_cache`` gives the free pages back)."""
    _C.use_caching_host_allocator()


def host_cache_stats():
    """The cache's counters (live_bytes, cached_bytes, arena_bytes, budget_bytes, system_bytes,
    hits, misses, evictions), or None before ``use_caching_host_allocator``."""
    return _C.host_cache_stats()


def release_host_cache():
    """Gives the pages of every free range of the cache back to the system (no-op without the
    cache)."""
    _C.release_host_cache()


def plan(world_size, **options):
    """Plans a Qwen3-family layout over ``world_size`` ranks and runs every check the planner
    runs before a collective. Options: arch (qwen3 | qwen3-moe | qwen3.5 | kimi-linear), tp, cp,
    dp_shard, dp_replicate, ep, seq_len, batch, the model sizes (layers, hidden, heads, kv_heads,
    head_dim, ffn, vocab, experts, top_k, layer_pattern, mixer, value_heads), the CP choice
    (algorithm, ulysses_degree, schedule, load_balance, kv_head_policy, head_groups,
    ring_keep_blocks, row_parts, ring_backward) and the
    per-layer-type CP (linear_cp_mode, state_exchange, mla_cp).

    Returns a dict: summary, mesh, cp, modules (path -> kind), ep, has_moe,
    memory_per_rank_bytes, memory, log. An illegal layout raises ValueError with the planner's message.
    """
    return _C.plan(int(world_size), options)
