"""Float64 single-process references for the package's tests, written here from the formulas
(explicit scores; the token recurrence of the delta rule), sharing no code with hyperparallel."""

import math

import torch


def attention(q, k, v, causal=False, scale=None, doc_ids=None):
    """Softmax attention, BSHD: q [B, S, Hq, D], k/v [B, S, Hkv, D]; query head h reads K/V head
    h // (Hq / Hkv). doc_ids [1 or B, S]: a key is visible only inside its query's document."""
    b, s, hq, d = q.shape
    rep = hq // k.shape[2]
    k2 = k.repeat_interleave(rep, dim=2)
    v2 = v.repeat_interleave(rep, dim=2)
    scale = 1.0 / math.sqrt(d) if scale is None else scale
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k2) * scale
    visible = torch.ones(s, s, dtype=torch.bool).expand(b, 1, s, s)
    if causal:
        visible = visible & torch.ones(s, s, dtype=torch.bool).tril()
    if doc_ids is not None:
        same = doc_ids[:, None, :, None] == doc_ids[:, None, None, :]
        visible = visible & same
    scores = scores.masked_fill(~visible, float("-inf"))
    p = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return torch.einsum("bhqk,bkhd->bqhd", p, v2)


def delta_rule(q, k, v, g, beta, initial_state=None, scale=None, resets=None):
    """Gated delta rule token by token (GDN: g [B, T, HV]; KDA: g [B, T, HV, K]), BSHD; value
    head h reads q/k head h // (HV / H); resets [B, T] bool: the state is zeroed before each
    marked token (a document start). Returns (out [B, T, HV, V], final state [B, HV, K, V])."""
    b, t, h, kd = q.shape
    hv, vd = v.shape[2], v.shape[3]
    rep = hv // h
    scale = 1.0 / math.sqrt(kd) if scale is None else scale
    state = (torch.zeros(b, hv, kd, vd, dtype=q.dtype) if initial_state is None
             else initial_state.clone())
    outs = []
    for i in range(t):
        if resets is not None:
            state = state * (~resets[:, i]).to(state.dtype)[:, None, None, None]
        qi = q[:, i].repeat_interleave(rep, dim=1) * scale  # [B, HV, K]
        ki = k[:, i].repeat_interleave(rep, dim=1)
        vi = v[:, i]  # [B, HV, V]
        gi = g[:, i]
        decay = gi.exp()[..., None, None] if gi.dim() == 2 else gi.exp()[..., None]
        state = state * decay
        pred = torch.einsum("bhkv,bhk->bhv", state, ki)
        state = state + torch.einsum("bhk,bhv->bhkv", ki, (vi - pred) * beta[:, i][..., None])
        outs.append(torch.einsum("bhkv,bhk->bhv", state, qi))
    return torch.stack(outs, dim=1), state
