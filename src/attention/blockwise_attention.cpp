// Blockwise (flash-style) attention on CPU. q and k share the last dim Dqk; v and out have
// their own last dim Dv (MLA: Dqk 192, Dv 128).
//
//   q [B, Nq, Sq, Dqk] --view--> [B, Nkv, G, Sq, Dqk]; a q block of bq rows, all G heads that
//   share a KV head, is one [B, Nkv, G*bq, Dqk] matrix (GQA by index mapping, no K/V repeat).
//
//   forward, per q block, for each visible kv block (k [bk, Dqk], v [bk, Dv]):
//     s   = (q*scale) k^T                  [G*bq, bk]
//     m'  = max(m, rowmax s)
//     p   = exp(s - m')
//     l   = l*exp(m-m') + rowsum p
//     acc = acc*exp(m-m') + p v            [G*bq, Dv]
//   out = acc / l  [.., Dv],  lse = m + log l;  m and 1/l are kept for the backward
//
//   backward, per kv block (dK [bk, Dqk], dV [bk, Dv] accumulate locally), per visible q block:
//     p   = exp(s - m) / l      (not exp(s - lse): an fp32 lse of a row whose scores are ~1e5
//                               is rounded by up to 2^-24 |lse| ~ 4e-3, which would scale every
//                               p of the row by exp(4e-3); m is one of the scores, exact)
//     dV += p^T dO                         dO [G*bq, Dv]
//     dP  = dO v^T                         [G*bq, bk]
//     dS  = p * (dP - delta),  delta = rowsum(dO*O) - dlse
//     dQ += dS k                           [G*bq, Dqk]  (times scale at the end)
//     dK += dS^T (q*scale)
//
// Tiles wholly above the causal diagonal (after q_offset) or wholly hidden by a mask are
// skipped (TileMask::kind); tiles the causal diagonal crosses are multiplied in pieces of 64
// query rows, each only up to the last key it sees (row_ranges). No [Sq, Skv] tensor exists in
// forward or backward: memory is O(S*D) plus one [G*bq, bk] tile per step.
#include <algorithm>
#include <atomic>
#include <functional>
#include <limits>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>

#include "hp/attention/attention.h"
#include "hp/common/threads.h"
#include "parallel_units.h"
#include "problem.h"
#include "softmax_rows.h"

