// MLA, the all-gather family: strategy latent_all_gather (the compressed latent travels) and,
// for comparison, all_gather (the expanded K/V travel, as for any attention). One code path:
// only what is packed, and how keys come out of gathered rows, differ.
//
//   latent_all_gather: packed [latent | k_rope]  [B, s, R+dr]; keys = expand(rows) (W_ukv)
//   all_gather:        packed [k | v] of every head [B, s, H*(dq+dv)] (expanded locally first)
//   packed --all-gather(seq)--> [B, P*s, .]  (rank order; natural order with load balance)
//   parts: this rank's query rows with their global offset o (one part; head-tail: two, chunks
//          2r and 2P-2r-1 of c = s/2 rows)
//   sync:  keys = keys_of(gathered[0, max(o + len)))  (latent: W_ukv for every head)
//          part out = attend(q_part, keys[0, o + len), causal, offset o)
//   async: start the gather; q = queries() while it travels;
//          diag_i = attend(q_i, keys_of(local rows of part i), causal, offset 0) (local first)
//          wait; prefix = keys_of(gathered[0, max o)); rest_i = attend(q_i, prefix[0, o_i), dense)
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
  at::Tensor q, rows;  // this part's rows: BSHD q, packed [B, len, .] key rows
  int64_t offset = 0;  // global position of the first row
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
  const int64_t rank_dim = shape.kv_rank, heads = shape.heads;
  const bool async = options.schedule == CPSchedule::kAsync;
  const bool latent_form = options.strategy == "latent_all_gather";
  const auto& primitive = attention::AttentionRegistry::builtin().get(options.primitive);
  at::Tensor packed;
  if (latent_form) {
    packed = at::cat({latent, k_rope.to(latent.scalar_type())}, -1).contiguous();
  } else {
    auto local = attention::mla_expand(latent, k_rope, w_ukv, shape, 0, heads);
    packed = at::cat({local.k.transpose(1, 2).flatten(2), local.v.transpose(1, 2).flatten(2)}, -1)
                 .contiguous();
  }
  // Keys and values (BNSD, every head) of packed rows [B, n, .].
  auto keys_of = [&](const at::Tensor& rows) -> attention::MLAKeys {
    if (latent_form) {
      return attention::mla_expand(rows.narrow(2, 0, rank_dim),
                                   rows.narrow(2, rank_dim, shape.d_rope).to(k_rope.scalar_type()),
                                   w_ukv, shape, 0, heads);
    }
    const int64_t b = rows.size(0), n = rows.size(1), kw = heads * shape.qk_dim();
    return {rows.narrow(2, 0, kw).view({b, n, heads, shape.qk_dim()}).transpose(1, 2),
            rows.narrow(2, kw, heads * shape.d_v).view({b, n, heads, shape.d_v}).transpose(1, 2)};
  };
  at::Tensor q;
  if (!async) q = queries();
  auto flight = comm::all_gather_start(packed, 1, topology.cp);
  if (async) q = queries();
  HP_CHECK(q.dim() == 4 && q.size(0) == latent.size(0) && q.size(1) == s &&
               q.size(2) == shape.heads && q.size(3) == shape.qk_dim(),
           "MLA CP (", options.strategy, "): q ", q.sizes(), " must be [B, S/P=", s,
           ", H=", shape.heads, ", d_nope + d_rope=", shape.qk_dim(), "]");
  std::vector<QueryRows> parts;
  if (options.load_balance) {
    const int64_t c = s / 2;
    auto ids = load_balance_chunks(r, p);
    for (int i = 0; i < 2; ++i)
      parts.push_back({q.narrow(1, i * c, c), packed.narrow(1, i * c, c), ids[i] * c});
  } else {
    parts.push_back({q, packed, r * s});
  }
  std::vector<attention::AttentionResult> diag;
  if (async) {
    for (const auto& part : parts) {
      diag.push_back(attention::mla_attend(part.q, keys_of(part.rows), shape, true, 0, primitive));
    }
  }
  auto gathered = flight.wait();  // [B, P*s, R+dr]
  if (options.load_balance) gathered = natural_order(gathered, p, 1);
  int64_t needed = 0;
  for (const auto& part : parts)
    needed = std::max(needed, async ? part.offset : part.offset + part.len());
  attention::MLAKeys keys;
  if (needed > 0) keys = keys_of(gathered.narrow(1, 0, needed));
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
