// DSA's kernels (see the header): selection by blocks of queries with a threshold top-k (ties to
// the lower position), the sparse MQA attention and the indexer loss as autograd nodes over
// the fused per-query kernels of dsa_sparse_kernel.h (the attention's backward recomputes each
// query's scores from the forward's lse; the loss's gradients are computed with it).
#include "hp/attention/dsa.h"

#include <cmath>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include "dsa_sparse_kernel.h"
#include "hp/common/check.h"
#include "hp/common/threads.h"
#include "parallel_units.h"

namespace hp::attention {
namespace {

using detail::for_each_unit;

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// fn(b, t0, n, slot) for every (batch row, query block) in parallel, BLAS on one thread each.
template <typename Fn>
void for_each_block(int64_t batch, int64_t sq, int64_t block_q, const Fn& fn) {
  const int64_t blocks = (sq + block_q - 1) / block_q;
  common::ScopedBlasThreads one_blas_thread(1);
  for_each_unit(batch * blocks, at::get_num_threads(), [&](int64_t u, int64_t slot) {
    const int64_t b = u / blocks, t0 = (u % blocks) * block_q;
    fn(b, t0, std::min(block_q, sq - t0), slot);
  });
}

// Per-slot accumulators of a gradient scattered into rows (adding from several threads
// would race): slot i's own zeros, summed at the end.
class SlotSums {
 public:
  SlotSums(const at::Tensor& like, int threads) : like_(like), parts_(threads) {}
  at::Tensor& at_slot(int64_t slot) {
    if (!parts_[slot].defined()) parts_[slot] = at::zeros_like(like_);
    return parts_[slot];
  }
  at::Tensor sum() const {
    at::Tensor total;
    for (const auto& p : parts_) {
      if (p.defined()) total = total.defined() ? total.add_(p) : p;
    }
    return total.defined() ? total : at::zeros_like(like_);
  }

