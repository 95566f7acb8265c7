#!/usr/bin/env python3
"""Writes a tiny random Hugging Face Qwen3 / Qwen3-MoE checkpoint (config.json and safetensors
bytes written here, not by a library) and the float64 logits of the same architecture, written
out below from its definition, for a fixed batch of token ids.

usage: hf_reference.py OUT_DIR qwen3|qwen3_moe single|sharded f32|bf16 [tied]
writes OUT_DIR/{config.json, model.safetensors | model-0000k-of-00002.safetensors +
model.safetensors.index.json, ids.bin (int64), logits.bin (float64), reference.json (shapes)}
"""
import json
import os
import struct
import sys

import torch

out, model_type, layout, dtype = sys.argv[1:5]
tied = len(sys.argv) > 5 and sys.argv[5] == "tied"
os.makedirs(out, exist_ok=True)
torch.manual_seed(11)
moe = model_type == "qwen3_moe"
cfg = dict(model_type=model_type, vocab_size=32, hidden_size=24, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, head_dim=8, intermediate_size=40,
           rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=tied)
if moe:
    cfg.update(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16, norm_topk_prob=True,
               decoder_sparse_step=1, mlp_only_layers=[], router_aux_loss_coef=0.001)
V, H, L = cfg["vocab_size"], cfg["hidden_size"], cfg["num_hidden_layers"]
NH, KV, D, F = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"], cfg["intermediate_size"]
store = torch.bfloat16 if dtype == "bf16" else torch.float32

weights = {}


def add(name, *shape, norm=False):
    t = (1.0 + 0.1 * torch.randn(*shape)) if norm else 0.3 * torch.randn(*shape)
    weights[name] = t.to(store)


add("model.embed_tokens.weight", V, H)
for i in range(L):
    p = f"model.layers.{i}."
    add(p + "input_layernorm.weight", H, norm=True)
    add(p + "post_attention_layernorm.weight", H, norm=True)
    add(p + "self_attn.q_proj.weight", NH * D, H)
    add(p + "self_attn.k_proj.weight", KV * D, H)
    add(p + "self_attn.v_proj.weight", KV * D, H)
    add(p + "self_attn.o_proj.weight", H, NH * D)
    add(p + "self_attn.q_norm.weight", D, norm=True)
    add(p + "self_attn.k_norm.weight", D, norm=True)
    if moe:
        E, MF = cfg["num_experts"], cfg["moe_intermediate_size"]
        add(p + "mlp.gate.weight", E, H)
        for e in range(E):
            add(p + f"mlp.experts.{e}.gate_proj.weight", MF, H)
            add(p + f"mlp.experts.{e}.up_proj.weight", MF, H)
            add(p + f"mlp.experts.{e}.down_proj.weight", H, MF)
    else:
        add(p + "mlp.gate_proj.weight", F, H)
        add(p + "mlp.up_proj.weight", F, H)
        add(p + "mlp.down_proj.weight", H, F)
add("model.norm.weight", H, norm=True)
if not tied:
    add("lm_head.weight", V, H)


def write_safetensors(path, tensors):
    header, offset, blobs = {"__metadata__": {"format": "pt"}}, 0, []
    for name, t in tensors.items():
        raw = (t.view(torch.int16) if t.dtype == torch.bfloat16 else t).contiguous().numpy().tobytes()
        header[name] = {"dtype": "BF16" if t.dtype == torch.bfloat16 else "F32",
                        "shape": list(t.shape), "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
        blobs.append(raw)
    text = json.dumps(header).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)


names = list(weights)
if layout == "single":
    write_safetensors(os.path.join(out, "model.safetensors"), weights)
else:
    half = len(names) // 2
    parts = [names[:half], names[half:]]
    weight_map = {}
    for k, part in enumerate(parts):
        fname = f"model-{k + 1:05d}-of-00002.safetensors"
        write_safetensors(os.path.join(out, fname), {n: weights[n] for n in part})
        weight_map.update({n: fname for n in part})
    with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
with open(os.path.join(out, "config.json"), "w") as f:
    json.dump(cfg, f)

# The float64 forward, from the definition.
W = {n: t.to(torch.float64) for n, t in weights.items()}
eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]


def rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope(x, pos):  # x [B, N, S, D]
    inv = theta ** (-torch.arange(0, D, 2, dtype=torch.float64) / D)
    ang = pos.to(torch.float64)[..., None] * inv
    emb = torch.cat([ang, ang], -1)[:, None]
    rot = torch.cat([-x[..., D // 2:], x[..., :D // 2]], -1)
    return x * emb.cos() + rot * emb.sin()


def swiglu(x, g, u, d):
    return (torch.nn.functional.silu(x @ g.T) * (x @ u.T)) @ d.T


B, S = 2, 10
ids = torch.randint(0, V, (B, S))
pos = torch.arange(S).expand(B, S)
x = W["model.embed_tokens.weight"][ids]
for i in range(L):
    p = f"model.layers.{i}."
    h = rms(x, W[p + "input_layernorm.weight"])
    q = (h @ W[p + "self_attn.q_proj.weight"].T).view(B, S, NH, D).transpose(1, 2)
    k = (h @ W[p + "self_attn.k_proj.weight"].T).view(B, S, KV, D).transpose(1, 2)
    v = (h @ W[p + "self_attn.v_proj.weight"].T).view(B, S, KV, D).transpose(1, 2)
    q = rope(rms(q, W[p + "self_attn.q_norm.weight"]), pos)
    k = rope(rms(k, W[p + "self_attn.k_norm.weight"]), pos)
    k, v = k.repeat_interleave(NH // KV, 1), v.repeat_interleave(NH // KV, 1)
    scores = q @ k.transpose(-1, -2) / D ** 0.5
    scores = scores.masked_fill(torch.ones(S, S, dtype=torch.bool).triu(1), float("-inf"))
    a = (scores.softmax(-1) @ v).transpose(1, 2).reshape(B, S, NH * D)
    x = x + a @ W[p + "self_attn.o_proj.weight"].T
    h = rms(x, W[p + "post_attention_layernorm.weight"])
    if moe:
        probs = (h @ W[p + "mlp.gate.weight"].T).softmax(-1)
        top, idx = probs.topk(cfg["num_experts_per_tok"], -1)
        top = top / top.sum(-1, keepdim=True)
        m = torch.zeros_like(h)
        for e in range(cfg["num_experts"]):
            y = swiglu(h, W[p + f"mlp.experts.{e}.gate_proj.weight"],
                       W[p + f"mlp.experts.{e}.up_proj.weight"], W[p + f"mlp.experts.{e}.down_proj.weight"])
            m = m + ((idx == e) * top).sum(-1, keepdim=True) * y
    else:
        m = swiglu(h, W[p + "mlp.gate_proj.weight"], W[p + "mlp.up_proj.weight"], W[p + "mlp.down_proj.weight"])
    x = x + m
head = W["model.embed_tokens.weight"] if tied else W["lm_head.weight"]
logits = rms(x, W["model.norm.weight"]) @ head.T
ids.to(torch.int64).numpy().tofile(os.path.join(out, "ids.bin"))
logits.numpy().tofile(os.path.join(out, "logits.bin"))
with open(os.path.join(out, "reference.json"), "w") as f:
    json.dump({"batch": B, "seq": S, "vocab": V}, f)
