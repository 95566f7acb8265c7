// DSA under CP: the all-gather family (see cp/dsa.h).
//
//   sync:   the layer's query projections (every input checked), gather k_I, gather
//           [latent | k_rope] (blocking), then per query part: select, absorb q, sparse
//           attention, loss
//   async:  start both gathers as soon as the keys are handed over; the layer's query
//           projections and their absorption into the latent space run while they travel;
//           wait; per query part: select, sparse attention, loss
//   out / indices: the parts concatenated in the shard's order; the loss summed over parts.
//   Both gathered tensors are anchored into the output, so every rank reduce-scatters both
//   gradients in backward, in the same order.
#include "hp/cp/dsa.h"

#include <cmath>

#include <ATen/ATen.h>

#include "hp/comm/async_transfer.h"
#include "hp/common/check.h"
#include "hp/cp/sequence.h"
#include "hp/cp/strategy.h"
#include "strategy_pieces.h"

namespace hp::cp {

void check_dsa_cp(const std::string& who, const attention::DSAOptions& dsa,
                  const DSACPOptions& options, const at::Tensor& q, const at::Tensor& latent,
                  const at::Tensor& k_rope, const attention::DSAIndexer& index, int64_t cp_size) {
  dsa.check(who);
  HP_CHECK(q.defined() && q.dim() == 4, who, ": DSA takes 4-D queries in its layout ", dsa.layout,
           ": q must be ", dsa.layout == "BSND" ? "[B, S, H, " : "[B, H, S, ",
           "d_nope + d_rope], got ", q.defined() ? q.sizes() : at::IntArrayRef{});
  if (dsa.layout != "BSND") {  // checked as the BSND views the kernels read
    auto bsnd = dsa;
    bsnd.layout = "BSND";
    check_dsa_cp(who + " (" + dsa.layout + " read as BSND)", bsnd, options,
                 attention::dsa_bsnd_view(q, dsa.layout), latent, k_rope,
                 attention::dsa_bsnd_view(index, dsa.layout), cp_size);
    return;
  }
  const int64_t b = q.size(0), s = q.size(1);
  HP_CHECK(q.scalar_type() == at::kFloat || q.scalar_type() == at::kDouble, who,
           ": DSA's kernels take float32 or float64 tensors, got ", q.scalar_type(),
           "; convert the inputs");
  HP_CHECK(latent.dim() == 3 && latent.size(0) == b && latent.size(1) == s, who, ": latent ",
           latent.sizes(), " must be [B=", b, ", S=", s, ", kv_rank]");
  HP_CHECK(k_rope.dim() == 3 && k_rope.size(0) == b && k_rope.size(1) == s, who, ": k_rope ",
           k_rope.sizes(), " must be [B=", b, ", S=", s, ", d_rope]");
  HP_CHECK(index.q.defined() && index.q.dim() == 4 && index.q.size(0) == b && index.q.size(1) == s,
           who, ": q_index must be [B=", b, ", S=", s, ", H_I, d_I]");
  HP_CHECK(index.w.defined() && index.w.dim() == 3 && index.w.size(0) == b &&
               index.w.size(1) == s && index.w.size(2) == index.q.size(2),
           who, ": w_index ", index.w.sizes(), " must be [B=", b, ", S=", s,
           ", H_I=", index.q.size(2), "]");
  HP_CHECK(index.k.defined() && index.k.dim() == 3 && index.k.size(0) == b &&
               index.k.size(1) == s && index.k.size(2) == index.q.size(3),
           who, ": k_index ", index.k.sizes(), " must be [B=", b, ", S=", s,
           ", d_I=", index.q.size(3), "]");
  if (options.load_balance && cp_size > 1) {
    HP_CHECK(s % 2 == 0, who, ": head-tail load balance needs an even local sequence length, got ",
             s, "; pad the sequence to a multiple of 2 * cp = ", 2 * cp_size);
  }
}

namespace {

// The keys' own checks (the latent, k_rope and the index keys agree in B and S), before any
// collective; the queries are checked with them by check_dsa_cp once they exist.
void check_dsa_keys(const std::string& who, const attention::DSAOptions& dsa,
                    const at::Tensor& latent, const at::Tensor& k_rope, const at::Tensor& index_k) {
  dsa.check(who);
  HP_CHECK(latent.defined() && latent.dim() == 3, who, ": latent must be [B, S, kv_rank], got ",
           latent.defined() ? latent.sizes() : at::IntArrayRef{});
  const int64_t b = latent.size(0), s = latent.size(1);
  HP_CHECK(k_rope.defined() && k_rope.dim() == 3 && k_rope.size(0) == b && k_rope.size(1) == s, who,
           ": k_rope ", k_rope.defined() ? k_rope.sizes() : at::IntArrayRef{}, " must be [B=", b,
           ", S=", s, ", d_rope]");
  HP_CHECK(index_k.defined() && index_k.dim() == 3 && index_k.size(0) == b && index_k.size(1) == s,
           who, ": k_index ", index_k.defined() ? index_k.sizes() : at::IntArrayRef{},
           " must be [B=", b, ", S=", s, ", d_I]");
}

}  // namespace

attention::DSAResult dsa_attention_cp(const at::Tensor& q, const at::Tensor& latent,
                                      const at::Tensor& k_rope, const at::Tensor& w_ukv,
                                      const attention::MLAShape& shape,
                                      const attention::DSAIndexer& index,
                                      const attention::DSAOptions& dsa, const DSACPOptions& options,
                                      const CPTopology& topology) {
  check_dsa_cp("DSA CP", dsa, options, q, latent, k_rope, index, topology.cp_size);
  return dsa_attention_cp(
      [&] {
        return attention::DSAQueries{q, index.q, index.w};
      },
      latent, k_rope, w_ukv, shape, index.k, dsa, options, topology);
}

attention::DSAResult dsa_attention_cp(const attention::DSAQueriesFn& queries,
                                      const at::Tensor& latent, const at::Tensor& k_rope,
                                      const at::Tensor& w_ukv, const attention::MLAShape& shape,
                                      const at::Tensor& index_k, const attention::DSAOptions& dsa,
                                      const DSACPOptions& options, const CPTopology& topology) {
  const int64_t p = topology.cp_size, r = topology.cp_rank;
  check_dsa_keys("DSA CP", dsa, latent, k_rope, index_k);
  // The queries, checked with the keys, as the BSND views the kernels read; the output goes
  // back to the options' layout.
  auto bsnd = dsa;
  bsnd.layout = "BSND";
  auto project = [&] {
    const auto qs = queries();
    check_dsa_cp("DSA CP", dsa, options, qs.q, latent, k_rope, {qs.index_q, qs.index_w, index_k},
                 p);
    return attention::DSAQueries{attention::dsa_bsnd_view(qs.q, dsa.layout).contiguous(),
                                 attention::dsa_bsnd_view(qs.index_q, dsa.layout),
                                 attention::dsa_bsnd_view(qs.index_w, dsa.layout)};
  };
  auto in_layout = [&](attention::DSAResult res) {
    if (dsa.layout != "BSND") res.out = res.out.transpose(1, 2);
    return res;
  };
  if (p == 1) {
    const auto qs = project();
    return in_layout(attention::dsa_attention(qs.q, latent, k_rope, w_ukv, shape,
                                              {qs.index_q, qs.index_w, index_k}, 0, bsnd));
  }
  const bool async = options.schedule == CPSchedule::kAsync;
  attention::DSAQueries qs;
  if (!async) qs = project();  // sync: every input checked before any collective
  auto kv_local = at::cat({latent, k_rope.to(latent.scalar_type())}, -1).contiguous();
  auto k_flight = comm::all_gather_start(index_k.contiguous(), 1, topology.cp);
  at::Tensor q_abs;
  at::Tensor k_all, kv_all;
  if (async) {
    auto kv_flight = comm::all_gather_start(kv_local, 1, topology.cp);
    // While the keys travel: the layer's query projections, then their absorption.
    qs = project();
    q_abs = attention::dsa_absorb_queries(qs.q, w_ukv, shape);
    k_all = k_flight.wait();
    kv_all = kv_flight.wait();
  } else {
    k_all = k_flight.wait();
    kv_all = comm::all_gather_start(kv_local, 1, topology.cp).wait();
    q_abs = attention::dsa_absorb_queries(qs.q, w_ukv, shape);
  }
  const int64_t s = qs.q.size(1);
  if (options.load_balance) {
    k_all = detail::natural_order(k_all, p, 1);
    kv_all = detail::natural_order(kv_all, p, 1);
  }
  struct Part {
    int64_t begin, len, offset;  // rows of the shard, their global position
  };
  std::vector<Part> parts;
  if (options.load_balance) {
    const int64_t c = s / 2;
    auto ids = load_balance_chunks(r, p);
    parts.push_back({0, c, ids[0] * c});
    parts.push_back({c, c, ids[1] * c});
  } else {
    parts.push_back({0, s, r * s});
  }
  const int64_t total = k_all.size(1);
  const double scale = 1.0 / std::sqrt(static_cast<double>(shape.qk_dim()));
  std::vector<at::Tensor> outs, selections;
  at::Tensor loss;
  for (const auto& part : parts) {
    attention::DSAIndexer mine{qs.index_q.narrow(1, part.begin, part.len),
                               qs.index_w.narrow(1, part.begin, part.len), k_all};
    auto selected = attention::dsa_select(mine, part.offset, bsnd.topk, bsnd.block_q);
    auto attend = bsnd.loss == "dense"
                      ? attention::dsa_all_visible(qs.q.size(0), part.len, total, part.offset)
                      : selected;
    at::Tensor out_latent, p_mean;
    attention::dsa_sparse_mqa(q_abs.narrow(1, part.begin, part.len), kv_all, attend, shape.kv_rank,
                              scale, bsnd.block_q, out_latent, p_mean);
    outs.push_back(out_latent);
    selections.push_back(selected);
    auto part_loss = attention::dsa_indexer_loss(mine, attend, p_mean, bsnd.block_q);
    loss = loss.defined() ? loss + part_loss : part_loss;
  }
  auto out_latent = outs.size() == 1 ? outs[0] : at::cat(outs, 1);
  out_latent = anchored(out_latent, {kv_all});
  loss = anchored(loss, {k_all});
  const int64_t per_head = shape.d_nope + shape.d_v;
  auto w_v = w_ukv.view({shape.heads, per_head, shape.kv_rank}).narrow(1, shape.d_nope, shape.d_v);
  attention::DSAResult res;
  res.out = at::einsum("bshr,hvr->bshv", {out_latent, w_v});
  res.loss = loss;
  // Every part selects from the same S keys: the widths, min(topk, S), agree.
  res.indices = selections.size() == 1 ? selections[0] : at::cat(selections, 1);
  return in_layout(res);
}

namespace {

class DSACPInterceptor final : public attention::DSAInterceptor {
 public:
  DSACPInterceptor(std::string path, DSACPOptions options,
                   std::shared_ptr<const CPTopology> topology)
      : path_(std::move(path)), options_(options), topology_(std::move(topology)) {}
  std::string id() const override {
    return common::str_cat("dsa-cp:", path_, ":", to_string(options_.schedule),
                           options_.load_balance ? ":lb:" : ":", topology_->id());
  }
  attention::DSAResult attend(const attention::DSAQueriesFn& queries, const at::Tensor& latent,
                              const at::Tensor& k_rope, const at::Tensor& w_ukv,
                              const attention::MLAShape& shape, const at::Tensor& index_k,
                              const attention::DSAOptions& options) override {
    return dsa_attention_cp(queries, latent, k_rope, w_ukv, shape, index_k, options, options_,
                            *topology_);
  }

 private:
  std::string path_;
  DSACPOptions options_;
  std::shared_ptr<const CPTopology> topology_;
};

}  // namespace

std::string apply_dsa_cp(attention::DSAHost& host, const std::string& module_path,
                         const DSACPOptions& options,
                         const std::shared_ptr<const CPTopology>& topology) {
  HP_CHECK(topology != nullptr, "apply_dsa_cp('", module_path,
           "'): no CP topology; build one with CPTopology::build at apply time");
  host.install(std::make_shared<DSACPInterceptor>(module_path, options, topology));
  return common::str_cat(
      "DSA CP: module=", module_path, " strategy=all_gather schedule=", to_string(options.schedule),
      options.load_balance ? " load_balance" : "", " cp_size=", topology->cp_size);
}

int64_t dsa_forward_bytes_per_rank(const attention::MLAShape& shape, int64_t index_dim,
                                   int64_t batch, int64_t seq, int64_t cp_size,
                                   int64_t element_size) {
  return (cp_size - 1) * batch * (seq / cp_size) * (index_dim + shape.kv_rank + shape.d_rope) *
         element_size;
}

}  // namespace hp::cp