 private:
  at::Tensor like_;
  std::vector<at::Tensor> parts_;
};

// Sparse MQA attention over selected keys (dsa_sparse_kernel.h); backward recomputes each
// query's scores from the kept lse.
detail::SparseMQADims sparse_dims(const at::Tensor& q, const at::Tensor& indices,
                                  int64_t value_dim) {
  return {q.size(2), q.size(3), value_dim, indices.size(2)};
}

struct SparseMQAFn : torch::autograd::Function<SparseMQAFn> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q_in,
                               const at::Tensor& kv_in, const at::Tensor& indices_in,
                               int64_t value_dim, double scale, int64_t block_q) {
    auto q = q_in.contiguous(), kv = kv_in.contiguous(), indices = indices_in.contiguous();
    const int64_t batch = q.size(0), sq = q.size(1), heads = q.size(2), k = indices.size(2);
    const int64_t c = q.size(3), skv = kv.size(1);
    const auto dims = sparse_dims(q, indices, value_dim);
    auto out = at::empty({batch, sq, heads, value_dim}, q.options());
    auto lse = at::empty({batch, sq, heads}, q.options());
    auto p_mean = at::empty({batch, sq, k}, q.options());
    AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "dsa_sparse_mqa_forward", [&] {
      const auto* qp = q.data_ptr<scalar_t>();
      const auto* kvp = kv.data_ptr<scalar_t>();
      const auto* ip = indices.data_ptr<int64_t>();
      auto* op = out.data_ptr<scalar_t>();
      auto* lp = lse.data_ptr<scalar_t>();
      auto* pp = p_mean.data_ptr<scalar_t>();
      for_each_block(batch, sq, block_q, [&](int64_t b, int64_t t0, int64_t n, int64_t) {
        const int64_t row = b * sq + t0;
        detail::sparse_mqa_forward(dims, scale, n, qp + row * heads * c, ip + row * k,
                                   kvp + b * skv * c, op + row * heads * value_dim,
                                   lp + row * heads, pp + row * k);
      });
    });
    ctx->save_for_backward({q, kv, indices, out, lse});
    ctx->saved_data["value_dim"] = value_dim;
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["block_q"] = block_q;
    ctx->mark_non_differentiable({p_mean});
    return {out, p_mean};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const auto &q = saved[0], &kv = saved[1], &indices = saved[2], &out = saved[3], &lse = saved[4];
    const int64_t value_dim = ctx->saved_data["value_dim"].toInt();
    const double scale = ctx->saved_data["scale"].toDouble();
    const int64_t block_q = ctx->saved_data["block_q"].toInt();
    auto dout = grads[0].defined() ? grads[0].contiguous() : at::zeros_like(out);
    auto dq = at::empty_like(q);
    SlotSums dkv(kv, at::get_num_threads());
    const int64_t batch = q.size(0), sq = q.size(1), heads = q.size(2), k = indices.size(2);
    const int64_t c = q.size(3), skv = kv.size(1);
    const auto dims = sparse_dims(q, indices, value_dim);
    AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "dsa_sparse_mqa_backward", [&] {
      const auto* qp = q.data_ptr<scalar_t>();
      const auto* kvp = kv.data_ptr<scalar_t>();
      const auto* ip = indices.data_ptr<int64_t>();
      const auto* op = out.data_ptr<scalar_t>();
      const auto* dop = dout.data_ptr<scalar_t>();
      const auto* lp = lse.data_ptr<scalar_t>();
      auto* dqp = dq.data_ptr<scalar_t>();
      for_each_block(batch, sq, block_q, [&](int64_t b, int64_t t0, int64_t n, int64_t slot) {
        const int64_t row = b * sq + t0;
        auto* dkvp = dkv.at_slot(slot).data_ptr<scalar_t>() + b * skv * c;
        detail::sparse_mqa_backward(dims, scale, n, qp + row * heads * c, ip + row * k,
                                    kvp + b * skv * c, op + row * heads * value_dim,
                                    dop + row * heads * value_dim, lp + row * heads,
                                    dqp + row * heads * c, dkvp);
      });
    });
    return {dq, dkv.sum(), at::Tensor(), at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// The indexer loss; its gradient is computed in forward (the loss is a scalar) and scaled by
// the incoming gradient in backward.
struct IndexerLossFn : torch::autograd::Function<IndexerLossFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& q_in, const at::Tensor& w_in,
                            const at::Tensor& k_in, const at::Tensor& indices_in,
                            const at::Tensor& p_in, int64_t block_q) {
    auto q = q_in.contiguous(), w = w_in.contiguous(), k = k_in.contiguous();
    auto indices = indices_in.contiguous(), p = p_in.to(q.scalar_type()).contiguous();
    const int64_t batch = q.size(0), sq = q.size(1), heads = q.size(2), d = k.size(2);
    const int64_t skv = k.size(1), topk = indices.size(2);
    const detail::IndexerDims dims{heads, d, topk};
    auto dq = at::empty_like(q), dw = at::empty_like(w);
    const int threads = at::get_num_threads();
    SlotSums dk(k, threads);
    std::vector<double> totals(threads, 0.0);
    AT_DISPATCH_FLOATING_TYPES(q.scalar_type(), "dsa_indexer_loss", [&] {
      const auto* qp = q.data_ptr<scalar_t>();
      const auto* wp = w.data_ptr<scalar_t>();
      const auto* kp = k.data_ptr<scalar_t>();
      const auto* ip = indices.data_ptr<int64_t>();
      const auto* pp = p.data_ptr<scalar_t>();
      auto* dqp = dq.data_ptr<scalar_t>();
      auto* dwp = dw.data_ptr<scalar_t>();
      for_each_block(batch, sq, block_q, [&](int64_t b, int64_t t0, int64_t n, int64_t slot) {
        const int64_t row = b * sq + t0;
        auto* dkp = dk.at_slot(slot).data_ptr<scalar_t>() + b * skv * d;
        totals[slot] += detail::indexer_loss_rows(
            dims, n, qp + row * heads * d, wp + row * heads, ip + row * topk, kp + b * skv * d,
            pp + row * topk, dqp + row * heads * d, dwp + row * heads, dkp);
      });
    });
    ctx->save_for_backward({dq, dw, dk.sum()});
    double total = 0;
    for (double t : totals)
      total += t;
    return at::full({}, total, q.options());
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    auto g = grads[0];
    return {saved[0] * g, saved[1] * g, saved[2] * g, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

}  // namespace

void DSAOptions::check(const std::string& who) const {
  HP_CHECK(topk >= 1, who, ": DSA topk=", topk, " must be >= 1");
  HP_CHECK(loss == "sparse" || loss == "dense", who, ": DSA index loss '", loss,
           "' is not valid; valid: sparse, dense");
  HP_CHECK(block_q >= 1, who, ": DSA block_q=", block_q, " must be >= 1");
  HP_CHECK(layout == "BSND" || layout == "BNSD", who, ": DSA layout '", layout,
           "' is not valid; valid: BSND (q [B, S, H, dq]), BNSD (q [B, H, S, dq])");
}

at::Tensor dsa_bsnd_view(const at::Tensor& t, const std::string& layout) {
  return layout == "BNSD" && t.defined() ? t.transpose(1, 2) : t;
}

DSAIndexer dsa_bsnd_view(const DSAIndexer& index, const std::string& layout) {
  return {dsa_bsnd_view(index.q, layout), dsa_bsnd_view(index.w, layout), index.k};
}

at::Tensor dsa_select(const DSAIndexer& index, int64_t q_offset, int64_t topk, int64_t block_q) {
  at::NoGradGuard no_grad;
  const int64_t batch = index.q.size(0), sq = index.q.size(1), skv = index.k.size(1);
  topk = std::min(topk, skv);
  auto out = at::empty({batch, sq, topk}, index.q.options().dtype(at::kLong));
  const int64_t heads = index.q.size(2), dim = index.q.size(3);
  // Keys are scored in chunks whose [n * H_I, chunk] dot products stay in cache while they are
  // reduced into the rows' scores; one buffer of each per thread, reused by its blocks (fresh
  // tensors would fault their pages in again for every block).
  constexpr int64_t kChunk = 2048;
  std::vector<at::Tensor> dots(at::get_num_threads()), scores(at::get_num_threads());
  for_each_block(batch, sq, block_q, [&](int64_t b, int64_t t0, int64_t n, int64_t slot) {
    auto qb = index.q.select(0, b).narrow(0, t0, n).reshape({n * heads, dim});
    auto wc = index.w.select(0, b).narrow(0, t0, n).contiguous();
    // Keys past the block's last query are never visible: score the causal prefix only.
    const int64_t width = std::min(skv, q_offset + t0 + n);
    if (!dots[slot].defined()) {
      dots[slot] = at::empty({block_q * heads * std::min(kChunk, skv)}, qb.options());
      scores[slot] = at::empty({block_q * skv}, qb.options());
    }
    auto block = out.select(0, b).narrow(0, t0, n);
    AT_DISPATCH_FLOATING_TYPES(qb.scalar_type(), "dsa_select", [&] {
      auto* sp = scores[slot].data_ptr<scalar_t>();
      // Row r sees the keys 0..q_offset + t0 + r (never past Skv).
      auto visible = [&](int64_t r) { return std::min(width, q_offset + t0 + r + 1); };
      for (int64_t c0 = 0; c0 < width; c0 += kChunk) {
        const int64_t cw = std::min(kChunk, width - c0);
        auto a = dots[slot].narrow(0, 0, n * heads * cw).view({n * heads, cw});
        at::mm_out(a, qb, index.k.select(0, b).narrow(0, c0, cw).t());
        for (int64_t r = 0; r < n; ++r) {
          const int64_t len = std::min(cw, visible(r) - c0);
          if (len <= 0) continue;
          detail::index_scores(a.data_ptr<scalar_t>() + r * heads * cw, heads, cw,
                               wc.data_ptr<scalar_t>() + r * heads, len, sp + r * width + c0);
        }
      }
      for (int64_t r = 0; r < n; ++r) {
        detail::top_k_positions(sp + r * width, visible(r), topk,
                                block.data_ptr<int64_t>() + r * topk);
      }
    });
  });
  return out;
}

at::Tensor dsa_all_visible(int64_t batch, int64_t sq, int64_t skv, int64_t q_offset) {
  const int64_t width = std::min(skv, q_offset + sq);
  auto cols = at::arange(width, at::kLong).unsqueeze(0);
  auto rows = at::arange(q_offset, q_offset + sq, at::kLong).unsqueeze(1);
  auto idx = at::where(cols.le(rows), cols, at::full({}, -1, at::kLong));
  return idx.unsqueeze(0).expand({batch, sq, width}).contiguous();
}

at::Tensor dsa_absorb_queries(const at::Tensor& q, const at::Tensor& w_ukv, const MLAShape& shape) {
  const int64_t per_head = shape.d_nope + shape.d_v;
  auto w = w_ukv.view({shape.heads, per_head, shape.kv_rank});
  auto w_k = w.narrow(1, 0, shape.d_nope);  // [H, dn, R]
  auto q_nope = q.narrow(-1, 0, shape.d_nope);
  auto absorbed = at::einsum("bshd,hdr->bshr", {q_nope, w_k});
  return at::cat({absorbed, q.narrow(-1, shape.d_nope, shape.d_rope)}, -1);
}

namespace {

// The fused kernels read rows by index without bounds checks: shapes, dtypes and every index
// are checked here, once per call.
void check_selection(const char* who, const at::Tensor& q, const at::Tensor& keys,
                     const at::Tensor& indices) {
  HP_CHECK(q.dim() == 4 && keys.dim() == 3 && indices.dim() == 3 && q.size(0) == keys.size(0) &&
               indices.size(0) == q.size(0) && indices.size(1) == q.size(1) &&
               q.size(3) == keys.size(2),
           who, ": expected queries [B, Sq, H, C], keys [B, Skv, C] and indices [B, Sq, k]; got ",
           q.sizes(), ", ", keys.sizes(), ", ", indices.sizes());
  HP_CHECK(q.scalar_type() == keys.scalar_type() &&
               (q.scalar_type() == at::kFloat || q.scalar_type() == at::kDouble),
           who, ": queries and keys must both be float32 or both float64, got ", q.scalar_type(),
           " and ", keys.scalar_type());
  HP_CHECK(indices.scalar_type() == at::kLong, who, ": indices must be int64, got ",
           indices.scalar_type());
  if (indices.numel() == 0) return;
  const int64_t top = indices.max().item<int64_t>();
  HP_CHECK(top < keys.size(1), who, ": index ", top, " is past the ", keys.size(1),
           " keys; indices are key positions 0..Skv-1 (-1: no key)");
  const int64_t low = indices.min().item<int64_t>();
  HP_CHECK(low >= -1, who, ": index ", low, " is not a key position; use -1 for an empty slot");
}

}  // namespace

void dsa_sparse_mqa(const at::Tensor& q_abs, const at::Tensor& kv, const at::Tensor& indices,
                    int64_t value_dim, double scale, int64_t block_q, at::Tensor& out,
                    at::Tensor& p_mean) {
  check_selection("dsa_sparse_mqa", q_abs, kv, indices);
  HP_CHECK(value_dim >= 1 && value_dim <= kv.size(2), "dsa_sparse_mqa: value_dim=", value_dim,
           " must be in [1, ", kv.size(2), "] (the values are the first columns of a kv row)");
  auto res = SparseMQAFn::apply(q_abs, kv, indices, value_dim, scale, block_q);
  out = res[0];
  p_mean = res[1];
}

at::Tensor dsa_indexer_loss(const DSAIndexer& index, const at::Tensor& indices, const at::Tensor& p,
                            int64_t block_q) {
  check_selection("dsa_indexer_loss", index.q, index.k, indices);
  HP_CHECK(index.w.dim() == 3 && index.w.size(0) == index.q.size(0) &&
               index.w.size(1) == index.q.size(1) && index.w.size(2) == index.q.size(2) &&
               index.w.scalar_type() == index.q.scalar_type(),
           "dsa_indexer_loss: w must be [B, Sq, H_I] ", index.q.scalar_type(), ", got ",
           index.w.sizes(), " ", index.w.scalar_type());
  HP_CHECK(p.sizes() == indices.sizes(), "dsa_indexer_loss: targets p ", p.sizes(),
           " must match indices ", indices.sizes());
  return IndexerLossFn::apply(index.q, index.w, index.k, indices, p.detach(), block_q);
}

DSAResult dsa_attention(const at::Tensor& q, const at::Tensor& latent, const at::Tensor& k_rope,
                        const at::Tensor& w_ukv, const MLAShape& shape, const DSAIndexer& index,
                        int64_t q_offset, const DSAOptions& options) {
  options.check("dsa_attention");
  if (options.layout != "BSND") {  // the kernels read BSND; the output goes back
    auto bsnd = options;
    bsnd.layout = "BSND";
    auto r = dsa_attention(dsa_bsnd_view(q, options.layout).contiguous(), latent, k_rope, w_ukv,
                           shape, dsa_bsnd_view(index, options.layout), q_offset, bsnd);
    r.out = r.out.transpose(1, 2);
    return r;
  }
  HP_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kDouble,
           "dsa_attention: DSA's kernels take float32 or float64 tensors, got ", q.scalar_type(),
           "; convert the inputs");
  DSAResult r;
  r.indices = dsa_select(index, q_offset, options.topk, options.block_q);
  const auto attend = options.loss == "dense"
                          ? dsa_all_visible(q.size(0), q.size(1), latent.size(1), q_offset)
                          : r.indices;
  auto kv = at::cat({latent, k_rope.to(latent.scalar_type())}, -1);
  at::Tensor out_latent, p_mean;
  dsa_sparse_mqa(dsa_absorb_queries(q, w_ukv, shape), kv, attend, shape.kv_rank,
                 1.0 / std::sqrt(static_cast<double>(shape.qk_dim())), options.block_q, out_latent,
                 p_mean);
  const int64_t per_head = shape.d_nope + shape.d_v;
  auto w_v = w_ukv.view({shape.heads, per_head, shape.kv_rank}).narrow(1, shape.d_nope, shape.d_v);
  r.out = at::einsum("bshr,hvr->bshv", {out_latent, w_v});
  r.loss = dsa_indexer_loss(index, attend, p_mean, options.block_q);
  return r;
}

void DSAHost::install(std::shared_ptr<DSAInterceptor> interceptor) {
  HP_CHECK(interceptor != nullptr, "DSAHost::install: interceptor is null");
  if (interceptor_) {
    HP_CHECK(interceptor_->id() == interceptor->id(),
             "a different CP strategy is already installed on this DSA layer: installed '",
             interceptor_->id(), "', new '", interceptor->id(),
             "'. Apply context parallelism once per layer (re-applying the same plan is fine)");
    return;
  }
  interceptor_ = std::move(interceptor);
}

DSAResult DSAHost::attend(const DSAQueriesFn& queries, const at::Tensor& latent,
                          const at::Tensor& k_rope, const at::Tensor& w_ukv, const MLAShape& shape,
                          const at::Tensor& index_k, const DSAOptions& options) {
  if (interceptor_) {
    return interceptor_->attend(queries, latent, k_rope, w_ukv, shape, index_k, options);
  }
  const auto qs = queries();
  return dsa_attention(qs.q, latent, k_rope, w_ukv, shape, {qs.index_q, qs.index_w, index_k}, 0,
                       options);
}

}  // namespace hp::attention
