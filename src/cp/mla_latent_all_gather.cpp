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
// Packed documents (global ids): part i sees no key before f_i, the start of the document that
// holds its first row (the earliest over batch rows). Keys are expanded from the lowest f_i on,
// each part attends keys [f_i, .) with documents {ids, o_i, f_i}, and an async part whose
// earlier keys all lie in other documents (f_i = o_i) keeps its diagonal block alone.
#include <algorithm>
#include <optional>

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

attention::MLAKeys key_range(const attention::MLAKeys& keys, int64_t from, int64_t n) {
  return {keys.k.narrow(2, from, n), keys.v.narrow(2, from, n)};
}

// The first position of the document holding global position `pos`, earliest over the rows of
// `ids` ([Bd, S] CPU int64, non-decreasing along each row).
int64_t document_start(const at::Tensor& ids, int64_t pos) {
  int64_t first = pos;
  for (int64_t b = 0; b < ids.size(0); ++b) {
    const int64_t* row = ids.data_ptr<int64_t>() + b * ids.size(1);
    first = std::min<int64_t>(first, std::lower_bound(row, row + pos, row[pos]) - row);
  }
  return first;
}

}  // namespace

at::Tensor mla_latent_all_gather(const std::function<at::Tensor()>& queries,
                                 const at::Tensor& latent, const at::Tensor& k_rope,
                                 const at::Tensor& w_ukv, const attention::MLAShape& shape,
                                 const MLACPOptions& options, const CPTopology& topology,
                                 const at::Tensor& doc_ids) {
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
  // Sync checks the queries before the gather; async computes them while it travels.
  auto checked_queries = [&] {
    auto q = queries();
    HP_CHECK(q.dim() == 4 && q.size(0) == latent.size(0) && q.size(1) == s &&
                 q.size(2) == shape.heads && q.size(3) == shape.qk_dim(),
             "MLA CP (", options.strategy, "): q ", q.sizes(), " must be [B, S/P=", s,
             ", H=", shape.heads, ", d_nope + d_rope=", shape.qk_dim(), "]");
    return q;
  };
  at::Tensor q;
  if (!async) q = checked_queries();
  auto flight = comm::all_gather_start(packed, 1, topology.cp);
  if (async) q = checked_queries();
  std::vector<QueryRows> parts;
  if (options.load_balance) {
    const int64_t c = s / 2;
    auto ids = load_balance_chunks(r, p);
    for (int i = 0; i < 2; ++i)
      parts.push_back({q.narrow(1, i * c, c), packed.narrow(1, i * c, c), ids[i] * c});
  } else {
    parts.push_back({q, packed, r * s});
  }
  at::Tensor ids;  // CPU int64 [Bd, S] when documents are packed
  if (doc_ids.defined()) ids = doc_ids.to(at::kCPU, at::kLong).contiguous();
  auto docs = [&](int64_t q_start, int64_t kv_start) -> std::optional<attention::Documents> {
    if (!ids.defined()) return std::nullopt;
    return attention::Documents{doc_ids, q_start, kv_start};
  };
  std::vector<int64_t> first;  // the earliest key each part's queries can see
  for (const auto& part : parts)
    first.push_back(ids.defined() ? document_start(ids, part.offset) : 0);
  std::vector<attention::AttentionResult> diag;
  if (async) {
    for (const auto& part : parts) {
      diag.push_back(attention::mla_attend(part.q, keys_of(part.rows), shape, true, 0, primitive,
                                           docs(part.offset, part.offset)));
    }
  }
  auto gathered = flight.wait();  // [B, P*s, R+dr]
  if (options.load_balance) gathered = natural_order(gathered, p, 1);
  // Keys [lo, hi) cover every part's visible earlier keys (async: those before its own rows).
  int64_t lo = s * p, hi = 0;
  for (size_t i = 0; i < parts.size(); ++i) {
    const int64_t end = async ? parts[i].offset : parts[i].offset + parts[i].len();
    if (first[i] >= end) continue;
    lo = std::min(lo, first[i]);
    hi = std::max(hi, end);
  }
  attention::MLAKeys keys;
  if (hi > lo) keys = keys_of(gathered.narrow(1, lo, hi - lo));
  const QKVLayout bnsd{2, 1};
  std::vector<at::Tensor> outs;
  for (size_t i = 0; i < parts.size(); ++i) {
    const auto& part = parts[i];
    const int64_t f = first[i];
    if (!async) {
      const int64_t n = part.offset + part.len() - f;
      outs.push_back(attention::mla_attend(part.q, key_range(keys, f - lo, n), shape, true,
                                           part.offset - f, primitive, docs(part.offset, f))
                         .out);
    } else if (f >= part.offset) {  // no earlier key is visible: the diagonal block alone
      outs.push_back(diag[i].out);
    } else {
      auto rest = attention::mla_attend(part.q, key_range(keys, f - lo, part.offset - f), shape,
                                        false, 0, primitive, docs(part.offset, f));
      outs.push_back(merge_by_lse({diag[i], rest}, bnsd));
    }
  }
  auto out = outs.size() == 1 ? outs[0] : at::cat(outs, 2);  // [B, H, s, dv]
  return anchored(out, {gathered}).transpose(1, 2);
}

}  // namespace hp::cp::detail
