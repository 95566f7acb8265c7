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
//     dQ += scale dS k                     [G*bq, Dqk]  (under a lock per q block and head)
//     dK += dS^T (q*scale)
//
// Tiles wholly above the causal diagonal (after q_offset) or wholly hidden by a mask are
// skipped (TileMask::kind); tiles the causal diagonal crosses are multiplied in pieces of 64
// query rows, each only up to the last key it sees (row_ranges). No [Sq, Skv] tensor exists in
// forward or backward: memory is O(S*D) plus one [G*bq, bk] tile per step.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <functional>
#include <limits>
#include <mutex>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>

#include "hp/attention/attention.h"
#include "hp/common/check.h"
#include "hp/common/threads.h"
#include "parallel_units.h"
#include "problem.h"
#include "softmax_rows.h"
#include "tile_gemm.h"

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
// The rows of query block qb for one (batch, KV head) hh of a [B, Nq, Sq, last] tensor, as one
// row-major [G*bq, last] matrix: all G query heads of the KV head, stacked. G = 1: the rows of
// the tensor itself (no copy); G > 1: each block's rows copied together once per call (and
// copied back by scatter() where the blocks are an output). `zero`: an output, its rows start
// at 0.
template <typename T>
class GroupedRows {
 public:
  GroupedRows(const Problem& p, const TileMask& t, const at::Tensor& x, int64_t last, bool zero)
      : p_(p), t_(t), last_(last) {
    if (p.group == 1) {
      HP_INTERNAL_ASSERT(x.is_contiguous(), "GroupedRows: a contiguous tensor expected");
      if (zero) x.zero_();
      base_ = x.data_ptr<T>();
      return;
    }
    auto x5 = x.reshape({p.batch, p.kv_heads, p.group, p.q_len, last});
    blocks_.resize(t.num_q_blocks());
    for (int64_t qb = 0; qb < t.num_q_blocks(); ++qb) {
      const int64_t qs = q_start(t, qb), qe = q_end(p, t, qb);
      if (zero) {
        blocks_[qb] = at::zeros({p.batch * p.kv_heads, p.group * (qe - qs), last}, x.options());
      } else {
        auto rows = x5.slice(3, qs, qe).reshape({p.batch * p.kv_heads, -1, last});
        blocks_[qb] = rows.contiguous();
      }
    }
  }
  T* at(int64_t qb, int64_t hh) const {
    if (base_ != nullptr) return base_ + (hh * p_.q_len + q_start(t_, qb)) * last_;
    return blocks_[qb].template data_ptr<T>() + hh * blocks_[qb].size(1) * last_;
  }
  // G > 1: the blocks into x ([B, Nkv, G, Sq, last] order); G = 1: x was written in place.
  void scatter(at::Tensor& x) const {
    if (base_ != nullptr) return;
    auto x5 = x.view({p_.batch, p_.kv_heads, p_.group, p_.q_len, last_});
    for (int64_t qb = 0; qb < t_.num_q_blocks(); ++qb) {
      const int64_t qs = q_start(t_, qb), qe = q_end(p_, t_, qb);
      x5.slice(3, qs, qe).copy_(
          blocks_[qb].view({p_.batch, p_.kv_heads, p_.group, qe - qs, last_}));
    }
  }

 private:
  const Problem& p_;
  const TileMask& t_;
  int64_t last_;
  T* base_ = nullptr;
  std::vector<at::Tensor> blocks_;
};

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

// Per-thread buffers of the kernels' parallel loops (sized for the largest tile on first use).
template <typename T>
struct ForwardScratch {
  std::vector<T> s, m, l, alpha, acc;  // score tile; row max, sum, rescale; output rows
};
template <typename T>
struct BackwardScratch {
  std::vector<T> s, ds, dk, dv;  // p and dS tiles; the kv block's dK and dV
  detail::SharedBt<T> k_t, v_t;  // the kv block's k and v, as B^T of every q block's products
};