namespace hp::attention {
namespace {

using detail::BlockKind;
using detail::for_each_unit;
using detail::Problem;
using detail::TileMask;
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct CallState : torch::CustomClassHolder {
  CallState(Problem p, int64_t bq, int64_t bk) : problem(std::move(p)), tiles(problem, bq, bk) {}
  Problem problem;
  TileMask tiles;
};

int64_t q_start(const TileMask& t, int64_t qb) {
  return qb * t.block_q();
}
int64_t q_end(const Problem& p, const TileMask& t, int64_t qb) {
  return std::min(p.q_len, (qb + 1) * t.block_q());
}
int64_t kv_start(const TileMask& t, int64_t kb) {
  return kb * t.block_kv();
}
int64_t kv_end(const Problem& p, const TileMask& t, int64_t kb) {
  return std::min(p.kv_len, (kb + 1) * t.block_kv());
}

// [B, Nkv, G, Sq, ...] slice of q rows [qs, qe) as one [B, Nkv, G*bq, ...] matrix.
at::Tensor group_rows(const at::Tensor& x5, int64_t qs, int64_t qe) {
  auto s = x5.slice(3, qs, qe);
  auto sizes = s.sizes().vec();
  std::vector<int64_t> out = {sizes[0], sizes[1], sizes[2] * sizes[3]};
  for (size_t i = 4; i < sizes.size(); ++i)
    out.push_back(sizes[i]);
  return s.reshape(out);
}

detail::TileRows tile_rows(const Problem& p, const TileMask& t, int64_t qb, int64_t kb) {
  detail::TileRows tr;
  tr.rows_per_head = q_end(p, t, qb) - q_start(t, qb);
  tr.rows = p.group * tr.rows_per_head;
  tr.cols = kv_end(p, t, kb) - kv_start(t, kb);
  tr.causal = p.causal;
  tr.q_first = p.q_offset + q_start(t, qb);
  tr.kv_first = kv_start(t, kb);
  return tr;
}

// Row ranges of a tile and the leading columns each range needs. A causal tile that the
// diagonal crosses is cut, per head, into pieces of kCausalPiece query rows; each piece
// multiplies only up to the last column its last row sees, so the tile's upper-right triangle
// is mostly never computed (a 256x256 tile in 4 pieces: 62.5% of its GEMM work). Rows that see
// every column are merged into one range; rows that see none are left out (their scores are
// never written, and the row passes zero them, reading no column past visible_cols).
struct RowRange {
  int64_t first = 0, end = 0, cols = 0;
};
constexpr int64_t kCausalPiece = 64;

// The rows of range rr of a [rows, ...] matrix.
at::Tensor rows_of(const at::Tensor& x, const RowRange& rr) {
  return x.slice(0, rr.first, rr.end);
}
// Range rr of a [rows, bk] tile: its rows, leading rr.cols columns.
at::Tensor part(const at::Tensor& tile, const RowRange& rr) {
  return tile.slice(0, rr.first, rr.end).narrow(1, 0, rr.cols);
}

std::vector<RowRange> row_ranges(const detail::TileRows& tr, BlockKind kind) {
  std::vector<RowRange> out;
  if (kind != BlockKind::kPartial || !tr.causal) return {{0, tr.rows, tr.cols}};
  for (int64_t r0 = 0; r0 < tr.rows;) {
    const int64_t head_end = (r0 / tr.rows_per_head + 1) * tr.rows_per_head;
    const int64_t r1 = std::min(head_end, r0 + kCausalPiece);
    const int64_t cols = tr.visible_cols(r1 - 1);  // non-decreasing within a head
    if (cols > 0) {
      if (!out.empty() && out.back().end == r0 && out.back().cols == tr.cols && cols == tr.cols) {
        out.back().end = r1;
      } else {
        out.push_back({r0, r1, cols});
      }
    }
    r0 = r1;
  }
  return out;
}

// Units (callers order them largest first, so causal imbalance evens out) run through
// detail::for_each_unit (parallel_units.h).
// Per q block: [B*Nkv][G*bq, D] contiguous blocks of a [B, Nq, Sq, last] tensor.
std::vector<at::Tensor> grouped_blocks(const Problem& p, const TileMask& t, const at::Tensor& x,
                                       int64_t last) {
  auto x5 = x.reshape({p.batch, p.kv_heads, p.group, p.q_len, last});
  std::vector<at::Tensor> out(t.num_q_blocks());
  for (int64_t qb = 0; qb < t.num_q_blocks(); ++qb) {
    out[qb] = group_rows(x5, q_start(t, qb), q_end(p, t, qb))
                  .contiguous()
                  .view({p.batch * p.kv_heads, -1, last});
  }
  return out;
}

int64_t visible_tiles_in_row(const TileMask& t, int64_t qb) {
  int64_t n = 0;
  for (int64_t kb = 0; kb < t.num_kv_blocks(); ++kb)
    n += t.kind(qb, kb) != BlockKind::kEmpty;
  return n;
}

int64_t visible_tiles_in_col(const TileMask& t, int64_t kb) {
  int64_t n = 0;
  for (int64_t qb = 0; qb < t.num_q_blocks(); ++qb)
    n += t.kind(qb, kb) != BlockKind::kEmpty;
  return n;
}

// Block indices sorted by descending work.
std::vector<int64_t> by_work(int64_t n, const std::function<int64_t(int64_t)>& work) {
  std::vector<int64_t> idx(n);
  for (int64_t i = 0; i < n; ++i)
    idx[i] = i;
  std::stable_sort(idx.begin(), idx.end(), [&](int64_t a, int64_t b) { return work(a) > work(b); });
  return idx;
}

template <typename T>
void forward_kernel(const CallState& st, const at::Tensor& q, const at::Tensor& k,
                    const at::Tensor& v, at::Tensor& out_g, at::Tensor& lse_g, at::Tensor& max_g,
                    at::Tensor& inv_sum_g) {
  const Problem& p = st.problem;
  const TileMask& t = st.tiles;
  const int64_t heads = p.batch * p.kv_heads;
  const double neg_inf = -std::numeric_limits<double>::infinity();
  auto k3 = k.view({heads, p.kv_len, p.qk_dim});
  auto v3 = v.view({heads, p.kv_len, p.v_dim});
  auto qblocks = grouped_blocks(p, t, q.mul(p.scale), p.qk_dim);
  auto order = by_work(t.num_q_blocks(), [&](int64_t qb) { return visible_tiles_in_row(t, qb); });
  const int threads = at::get_num_threads();
  common::ScopedBlasThreads one_blas_thread(1);
  std::vector<at::Tensor> scratch(threads);
  for_each_unit(heads * t.num_q_blocks(), threads, [&](int64_t u, int64_t slot) {
    const int64_t qb = order[u / heads], hh = u % heads;
    const int64_t qs = q_start(t, qb), qe = q_end(p, t, qb), bq = qe - qs;
    const int64_t rows = p.group * bq;
    if (!scratch[slot].defined()) {
      scratch[slot] = at::empty({p.group * t.block_q() * t.block_kv()}, q.options());
    }
    auto qblk = qblocks[qb][hh];
    auto m = at::full({rows}, neg_inf, q.options());
    auto l = at::zeros({rows}, q.options());
    auto alpha = at::empty({rows}, q.options());
    auto acc = at::zeros({rows, p.v_dim}, q.options());
    for (int64_t kb = 0; kb < t.num_kv_blocks(); ++kb) {
      const BlockKind kind = t.kind(qb, kb);
      if (kind == BlockKind::kEmpty) continue;
      const int64_t ks = kv_start(t, kb), ke = kv_end(p, t, kb);
      const auto tr = tile_rows(p, t, qb, kb);
      const auto ranges = row_ranges(tr, kind);
      auto s = scratch[slot].narrow(0, 0, rows * tr.cols).view({rows, tr.cols});
      auto kblk = k3[hh].slice(0, ks, ke);
      for (const auto& rr : ranges) {
        auto out = part(s, rr);
        at::mm_out(out, rows_of(qblk, rr), kblk.narrow(0, 0, rr.cols).t());
      }
      if (kind == BlockKind::kPartial && t.user_masked(qb, kb)) {
        t.apply_head(s, qb, kb, hh / p.kv_heads, hh % p.kv_heads);
      }
      detail::online_softmax_update<T>(tr, s.data_ptr<T>(), m.data_ptr<T>(), l.data_ptr<T>(),
                                       alpha.data_ptr<T>());
      acc.mul_(alpha.unsqueeze(1));
      auto vblk = v3[hh].slice(0, ks, ke);
      for (const auto& rr : ranges) {
        rows_of(acc, rr).addmm_(part(s, rr), vblk.narrow(0, 0, rr.cols));
      }
    }
    // Rows that saw no key: m = -inf, l = 0 -> out 0, lse = -inf, 1/l kept as 0.
    auto lse = m.masked_fill(m.isneginf(), 0.0).add_(l.log());
    auto l_safe = l.masked_fill(l.eq(0), 1.0);
    acc.div_(l_safe.unsqueeze(1));
    const int64_t b = hh / p.kv_heads, kvh = hh % p.kv_heads;
    out_g[b][kvh].slice(1, qs, qe).copy_(acc.view({p.group, bq, p.v_dim}));
    lse_g[b][kvh].slice(1, qs, qe).copy_(lse.view({p.group, bq}));
    max_g[b][kvh].slice(1, qs, qe).copy_(m.view({p.group, bq}));
    inv_sum_g[b][kvh].slice(1, qs, qe).copy_(
        l_safe.reciprocal().masked_fill_(l.eq(0), 0.0).view({p.group, bq}));
  });
}

template <typename T>
void backward_kernel(const CallState& st, const at::Tensor& q, const at::Tensor& k,
                     const at::Tensor& v, const at::Tensor& dout, const at::Tensor& row_max,
                     const at::Tensor& inv_sum, const at::Tensor& delta, at::Tensor& dq_g,
                     at::Tensor& dk, at::Tensor& dv) {
  const Problem& p = st.problem;
  const TileMask& t = st.tiles;
  const int64_t heads = p.batch * p.kv_heads;
  auto k3 = k.view({heads, p.kv_len, p.qk_dim});
  auto v3 = v.view({heads, p.kv_len, p.v_dim});
  auto dk3 = dk.view({heads, p.kv_len, p.qk_dim});
  auto dv3 = dv.view({heads, p.kv_len, p.v_dim});
  auto qblk = grouped_blocks(p, t, q.mul(p.scale), p.qk_dim);
  auto doblk = grouped_blocks(p, t, dout, p.v_dim);
  auto maxblk = grouped_blocks(p, t, row_max, 1);
  auto invblk = grouped_blocks(p, t, inv_sum, 1);
  auto deltablk = grouped_blocks(p, t, delta, 1);
  const int64_t nqb = t.num_q_blocks();
  const int threads = at::get_num_threads();
  // dQ accumulates over kv blocks, which run on different threads: one partial per thread.
  std::vector<std::vector<at::Tensor>> dq_part(threads);
  std::vector<at::Tensor> s_scratch(threads), dp_scratch(threads);
  auto order = by_work(t.num_kv_blocks(), [&](int64_t kb) { return visible_tiles_in_col(t, kb); });
  common::ScopedBlasThreads one_blas_thread(1);
  for_each_unit(heads * t.num_kv_blocks(), threads, [&](int64_t u, int64_t slot) {
    const int64_t kb = order[u / heads], hh = u % heads;
    const int64_t ks = kv_start(t, kb), ke = kv_end(p, t, kb), bk = ke - ks;
    if (!s_scratch[slot].defined()) {
      const int64_t tile = p.group * t.block_q() * t.block_kv();
      s_scratch[slot] = at::empty({tile}, q.options());
      dp_scratch[slot] = at::empty({tile}, q.options());
      dq_part[slot].resize(nqb);
    }
    auto kblk = k3[hh].slice(0, ks, ke);
    auto vblk = v3[hh].slice(0, ks, ke);
    auto dk_acc = at::zeros({bk, p.qk_dim}, q.options());
    auto dv_acc = at::zeros({bk, p.v_dim}, q.options());
    for (int64_t qb = 0; qb < nqb; ++qb) {
      const BlockKind kind = t.kind(qb, kb);
      if (kind == BlockKind::kEmpty) continue;
      const auto tr = tile_rows(p, t, qb, kb);
      auto qh = qblk[qb][hh];
      auto doh = doblk[qb][hh];
      const auto ranges = row_ranges(tr, kind);
      auto s = s_scratch[slot].narrow(0, 0, tr.rows * bk).view({tr.rows, bk});
      auto ds = dp_scratch[slot].narrow(0, 0, tr.rows * bk).view({tr.rows, bk});
      for (const auto& rr : ranges) {
        auto out = part(s, rr);
        at::mm_out(out, rows_of(qh, rr), kblk.narrow(0, 0, rr.cols).t());
      }
      if (kind == BlockKind::kPartial && t.user_masked(qb, kb)) {
        t.apply_head(s, qb, kb, hh / p.kv_heads, hh % p.kv_heads);
      }
      detail::recompute_probs<T>(tr, s.data_ptr<T>(), maxblk[qb][hh].data_ptr<T>(),
                                 invblk[qb][hh].data_ptr<T>());
      for (const auto& rr : ranges) {
        dv_acc.narrow(0, 0, rr.cols).addmm_(part(s, rr).t(), rows_of(doh, rr));
        auto out = part(ds, rr);
        at::mm_out(out, rows_of(doh, rr), vblk.narrow(0, 0, rr.cols).t());
      }
      detail::softmax_grad<T>(tr, s.data_ptr<T>(), ds.data_ptr<T>(),
                              deltablk[qb][hh].data_ptr<T>());
      auto& dq = dq_part[slot][qb];
      if (!dq.defined()) dq = at::zeros_like(qblk[qb]);
      for (const auto& rr : ranges) {
        rows_of(dq[hh], rr).addmm_(part(ds, rr), kblk.narrow(0, 0, rr.cols));
        dk_acc.narrow(0, 0, rr.cols).addmm_(part(ds, rr).t(), rows_of(qh, rr));
      }
    }
    dk3[hh].slice(0, ks, ke).copy_(dk_acc);
    dv3[hh].slice(0, ks, ke).copy_(dv_acc);
  });
  dq_g.zero_();
  for (int64_t qb = 0; qb < nqb; ++qb) {
    const int64_t qs = q_start(t, qb), qe = q_end(p, t, qb);
    auto dst = dq_g.slice(3, qs, qe);
    for (int slot = 0; slot < threads; ++slot) {
      if (slot >= static_cast<int>(dq_part.size()) || dq_part[slot].empty()) continue;
      const auto& part = dq_part[slot][qb];
      if (!part.defined()) continue;
      dst.add_(part.view({p.batch, p.kv_heads, p.group, qe - qs, p.qk_dim}));
    }
  }
  dq_g.mul_(p.scale);
}

struct BlockwiseFn : torch::autograd::Function<BlockwiseFn> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& v, c10::intrusive_ptr<CallState> st) {
    const Problem& p = st->problem;
    auto qc = q.detach().to(p.compute_dtype).contiguous();
    auto kc = k.detach().to(p.compute_dtype).contiguous();
    auto vc = v.detach().to(p.compute_dtype).contiguous();
    auto out_g = at::empty({p.batch, p.kv_heads, p.group, p.q_len, p.v_dim}, qc.options());
    auto lse_g = at::empty({p.batch, p.kv_heads, p.group, p.q_len}, qc.options());
    auto max_g = at::empty_like(lse_g), inv_sum_g = at::empty_like(lse_g);
    if (p.compute_dtype == at::kDouble) {
      forward_kernel<double>(*st, qc, kc, vc, out_g, lse_g, max_g, inv_sum_g);
    } else {
      forward_kernel<float>(*st, qc, kc, vc, out_g, lse_g, max_g, inv_sum_g);
    }
    auto out = out_g.view({p.batch, p.q_heads, p.q_len, p.v_dim});
    auto lse = lse_g.view({p.batch, p.q_heads, p.q_len});
    const std::vector<int64_t> rows{p.batch, p.q_heads, p.q_len};
    ctx->save_for_backward({qc, kc, vc, out, max_g.view(rows), inv_sum_g.view(rows)});
    ctx->saved_data["state"] = c10::IValue::make_capsule(st);
    ctx->saved_data["in_dtype"] = static_cast<int64_t>(q.scalar_type());
    return {out.to(q.scalar_type()), lse};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    auto holder = ctx->saved_data["state"].toCapsule();
    const auto& st = *static_cast<CallState*>(holder.get());
    const Problem& p = st.problem;
    const auto& q = saved[0];
    const auto& k = saved[1];
    const auto& v = saved[2];
    const auto& out = saved[3];
    const auto& row_max = saved[4];
    const auto& inv_sum = saved[5];
    const auto ct = p.compute_dtype;
    auto dout = grads[0].defined() ? grads[0].to(ct).contiguous() : at::zeros_like(out);
    auto delta = (dout * out).sum(-1);  // [B, Nq, Sq]
    if (grads[1].defined()) delta = delta - grads[1].to(ct);
    auto dq_g = at::empty({p.batch, p.kv_heads, p.group, p.q_len, p.qk_dim}, q.options());
    auto dk = at::zeros_like(k);
    auto dv = at::zeros_like(v);
    if (ct == at::kDouble) {
      backward_kernel<double>(st, q, k, v, dout, row_max, inv_sum, delta, dq_g, dk, dv);
    } else {
      backward_kernel<float>(st, q, k, v, dout, row_max, inv_sum, delta, dq_g, dk, dv);
    }
    const auto in_dtype = static_cast<at::ScalarType>(ctx->saved_data["in_dtype"].toInt());
    auto dq = dq_g.view({p.batch, p.q_heads, p.q_len, p.qk_dim}).to(in_dtype);
    return {dq, dk.to(in_dtype), dv.to(in_dtype), at::Tensor()};
  }
};

class BlockwiseAttention final : public AttentionPrimitive {
 public:
  std::string name() const override { return "blockwise"; }

  AttentionResult forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const AttentionOptions& options) const override {
    auto p = detail::validate(q, k, v, options, "attention 'blockwise'");
    auto st = c10::make_intrusive<CallState>(std::move(p), options.block_q, options.block_kv);
    auto outs = BlockwiseFn::apply(q, k, v, st);
    return {outs[0], outs[1]};
  }
};

}  // namespace

std::unique_ptr<AttentionPrimitive> make_blockwise_attention() {
  return std::make_unique<BlockwiseAttention>();
}

}  // namespace hp::attention
