// ring: K/V blocks travel around the CP group by point-to-point shifts while each rank attends
// its queries to the block it holds; partial results merged by log-sum-exp.
//
//   buffer = [k | v] of this rank's shard (one tensor travels: one backward chain per rank)
//   step i = 0 .. P-1 (the block of rank (r - i) mod P is here):
//     start the shift of the buffer to rank r+1 (async), then attend the block it holds:
//       causal, key block after the query block: skipped (never computed)
//       causal, the diagonal: causal mask;  key block before: unmasked;  not causal: unmasked
//     wait for the next block (the transfer overlaps the attention of the current one)
//   out = merge_by_lse(parts), anchored to every received block
//   head-tail balance (data-order shards: chunks 2r and 2P-2r-1): each of the two query chunks
//   against each of the two key chunks of the block, by their chunk ids.
//   backward (autograd over comm::shift_start): each step's inverse shift carries the block's
//   dK/dV back around the ring while the attention backward of the next block runs.
// Memory: autograd keeps every received block for the attention backward (P blocks per rank).
#include <ATen/ATen.h>

#include "hp/comm/async_transfer.h"
#include "hp/common/check.h"
#include "hp/cp/sequence.h"
#include "strategy_pieces.h"

namespace hp::cp {
namespace {

class RingStrategy final : public CPStrategy {
 public:
  std::string name() const override { return "ring"; }
  std::string summary() const override {
    return "K/V blocks passed around the CP ring by point-to-point shifts, each attended while "
           "the next travels (any head count; head-tail load balance, data order)";
  }
  void normalize(ContextParallelConfig& c, int64_t cp_size) const override {
    HP_CHECK(!c.ulysses_degree || *c.ulysses_degree == 1,
             "cp_config.ulysses_degree=", c.ulysses_degree.value_or(0),
             " with algorithm=ring: ring uses no Ulysses groups; drop ulysses_degree (cp_size=",
             cp_size, ")");
    c.ulysses_degree = 1;
    HP_CHECK(!c.load_balance || c.load_balance_form == LoadBalanceForm::kDataOrder,
             "cp_config.load_balance_form=runtime_swap with algorithm=ring: ring balances "
             "data-order shards (shard_sequence with load_balance); set "
             "load_balance_form=data_order");
  }
  bool supports_load_balance() const override { return true; }
  int64_t forward_bytes_per_rank(const ContextParallelConfig&, int64_t p, const AttentionShape& s,
                                 int64_t) const override {
    // P-1 shifts of this rank's [k | v] block.
    return (p - 1) * (s.seq / p) * s.kv_heads * (s.qk_dim + s.v_dim_or_qk()) * s.batch *
           s.element_size;
  }
  std::vector<comm::OpKind> required_ops() const override {
    return {comm::OpKind::kSend, comm::OpKind::kRecv};
  }
  std::vector<QKVRole> moved_roles() const override { return {}; }

  at::Tensor run_sync(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const AttentionCall& call, const CPRuntimeContext& ctx) const override {
    const auto& t = *ctx.topology;
    const bool balanced = ctx.load_balance && t.cp_size > 1;
    if (balanced) detail::check_head_tail(q, ctx);
    detail::RingGroup ring{t.cp, t.cp_rank, t.cp_size, 0};
    return detail::ring_attend(q, k, v, call, ctx.layout, ring, balanced);
  }

  // Nothing moves before attention: the async schedule is the ring itself (each block's
  // transfer already overlaps the previous block's attention).
  at::Tensor run_async(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const AttentionCall& call, const CPRuntimeContext& ctx,
                       const ArrivedFn&) const override {
    return run_sync(q, k, v, call, ctx);
  }
};

}  // namespace

at::Tensor detail::ring_attend(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                               const AttentionCall& call, const QKVLayout& l, const RingGroup& ring,
                               bool balanced) {
  const int64_t seq = l.seq_dim, s = q.size(seq), dk = k.size(-1), p = ring.size;
  const bool causal = call.options().causal;
  HP_CHECK(p == 1 || can_split_call(call),
           "the ring merges partial results by log-sum-exp: it needs BNSD or BSHD q/k/v and no "
           "tensor mask or mask function; use algorithm=all_gather for this call");
  // Query chunks of this rank with their global chunk ids (chunk = s/2 rows when balanced).
  struct Chunk {
    at::Tensor rows;
    int64_t id;
  };
  const int64_t len = balanced ? s / 2 : s;
  auto chunks_of = [&](const at::Tensor& x, int64_t rank) {
    std::vector<Chunk> out;
    if (balanced) {
      auto ids = load_balance_chunks(rank, p);
      out.push_back({x.narrow(seq, 0, len), ids[0]});
      out.push_back({x.narrow(seq, len, len), ids[1]});
    } else {
      out.push_back({x, rank});
    }
    return out;
  };
  auto queries = chunks_of(q, ring.rank);
  std::vector<std::vector<attention::AttentionResult>> parts(queries.size());
  auto kv = at::cat({k, v}, -1).contiguous();
  std::vector<at::Tensor> travelled;
  for (int64_t step = 0; step < p; ++step) {
    const int64_t src = (ring.rank - step + p) % p;  // whose block is here
    std::optional<comm::InFlight> next;
    if (step + 1 < p) next.emplace(comm::shift_start(kv, 1, ring.group));
    for (const auto& key : chunks_of(kv, src)) {
      for (size_t i = 0; i < queries.size(); ++i) {
        const auto& query = queries[i];
        if (causal && key.id > query.id) continue;  // above the diagonal: never computed
        CallState st;
        st.local_seq = s;
        st.head_offset = ring.head_offset;
        st.causal = {(query.id - key.id) * len, len, len};
        parts[i].push_back(call(query.rows, key.rows.narrow(-1, 0, dk),
                                key.rows.narrow(-1, dk, key.rows.size(-1) - dk), st));
      }
    }
    if (next) travelled.push_back(kv = next->wait());
  }
  std::vector<at::Tensor> outs;
  for (auto& part : parts)
    outs.push_back(merge_by_lse(part, l));
  auto out = outs.size() == 1 ? outs[0] : at::cat(outs, seq);
  return travelled.empty() ? out : anchored(out, travelled);
}

std::shared_ptr<const CPStrategy> make_ring_strategy() {
  return std::make_shared<RingStrategy>();
}

}  // namespace hp::cp