// The kernels multiply raw row-major blocks with detail::gemm (tile_gemm.h: our AVX-512 kernel
// where the CPU has it, else one BLAS call per product; no ATen op per tile); the backward's
// products with k^T and v^T go through SharedBt, which transposes each kv block once per unit.
// q's softmax scale rides in the GEMMs' alpha (s = scale q k^T, dK += scale dS^T q), so q is
// never copied scaled.
template <typename T>
void forward_kernel(const CallState& st, const at::Tensor& q, const at::Tensor& k,
                    const at::Tensor& v, at::Tensor& out_g, at::Tensor& lse_g, at::Tensor& max_g,
                    at::Tensor& inv_sum_g) {
  const Problem& p = st.problem;
  const TileMask& t = st.tiles;
  const int64_t heads = p.batch * p.kv_heads;
  const int64_t dqk = p.qk_dim, dv = p.v_dim;
  const T scale = static_cast<T>(p.scale);
  const T neg_inf = -std::numeric_limits<T>::infinity();
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  T* out_p = out_g.data_ptr<T>();
  T* lse_p = lse_g.data_ptr<T>();
  T* max_p = max_g.data_ptr<T>();
  T* inv_p = inv_sum_g.data_ptr<T>();
  const GroupedRows<T> qrows(p, t, q, dqk, /*zero=*/false);
  auto order = by_work(t.num_q_blocks(), [&](int64_t qb) { return visible_tiles_in_row(t, qb); });
  const int threads = at::get_num_threads();
  common::ScopedBlasThreads one_blas_thread(1);
  std::vector<ForwardScratch<T>> scratch(threads);
  for_each_unit(heads * t.num_q_blocks(), threads, [&](int64_t u, int64_t slot) {
    const int64_t qb = order[u / heads], hh = u % heads;
    const int64_t qs = q_start(t, qb), qe = q_end(p, t, qb), bq = qe - qs;
    const int64_t rows = p.group * bq;
    auto& sc = scratch[slot];
    if (sc.s.empty()) {
      const int64_t max_rows = p.group * t.block_q();
      sc.s.resize(max_rows * t.block_kv());
      sc.m.resize(max_rows);
      sc.l.resize(max_rows);
      sc.alpha.resize(max_rows);
      sc.acc.resize(max_rows * dv);
    }
    T *m = sc.m.data(), *l = sc.l.data(), *alpha = sc.alpha.data();
    T* acc = sc.acc.data();
    std::fill(m, m + rows, neg_inf);
    std::fill(l, l + rows, T(0));
    std::fill(acc, acc + rows * dv, T(0));
    const T* qblk = qrows.at(qb, hh);
    const T* k_h = kp + hh * p.kv_len * dqk;
    const T* v_h = vp + hh * p.kv_len * dv;
    for (int64_t kb = 0; kb < t.num_kv_blocks(); ++kb) {
      const BlockKind kind = t.kind(qb, kb);
      if (kind == BlockKind::kEmpty) continue;
      const int64_t ks = kv_start(t, kb);
      const auto tr = tile_rows(p, t, qb, kb);
      const auto ranges = row_ranges(tr, kind);
      T* s = sc.s.data();
      const int64_t ld = tr.cols;
      for (const auto& rr : ranges) {
        detail::gemm(false, true, rr.end - rr.first, rr.cols, dqk, scale, qblk + rr.first * dqk,
                     dqk, k_h + ks * dqk, dqk, T(0), s + rr.first * ld, ld);
      }
      if (kind == BlockKind::kPartial && t.user_masked(qb, kb)) {
        auto s_t = at::from_blob(s, {rows, tr.cols}, q.options());
        t.apply_head(s_t, qb, kb, hh / p.kv_heads, hh % p.kv_heads);
      }
      detail::online_softmax_update<T>(tr, s, m, l, alpha);
      for (int64_t r = 0; r < rows; ++r) {
        T* a = acc + r * dv;
        const T f = alpha[r];
        for (int64_t c = 0; c < dv; ++c)
          a[c] *= f;
      }
      for (const auto& rr : ranges) {
        detail::gemm(false, false, rr.end - rr.first, dv, rr.cols, T(1), s + rr.first * ld, ld,
                     v_h + ks * dv, dv, T(1), acc + rr.first * dv, dv);
      }
    }
    // Rows that saw no key: m = -inf, l = 0 -> out 0, lse = -inf, 1/l kept as 0. A NaN row
    // stays NaN in every output.
    for (int64_t r = 0; r < rows; ++r) {
      const int64_t at_row = (hh * p.group + r / bq) * p.q_len + qs + r % bq;
      const T lr = l[r], mr = m[r];
      const T l_safe = lr == T(0) ? T(1) : lr;
      const T* a = acc + r * dv;
      T* o = out_p + at_row * dv;
      for (int64_t c = 0; c < dv; ++c)
        o[c] = a[c] / l_safe;
      lse_p[at_row] = (mr == neg_inf ? T(0) : mr) + std::log(lr);
      max_p[at_row] = mr;
      inv_p[at_row] = lr == T(0) ? T(0) : T(1) / l_safe;
    }
  });
}

