// MLA, strategy ulysses: expanded Q, K, V (unequal last dims) in one packed all-to-all.
//
//   keys of the local tokens, every head: k [B, s, H, dq], v [B, s, H, dv]  (from the latent)
//   sync:  parts_j = [q_j | k_j | v_j] (head group j)  --one A2A(seq->head)-->  q, k, v
//          [B, S, H/P, .] -> causal attention over the whole sequence -> o [B, S, H/P, dv]
//          --A2A(head->seq)--> [B, s, H, dv]
//   async: [k_j | v_j] starts first; q = queries() while it travels; q_j in its own all-to-all
//   backward: the inverse all-to-alls.
//   packed documents: the whole sequence is here after the all-to-all, so the global ids apply
//   with q_start = kv_start = 0.
#include <optional>

#include <ATen/ATen.h>

#include "hp/comm/async_transfer.h"
#include "hp/common/check.h"
#include "hp/cp/mla.h"
#include "strategy_pieces.h"

namespace hp::cp::detail {

at::Tensor mla_ulysses(const std::function<at::Tensor()>& queries, const at::Tensor& latent,
                       const at::Tensor& k_rope, const at::Tensor& w_ukv,
                       const attention::MLAShape& shape, const MLACPOptions& options,
                       const CPTopology& topology, const at::Tensor& doc_ids) {
  const int64_t p = topology.cp_size, n = shape.heads / p;
  const auto& primitive = attention::AttentionRegistry::builtin().get(options.primitive);
  auto local = attention::mla_expand(latent, k_rope, w_ukv, shape, 0, shape.heads);
  auto k = local.k.transpose(1, 2), v = local.v.transpose(1, 2);  // [B, s, H, .]
  auto group_of = [&](const at::Tensor& t, int64_t j) { return t.narrow(2, j * n, n); };
  auto check_q = [&](const at::Tensor& q) {
    HP_CHECK(q.dim() == 4 && q.size(0) == k.size(0) && q.size(1) == k.size(1) &&
                 q.size(2) == shape.heads && q.size(3) == shape.qk_dim(),
             "MLA CP (ulysses): q ", q.sizes(), " must be [B, S/P=", k.size(1), ", H=", shape.heads,
             ", d_nope + d_rope=", shape.qk_dim(), "]");
  };
  at::Tensor qh, kh, vh;  // [B, S, n, .]
  if (options.schedule == CPSchedule::kAsync) {
    std::vector<std::vector<at::Tensor>> kv_parts, q_parts;
    for (int64_t j = 0; j < p; ++j)
      kv_parts.push_back({group_of(k, j), group_of(v, j)});
    HeadPacking how;
    auto flight = comm::all_to_all_start(pack_for_heads(kv_parts, how), 2, 1, topology.cp);
    auto q = queries();  // while K/V travel
    check_q(q);
    for (int64_t j = 0; j < p; ++j)
      q_parts.push_back({group_of(q, j)});
    qh = ulysses_to_heads(q_parts, topology.cp)[0];
    auto kv = unpack_heads(flight.wait(), how);
    kh = kv[0];
    vh = kv[1];
  } else {
    auto q = queries();
    check_q(q);
    std::vector<std::vector<at::Tensor>> parts;
    for (int64_t j = 0; j < p; ++j)
      parts.push_back({group_of(q, j), group_of(k, j), group_of(v, j)});
    auto moved = ulysses_to_heads(parts, topology.cp);
    qh = moved[0];
    kh = moved[1];
    vh = moved[2];
  }
  std::optional<attention::Documents> docs;
  if (doc_ids.defined()) docs = attention::Documents{doc_ids};
  auto res = attention::mla_attend(qh, {kh.transpose(1, 2), vh.transpose(1, 2)}, shape, true, 0,
                                   primitive, docs);
  return ulysses_to_sequence(res.out.transpose(1, 2), topology.cp);
}

}  // namespace hp::cp::detail
