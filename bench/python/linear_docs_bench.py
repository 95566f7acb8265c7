"""Packed documents in the linear mixers: hyperparallel.LinearAttentionCP forward + backward on
one process, the same tensors with and without documents, timed in alternating pairs; prints the
medians and the median of the per-pair ratios (packed / plain).

    PYTHONPATH=build/python python3 bench/python/linear_docs_bench.py [--seq 2048] [--kind gdn]
"""

import argparse
import os
import random
import time

import torch
import torch.distributed as dist


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--kind", default="gdn", choices=("gdn", "kda"))
    ap.add_argument("--pairs", type=int, default=9)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("gloo", rank=0, world_size=1)
    import hyperparallel as hp

    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    b, t, h, hv, kd, vd = 1, a.seq, 4, 8, 32, 32
    # Documents as hp-train's packed copy task draws them: even lengths in [8, S/4].
    random.seed(1)
    cu = [0]
    while cu[-1] < t:
        n = 2 * random.randint(4, t // 8)
        if n > t - cu[-1] or t - cu[-1] - n < 8:
            n = t - cu[-1]
        cu.append(cu[-1] + n)

    def inputs():
        q = torch.nn.functional.normalize(torch.randn(b, t, h, kd, generator=g), dim=-1)
        k = torch.nn.functional.normalize(torch.randn(b, t, h, kd, generator=g), dim=-1)
        v = torch.randn(b, t, hv, vd, generator=g)
        gshape = (b, t, hv) if a.kind == "gdn" else (b, t, hv, kd)
        gate = -torch.rand(*gshape, generator=g)
        beta = torch.rand(b, t, hv, generator=g)
        return [x.requires_grad_() for x in (q, k, v, gate, beta)]

    mixer = hp.LinearAttentionCP(a.kind, "state_passing")

    def step(mask):
        x = inputs()
        t0 = time.perf_counter()
        out, _ = mixer(*x, mask=mask)
        out.sum().backward()
        return time.perf_counter() - t0

    step(None), step(cu)  # warm-up
    plain, packed = [], []
    for _ in range(a.pairs):
        plain.append(step(None))
        packed.append(step(cu))
    med = lambda xs: sorted(xs)[len(xs) // 2]
    ratios = [p / q for p, q in zip(packed, plain)]
    print(f"{a.kind} S={t} H={h} HV={hv} K={kd} V={vd}, {len(cu) - 1} documents "
          f"(lengths {[cu[i + 1] - cu[i] for i in range(len(cu) - 1)]}), {a.threads} threads")
    print(f"  plain  fwd+bwd {med(plain):.4f} s (median of {a.pairs})")
    print(f"  packed fwd+bwd {med(packed):.4f} s; packed / plain {med(ratios):.2f}x "
          f"(median of the per-pair ratios)")


if __name__ == "__main__":
    main()