template <typename T>
void backward_kernel(const CallState& st, const at::Tensor& q, const at::Tensor& k,
                     const at::Tensor& v, const at::Tensor& dout, const at::Tensor& row_max,
                     const at::Tensor& inv_sum, const at::Tensor& delta, at::Tensor& dq_g,
                     at::Tensor& dk, at::Tensor& dv_g) {
  const Problem& p = st.problem;
  const TileMask& t = st.tiles;
  const int64_t heads = p.batch * p.kv_heads;
  const int64_t dqk = p.qk_dim, dv = p.v_dim;
  const T scale = static_cast<T>(p.scale);
  const T* kp = k.data_ptr<T>();
  const T* vp = v.data_ptr<T>();
  T* dk_p = dk.data_ptr<T>();
  T* dv_p = dv_g.data_ptr<T>();
  const GroupedRows<T> qrows(p, t, q, dqk, false), dorows(p, t, dout, dv, false);
  const GroupedRows<T> maxrows(p, t, row_max, 1, false), invrows(p, t, inv_sum, 1, false);
  const GroupedRows<T> deltarows(p, t, delta, 1, false);
  // dQ of a query block sums over kv blocks, which run on different threads: its rows for one
  // (batch, KV head) are updated under that pair's lock (concurrent units are mostly other
  // heads of the same kv block, so the locks rarely meet).
  GroupedRows<T> dqrows(p, t, dq_g, dqk, /*zero=*/true);
  const int64_t nqb = t.num_q_blocks();
  const int threads = at::get_num_threads();
  std::vector<std::mutex> dq_locks(heads * nqb);
  std::vector<BackwardScratch<T>> scratch(threads);
  auto order = by_work(t.num_kv_blocks(), [&](int64_t kb) { return visible_tiles_in_col(t, kb); });
  common::ScopedBlasThreads one_blas_thread(1);
  for_each_unit(heads * t.num_kv_blocks(), threads, [&](int64_t u, int64_t slot) {
    const int64_t kb = order[u / heads], hh = u % heads;
    const int64_t ks = kv_start(t, kb), ke = kv_end(p, t, kb), bk = ke - ks;
    auto& sc = scratch[slot];
    if (sc.s.empty()) {
      const int64_t tile = p.group * t.block_q() * t.block_kv();
      sc.s.resize(tile);
      sc.ds.resize(tile);
      sc.dk.resize(t.block_kv() * dqk);
      sc.dv.resize(t.block_kv() * dv);
    }
    const T* kblk = kp + (hh * p.kv_len + ks) * dqk;
    const T* vblk = vp + (hh * p.kv_len + ks) * dv;
    sc.k_t.reset(kblk, dqk, bk, dqk);
    sc.v_t.reset(vblk, dv, bk, dv);
    T *dk_acc = sc.dk.data(), *dv_acc = sc.dv.data();
    std::fill(dk_acc, dk_acc + bk * dqk, T(0));
    std::fill(dv_acc, dv_acc + bk * dv, T(0));
    for (int64_t qb = 0; qb < nqb; ++qb) {
      const BlockKind kind = t.kind(qb, kb);
      if (kind == BlockKind::kEmpty) continue;
      const auto tr = tile_rows(p, t, qb, kb);
      const int64_t rows = tr.rows;
      const T* qh = qrows.at(qb, hh);
      const T* doh = dorows.at(qb, hh);
      const auto ranges = row_ranges(tr, kind);
      T* s = sc.s.data();
      T* ds = sc.ds.data();
      const int64_t ld = bk;
      for (const auto& rr : ranges) {
        sc.k_t.gemm(rr.end - rr.first, rr.cols, scale, qh + rr.first * dqk, dqk, T(0),
                    s + rr.first * ld, ld);
      }
      if (kind == BlockKind::kPartial && t.user_masked(qb, kb)) {
        auto s_t = at::from_blob(s, {rows, bk}, q.options());
        t.apply_head(s_t, qb, kb, hh / p.kv_heads, hh % p.kv_heads);
      }
      detail::recompute_probs<T>(tr, s, maxrows.at(qb, hh), invrows.at(qb, hh));
      for (const auto& rr : ranges) {
        const int64_t n = rr.end - rr.first;
        detail::gemm(true, false, rr.cols, dv, n, T(1), s + rr.first * ld, ld, doh + rr.first * dv,
                     dv, T(1), dv_acc, dv);
        sc.v_t.gemm(n, rr.cols, T(1), doh + rr.first * dv, dv, T(0), ds + rr.first * ld, ld);
      }
      detail::softmax_grad<T>(tr, s, ds, deltarows.at(qb, hh));
      {
        std::lock_guard<std::mutex> lock(dq_locks[qb * heads + hh]);
        T* dq_h = dqrows.at(qb, hh);
        for (const auto& rr : ranges) {
          detail::gemm(false, false, rr.end - rr.first, dqk, rr.cols, scale, ds + rr.first * ld, ld,
                       kblk, dqk, T(1), dq_h + rr.first * dqk, dqk);
        }
      }
      for (const auto& rr : ranges) {
        detail::gemm(true, false, rr.cols, dqk, rr.end - rr.first, scale, ds + rr.first * ld, ld,
                     qh + rr.first * dqk, dqk, T(1), dk_acc, dqk);
      }
    }
    std::copy(dk_acc, dk_acc + bk * dqk, dk_p + (hh * p.kv_len + ks) * dqk);
    std::copy(dv_acc, dv_acc + bk * dv, dv_p + (hh * p.kv_len + ks) * dv);
  });
  dqrows.scatter(dq_g);
}

