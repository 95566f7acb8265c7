// A standalone timing of DSA's parts (issue 15): selection, sparse attention fwd and bwd,
// indexer loss, against dense blockwise MLA of the same shape. One process.
//   dsa_speed [--tokens S] [--heads H] [--topk K] [--index-heads HI] [--index-dim DI] [--reps N]
//             [--threads T] [--block-q N] [--dense 0|1] [--dense-mqa 0|1]
//   --dense 0: skip the dense expanded-MLA timing; --dense-mqa 1: also time dense blockwise
//   attention over the sparse kernel's own tensors (MQA: H query heads, one shared key).
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>

#include "hp/attention/attention.h"
#include "hp/attention/dsa.h"
#include "hp/attention/mla.h"

namespace {

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

template <typename Fn>
double median_time(int reps, Fn fn) {
  std::vector<double> t;
  for (int i = 0; i < reps; ++i) {
    const double t0 = now();
    fn();
    t.push_back(now() - t0);
  }
  std::sort(t.begin(), t.end());
  return t[t.size() / 2];
}

}  // namespace

int main(int argc, char** argv) {
  int64_t s = 8192, heads = 8, topk = 2048, hi = 4, di = 32;
  int reps = 1;
  int64_t block_q = hp::attention::DSAOptions{}.block_q;
  bool dense = true, dense_mqa = false;
  for (int i = 1; i + 1 < argc; i += 2) {
    const int64_t v = std::atoll(argv[i + 1]);
    if (!std::strcmp(argv[i], "--tokens")) s = v;
    if (!std::strcmp(argv[i], "--heads")) heads = v;
    if (!std::strcmp(argv[i], "--topk")) topk = v;
    if (!std::strcmp(argv[i], "--index-heads")) hi = v;
    if (!std::strcmp(argv[i], "--index-dim")) di = v;
    if (!std::strcmp(argv[i], "--reps")) reps = static_cast<int>(v);
    if (!std::strcmp(argv[i], "--block-q")) block_q = v;
    if (!std::strcmp(argv[i], "--dense")) dense = v != 0;
    if (!std::strcmp(argv[i], "--dense-mqa")) dense_mqa = v != 0;
    if (!std::strcmp(argv[i], "--threads")) at::set_num_threads(static_cast<int>(v));
  }
  hp::attention::MLAShape shape;
  shape.heads = heads;
  auto q = at::randn({1, s, heads, shape.qk_dim()});
  auto latent = at::randn({1, s, shape.kv_rank});
  auto k_rope = at::randn({1, s, shape.d_rope});
  auto w_ukv = at::randn({heads * (shape.d_nope + shape.d_v), shape.kv_rank}) * 0.1;
  hp::attention::DSAIndexer index{at::randn({1, s, hi, di}), at::rand({1, s, hi}),
                                  at::randn({1, s, di})};
  hp::attention::DSAOptions o;
  o.topk = topk;
  o.block_q = block_q;
  at::Tensor indices;
  const double t_select =
      median_time(reps, [&] { indices = hp::attention::dsa_select(index, 0, topk, o.block_q); });
  auto q_abs = hp::attention::dsa_absorb_queries(q, w_ukv, shape).detach().requires_grad_(true);
  auto kv = at::cat({latent, k_rope}, -1).requires_grad_(true);
  at::Tensor out, p;
  const double scale = 1.0 / std::sqrt(static_cast<double>(shape.qk_dim()));
  const double t_attn = median_time(reps, [&] {
    hp::attention::dsa_sparse_mqa(q_abs, kv, indices, shape.kv_rank, scale, o.block_q, out, p);
  });
  const double t_attn_bwd = median_time(reps, [&] { out.backward(at::ones_like(out), true); });
  auto iq = index.q.requires_grad_(true), iw = index.w.requires_grad_(true),
       ik = index.k.requires_grad_(true);
  at::Tensor loss;
  const double t_loss = median_time(reps, [&] {
    loss = hp::attention::dsa_indexer_loss({iq, iw, ik}, indices, p, o.block_q);
  });
  const double t_dense = !dense ? 0.0 : median_time(reps, [&] {
    auto qq = q.detach().requires_grad_(true);
    auto d = hp::attention::mla_attention(qq, latent, k_rope, w_ukv, shape);
    d.backward(at::ones_like(d));
  });
  // The same attention densely: blockwise over the very tensors the sparse kernel reads (the
  // absorbed queries [H, R + d_rope], one shared [latent | k_rope] key, the latent as value).
  const double t_dense_mqa = !dense_mqa ? 0.0 : median_time(reps, [&] {
    auto qq = q_abs.detach().transpose(1, 2).contiguous().requires_grad_(true);
    auto kk = kv.detach().unsqueeze(1).contiguous().requires_grad_(true);
    auto vv = latent.unsqueeze(1).contiguous().requires_grad_(true);
    hp::attention::AttentionOptions ao;
    ao.causal = true;
    ao.scale = scale;
    auto r = hp::attention::make_blockwise_attention()->forward(qq, kk, vv, ao);
    r.out.backward(at::ones_like(r.out));
  });
  const double t_dsa = t_select + t_attn + t_attn_bwd + t_loss;
  std::printf(
      "S=%lld H=%lld topk=%lld H_I=%lld d_I=%lld threads=%d\n  select %.3f s, sparse attention "
      "fwd %.3f s, bwd %.3f s, indexer loss (with its gradients) %.3f s: DSA %.3f s\n  dense "
      "blockwise MLA fwd+bwd %.3f s (ratio dense / DSA %.2f)\n  dense blockwise MQA of the "
      "sparse kernel's shapes fwd+bwd %.3f s (ratio dense / DSA %.2f)\n",
      (long long)s, (long long)heads, (long long)topk, (long long)hi, (long long)di,
      at::get_num_threads(), t_select, t_attn, t_attn_bwd, t_loss, t_dsa, t_dense, t_dense / t_dsa,
      t_dense_mqa, t_dense_mqa / t_dsa);
  return 0;
}
