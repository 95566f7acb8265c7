// MLA, strategy latent_all_gather: the compressed latent travels, not the expanded K/V.
//
//   packed [latent | k_rope]  [B, s, R+dr]  --all-gather(seq)-->  [B, P*s, R+dr]  (rank order;
//                                            natural order with load balance)
//   parts: this rank's query rows with their global offset o (one part; head-tail: two, chunks
//          2r and 2P-2r-1 of c = s/2 rows)
//   sync:  keys = expand(gathered[0, max(o + len)))  (W_ukv for every head)
//          part out = attend(q_part, keys[0, o + len), causal, offset o)
//   async: start the gather; q = queries() while it travels;
//          diag_i = attend(q_i, expand(local rows of part i), causal, offset 0)   (local first)
//          wait; prefix = expand(gathered[0, max o)); rest_i = attend(q_i, prefix[0, o_i), dense)
//          part out = merge_by_lse(diag_i, rest_i)
//   out = parts concatenated (the shard's order), anchored to the gathered tensor so every rank
//   runs the reduce-scatter of its gradient in backward.
#include <ATen/ATen.h>

#include "hp/comm/async_transfer.h"
#include "hp/common/check.h"
#include "hp/cp/mla.h"
#include "hp/cp/sequence.h"
#include "hp/cp/strategy.h"
#include "strategy_pieces.h"

namespace hp::cp::detail {
namespace {

struct QueryRows {
  at::Tensor q, latent, k_rope;  // this part's rows (BSHD q; [B, len, .] latent and rope)
  int64_t offset = 0;            // global position of the first row
  int64_t len() const { return q.size(1); }
};

attention::MLAKeys first_keys(const attention::MLAKeys& keys, int64_t n) {
  return {keys.k.narrow(2, 0, n), keys.v.narrow(2, 0, n)};
}

}  // namespace

at::Tensor mla_latent_all_gather(const std::function<at::Tensor()>& queries,
                                 const at::Tensor& latent, const at::Tensor& k_rope,
                                 const at::Tensor& w_ukv, const attention::MLAShape& shape,
                                 const MLACPOptions& options, const CPTopology& topology) {
  const int64_t p = topology.cp_size, r = topology.cp_rank, s = latent.size(1);
  const int64_t rank_dim = shape.kv_rank;
  const bool async = options.schedule == CPSchedule::kAsync;
  const auto& primitive = attention::AttentionRegistry::builtin().get(options.primitive);
  auto packed = at::cat({latent, k_rope.to(latent.scalar_type())}, -1).contiguous();
  at::Tensor q;
  if (!async) q = queries();
  auto flight = comm::all_gather_start(packed, 1, topology.cp);
  if (async) q = queries();
  HP_CHECK(q.dim() == 4 && q.size(0) == latent.size(0) && q.size(1) == s &&
               q.size(2) == shape.heads && q.size(3) == shape.qk_dim(),
           "MLA CP (latent_all_gather): q ", q.sizes(), " must be [B, S/P=", s,
           ", H=", shape.heads, ", d_nope + d_rope=", shape.qk_dim(), "]");
  std::vector<QueryRows> parts;
  if (options.load_balance) {
    const int64_t c = s / 2;
    auto ids = load_balance_chunks(r, p);
    for (int i = 0; i < 2; ++i) {
      parts.push_back({q.narrow(1, i * c, c), latent.narrow(1, i * c, c),
                       k_rope.narrow(1, i * c, c), ids[i] * c});
    }
  } else {
    parts.push_back({q, latent, k_rope, r * s});
  }
  std::vector<attention::AttentionResult> diag;
  if (async) {
    for (const auto& part : parts) {
      auto keys = attention::mla_expand(part.latent, part.k_rope, w_ukv, shape, 0, shape.heads);
      diag.push_back(attention::mla_attend(part.q, keys, shape, true, 0, primitive));
    }
  }
  auto gathered = flight.wait();  // [B, P*s, R+dr]
  if (options.load_balance) gathered = natural_order(gathered, p, 1);
  int64_t needed = 0;
  for (const auto& part : parts)
    needed = std::max(needed, async ? part.offset : part.offset + part.len());
  attention::MLAKeys keys;
  if (needed > 0) {
    auto rows = gathered.narrow(1, 0, needed);
    keys = attention::mla_expand(rows.narrow(2, 0, rank_dim),
                                 rows.narrow(2, rank_dim, shape.d_rope).to(k_rope.scalar_type()),
                                 w_ukv, shape, 0, shape.heads);
  }
  const QKVLayout bnsd{2, 1};
  std::vector<at::Tensor> outs;
  for (size_t i = 0; i < parts.size(); ++i) {
    const auto& part = parts[i];
    if (!async) {
      outs.push_back(attention::mla_attend(part.q, first_keys(keys, part.offset + part.len()),
                                           shape, true, part.offset, primitive)
                         .out);
    } else if (part.offset == 0) {
      outs.push_back(diag[i].out);
    } else {
      auto rest =
          attention::mla_attend(part.q, first_keys(keys, part.offset), shape, false, 0, primitive);
      outs.push_back(merge_by_lse({diag[i], rest}, bnsd));
    }
  }
  auto out = outs.size() == 1 ? outs[0] : at::cat(outs, 2);  // [B, H, s, dv]
  return anchored(out, {gathered}).transpose(1, 2);
}

}  // namespace hp::cp::detail