AttentionGrads run_backward(const CallState& st, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, const at::Tensor& dout, const at::Tensor& row_max,
                            const at::Tensor& inv_sum, const at::Tensor& delta,
                            at::ScalarType in_dtype);

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
    const auto& out = saved[3];
    const auto ct = st.problem.compute_dtype;
    auto dout = grads[0].defined() ? grads[0].to(ct).contiguous() : at::zeros_like(out);
    auto delta = (dout * out).sum(-1);  // [B, Nq, Sq]
    if (grads[1].defined()) delta = delta - grads[1].to(ct);
    const auto in_dtype = static_cast<at::ScalarType>(ctx->saved_data["in_dtype"].toInt());
    auto g =
        run_backward(st, saved[0], saved[1], saved[2], dout, saved[4], saved[5], delta, in_dtype);
    return {g.dq, g.dk, g.dv, at::Tensor()};
  }
};

// The backward kernel over compute-dtype contiguous q, k, v, dout and per-row statistics
// ([B, Nq, Sq]: p = exp(s - row_max) * inv_sum); grads in `in_dtype`.
AttentionGrads run_backward(const CallState& st, const at::Tensor& q, const at::Tensor& k,
                            const at::Tensor& v, const at::Tensor& dout, const at::Tensor& row_max,
                            const at::Tensor& inv_sum, const at::Tensor& delta,
                            at::ScalarType in_dtype) {
  const Problem& p = st.problem;
  auto dq_g = at::empty({p.batch, p.kv_heads, p.group, p.q_len, p.qk_dim}, q.options());
  auto dk = at::zeros_like(k);
  auto dv = at::zeros_like(v);
  if (p.compute_dtype == at::kDouble) {
    backward_kernel<double>(st, q, k, v, dout, row_max, inv_sum, delta, dq_g, dk, dv);
  } else {
    backward_kernel<float>(st, q, k, v, dout, row_max, inv_sum, delta, dq_g, dk, dv);
  }
  auto dq = dq_g.view({p.batch, p.q_heads, p.q_len, p.qk_dim}).to(in_dtype);
  return {dq, dk.to(in_dtype), dv.to(in_dtype)};
}

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

  bool offers_backward_from_stats() const override { return true; }
  // The custom backward with the whole call's statistics in place of this call's own: row max
  // = lse and row sum 1 give p = exp(s - lse); delta = rowsum(dout * out) of the merged out.
  AttentionGrads backward_from_stats(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                     const at::Tensor& out, const at::Tensor& lse,
                                     const at::Tensor& dout,
                                     const AttentionOptions& options) const override {
    auto p = detail::validate(q, k, v, options, "attention 'blockwise' (backward_from_stats)");
    const std::vector<int64_t> rows{p.batch, p.q_heads, p.q_len};
    const std::vector<int64_t> outs{p.batch, p.q_heads, p.q_len, p.v_dim};
    const bool given_delta = out.sizes() == rows;  // rowsum(dout * out), already reduced
    HP_CHECK((given_delta || out.sizes() == outs) && dout.sizes() == outs,
             "backward_from_stats: out ", out.sizes(), " and dout ", dout.sizes(),
             " must be [B, Nq, Sq, Dv] = ", at::IntArrayRef(outs),
             " (the merged output of the call q belongs to; out may also be its row sums against "
             "dout, [B, Nq, Sq])");
    HP_CHECK(lse.sizes() == rows, "backward_from_stats: lse ", lse.sizes(),
             " must be [B, Nq, Sq] = ", at::IntArrayRef(rows),
             " (the merged lse of the call q belongs to)");
    auto st = c10::make_intrusive<CallState>(std::move(p), options.block_q, options.block_kv);
    const auto ct = st->problem.compute_dtype;
    auto c = [ct](const at::Tensor& x) { return x.detach().to(ct).contiguous(); };
    auto d = c(dout);
    auto delta = given_delta ? c(out) : (d * out.detach().to(ct)).sum(-1);
    auto row_max = c(lse);
    return run_backward(*st, c(q), c(k), c(v), d, row_max, at::ones_like(row_max), delta,
                        q.scalar_type());
  }
};

}  // namespace

std::unique_ptr<AttentionPrimitive> make_blockwise_attention() {
  return std::make_unique<BlockwiseAttention>();
}

}  // namespace hp::attention
