// Head-tail load balance: the data-order helpers, and the pieces the all_gather strategy uses
// for both forms.
//
//   2P chunks c0 .. c(2P-1) of the sequence; rank r computes queries {c(2r), c(2P-2r-1)}:
//   causal work (2r+1) + (2P-2r) = 2P+1 chunk pairs on every rank.
//   data order:   local q = [c(2r), c(2P-2r-1)]; gathered K/V arrive in rank order
//                 [c0, c(2P-1), c2, c(2P-3), ...] and are put back in natural order.
//   runtime swap: local q = [c(2r), c(2r+1)] (contiguous); c(2r+1) goes to mirror m = P-1-r,
//                 whose c(2m+1) = c(2P-2r-1) comes back; outputs travel back the same way.
#include <ATen/ATen.h>

#include "hp/attention/masks.h"
#include "hp/comm/autograd_collectives.h"
#include "hp/common/check.h"
#include "hp/cp/sequence.h"
#include "strategy_pieces.h"

namespace hp::cp {

std::vector<int64_t> load_balance_chunks(int64_t r, int64_t p) {
  HP_CHECK(p >= 1 && r >= 0 && r < p, "load_balance_chunks: rank ", r, " outside [0, ", p, ")");
  return {2 * r, 2 * p - 2 * r - 1};
}

namespace {

void check_divisible(const at::Tensor& t, int64_t seq_dim, int64_t parts, const char* who) {
  HP_CHECK(seq_dim >= 0 && seq_dim < t.dim(), who, ": seq_dim=", seq_dim, " out of range for a ",
           t.dim(), "-d tensor");
  HP_CHECK(t.size(seq_dim) % parts == 0, who, ": sequence length ", t.size(seq_dim),
           " is not divisible by ", parts, "; pad it to a multiple of ", parts,
           " first (pad_sequence / shard_batch)");
}

void check_rank(int64_t r, int64_t p, const char* who) {
  HP_CHECK(p >= 1 && r >= 0 && r < p, who, ": cp_rank=", r, " is outside [0, cp_size=", p,
           ") (cp_size must be >= 1); pass this rank's CP coordinate and the CP group's size, "
           "not the world's");
}

}  // namespace

at::Tensor shard_sequence(const at::Tensor& full, int64_t seq_dim, int64_t r, int64_t p,
                          bool load_balance) {
  check_rank(r, p, "shard_sequence");
  if (!load_balance) {
    check_divisible(full, seq_dim, p, "shard_sequence");
    return full.chunk(p, seq_dim)[r].contiguous();
  }
  check_divisible(full, seq_dim, 2 * p, "shard_sequence (load balance)");
  auto chunks = full.chunk(2 * p, seq_dim);
  auto ids = load_balance_chunks(r, p);
  return at::cat({chunks[ids[0]], chunks[ids[1]]}, seq_dim);
}

at::Tensor unshard_sequence(const std::vector<at::Tensor>& shards, int64_t seq_dim,
                            bool load_balance) {
  HP_CHECK(!shards.empty(), "unshard_sequence: no shards");
  if (!load_balance) return at::cat(shards, seq_dim);
  const int64_t p = static_cast<int64_t>(shards.size());
  std::vector<at::Tensor> chunks(2 * p);
  for (int64_t r = 0; r < p; ++r) {
    HP_CHECK(shards[r].size(seq_dim) % 2 == 0, "unshard_sequence: shard ", r, " has odd length ",
             shards[r].size(seq_dim), "; load-balanced shards hold two equal chunks");
    auto halves = shards[r].chunk(2, seq_dim);
    auto ids = load_balance_chunks(r, p);
    chunks[ids[0]] = halves[0];
    chunks[ids[1]] = halves[1];
  }
  return at::cat(chunks, seq_dim);
}

at::Tensor pad_sequence(const at::Tensor& t, int64_t seq_dim, int64_t multiple, double value) {
  HP_CHECK(multiple >= 1, "pad_sequence: multiple=", multiple, " must be >= 1");
  const int64_t s = t.size(seq_dim);
  const int64_t pad = (multiple - s % multiple) % multiple;
  if (pad == 0) return t;
  auto shape = t.sizes().vec();
  shape[seq_dim] = pad;
  return at::cat({t, at::full(shape, value, t.options())}, seq_dim);
}

ShardedBatch shard_batch(const at::Tensor& input_ids, const at::Tensor& labels, int64_t r,
                         int64_t p, bool load_balance, const at::Tensor& doc_ids) {
  HP_CHECK(input_ids.dim() == 2 && labels.sizes() == input_ids.sizes(),
           "shard_batch: input_ids and labels must both be [B, S]");
  check_rank(r, p, "shard_batch");
  const int64_t multiple = load_balance ? 2 * p : p;
  ShardedBatch b;
  auto ids = pad_sequence(input_ids, 1, multiple, 0);
  auto lab = pad_sequence(labels, 1, multiple, -100);
  b.padded_len = ids.size(1);
  at::Tensor pos;
  if (doc_ids.defined()) {
    HP_CHECK(doc_ids.sizes() == input_ids.sizes(), "shard_batch: doc_ids ", doc_ids.sizes(),
             " must match input_ids ", input_ids.sizes(), " ([B, S])");
    auto docs = doc_ids.to(at::kLong);
    // The padding: one more document after each row's last.
    auto pad_id = std::get<0>(docs.max(1, /*keepdim=*/true)) + 1;
    const int64_t pad = b.padded_len - docs.size(1);
    b.doc_ids = pad > 0 ? at::cat({docs, pad_id.expand({docs.size(0), pad})}, 1) : docs;
    attention::check_documents(attention::Documents{b.doc_ids}, b.doc_ids.size(0), 0, 0,
                               "shard_batch");
    pos = attention::document_positions(b.doc_ids);
    b.local_doc_ids = shard_sequence(b.doc_ids, 1, r, p, load_balance);
  } else {
    pos = at::arange(b.padded_len, input_ids.options().dtype(at::kLong))
              .unsqueeze(0)
              .expand({ids.size(0), b.padded_len});
  }
  b.input_ids = shard_sequence(ids, 1, r, p, load_balance);
  b.labels = shard_sequence(lab, 1, r, p, load_balance);
  b.position_ids = shard_sequence(pos, 1, r, p, load_balance);
  return b;
}

namespace detail {

void check_head_tail(const at::Tensor& q, const CPRuntimeContext& ctx) {
  const int64_t local = q.size(ctx.layout.seq_dim);
  HP_CHECK(local % 2 == 0, "head-tail load balance needs an even local sequence length, got ",
           local, " on CP rank ", ctx.topology->cp_rank,
           "; pad the sequence to a multiple of 2 * cp = ", 2 * ctx.topology->cp_size);
}

std::vector<QueryPart> head_tail_parts(const at::Tensor& q, const CPRuntimeContext& ctx,
                                       int64_t kv_len) {
  const auto& t = *ctx.topology;
  const int64_t seq = ctx.layout.seq_dim;
  const int64_t local = q.size(seq);
  check_head_tail(q, ctx);
  const int64_t c = local / 2;
  auto ids = load_balance_chunks(t.cp_rank, t.cp_size);
  auto head = q.narrow(seq, 0, c);
  auto tail = q.narrow(seq, c, c);
  const int64_t mirror = t.cp_size - 1 - t.cp_rank;
  if (ctx.load_balance_form == LoadBalanceForm::kRuntimeSwap && mirror != t.cp_rank) {
    // Our c(2r+1) for the mirror's c(2m+1) = c(2P-2r-1).
    tail = comm::p2p_exchange(tail.contiguous(), static_cast<int>(mirror), t.cp);
  }
  std::vector<QueryPart> parts(2);
  parts[0].q = head;
  parts[0].state.causal = {ids[0] * c, c, kv_len};
  parts[1].q = tail;
  parts[1].state.causal = {ids[1] * c, c, kv_len};
  for (auto& part : parts)
    part.state.local_seq = local;
  return parts;
}

at::Tensor head_tail_restore(const std::vector<at::Tensor>& outs, const CPRuntimeContext& ctx) {
  const auto& t = *ctx.topology;
  auto tail = outs[1];
  const int64_t mirror = t.cp_size - 1 - t.cp_rank;
  if (ctx.load_balance_form == LoadBalanceForm::kRuntimeSwap && mirror != t.cp_rank) {
    tail = comm::p2p_exchange(tail.contiguous(), static_cast<int>(mirror), t.cp);
  }
  return at::cat({outs[0], tail}, ctx.layout.seq_dim);
}

at::Tensor natural_order(const at::Tensor& gathered, int64_t p, int64_t seq) {
  auto chunks = gathered.chunk(2 * p, seq);  // rank order: r's two chunks at 2r, 2r+1
  std::vector<at::Tensor> natural(2 * p);
  for (int64_t r = 0; r < p; ++r) {
    auto ids = load_balance_chunks(r, p);
    natural[ids[0]] = chunks[2 * r];
    natural[ids[1]] = chunks[2 * r + 1];
  }
  return at::cat(natural, seq);
}

void natural_order_kv(at::Tensor& k, at::Tensor& v, const CPRuntimeContext& ctx) {
  if (!ctx.load_balance || ctx.load_balance_form != LoadBalanceForm::kDataOrder) return;
  k = natural_order(k, ctx.topology->cp_size, ctx.layout.seq_dim);
  v = natural_order(v, ctx.topology->cp_size, ctx.layout.seq_dim);
}

void check_data_order_balance(const ContextParallelConfig& c, const std::string& algorithm) {
  HP_CHECK(!c.load_balance || c.load_balance_form == LoadBalanceForm::kDataOrder,
           "cp_config.load_balance_form=runtime_swap with algorithm=", algorithm, ": ", algorithm,
           " balances data-order shards (shard_sequence with load_balance); set "
           "load_balance_form=data_order");
}

}  // namespace detail
}  // namespace hp::cp
