// Head-tail load balance, both forms, P in {2, 3, 4}: out and q/k/v gradients equal the
// single-process reference; each rank computes the queries of chunks 2r and 2P-2r-1 and so the
// same causal work (visible (query, key) pairs), while contiguous shards are unbalanced by the
// expected ratio; the sharding helpers round-trip, padding included.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "cp_test_util.h"
#include "hp/attention/core_attention.h"
#include "hp/attention/host.h"
#include "hp/comm/device_mesh.h"
#include "hp/common/check.h"
#include "hp/cp/config.h"
#include "hp/cp/sequence.h"
#include "rank_harness.h"

namespace hp::cp {
namespace {

using hp::cp::testing::quiet;
using hp::cp::testing::seeded;
using hp::testing::expect_close;
using hp::testing::run_ranks;

TEST(SequenceSharding, LoadBalancedChunksAndRoundTrip) {
  EXPECT_EQ(load_balance_chunks(0, 4), (std::vector<int64_t>{0, 7}));
  EXPECT_EQ(load_balance_chunks(3, 4), (std::vector<int64_t>{6, 1}));
  auto full = at::arange(24).view({2, 12});
  for (int64_t p : {1, 2, 3}) {
    for (bool lb : {false, true}) {
      std::vector<at::Tensor> shards;
      for (int64_t r = 0; r < p; ++r)
        shards.push_back(shard_sequence(full, 1, r, p, lb));
      EXPECT_TRUE(at::equal(unshard_sequence(shards, 1, lb), full)) << p << " " << lb;
    }
  }
  // P = 3 with load balance: rank 1 holds chunks 2 and 3 of 6 (positions 4..7).
  EXPECT_TRUE(at::equal(shard_sequence(full, 1, 1, 3, true)[0], at::arange(4, 8)));
  EXPECT_THROW(shard_sequence(full, 1, 0, 5, false), hp::Error);
  // A rank outside the CP group (the world rank passed by mistake), or no group at all.
  for (bool lb : {false, true}) {
    HP_EXPECT_ERROR(shard_sequence(full, 1, 2, 2, lb), "cp_rank=2 is outside [0, cp_size=2)");
    HP_EXPECT_ERROR(shard_sequence(full, 1, 0, 0, lb), "cp_rank=0 is outside [0, cp_size=0)");
  }
  HP_EXPECT_ERROR(shard_batch(full, full, 0, 0, false), "shard_batch: cp_rank=0 is outside");
}

TEST(SequenceSharding, ShardBatchPadsIdsLabelsAndPositions) {
  auto ids = at::arange(1, 11).view({1, 10});  // S = 10, P = 2, load balance: pad to 12
  auto labels = ids + 100;
  std::vector<at::Tensor> got_ids, got_labels, got_pos;
  for (int64_t r = 0; r < 2; ++r) {
    auto b = shard_batch(ids, labels, r, 2, true);
    EXPECT_EQ(b.padded_len, 12);
    EXPECT_EQ(b.input_ids.size(1), 6);
    got_ids.push_back(b.input_ids);
    got_labels.push_back(b.labels);
    got_pos.push_back(b.position_ids);
  }
  auto all_ids = unshard_sequence(got_ids, 1, true);
  auto all_labels = unshard_sequence(got_labels, 1, true);
  auto all_pos = unshard_sequence(got_pos, 1, true);
  EXPECT_TRUE(at::equal(all_ids.narrow(1, 0, 10), ids));
  EXPECT_TRUE(at::equal(all_ids.narrow(1, 10, 2), at::zeros({1, 2}, at::kLong)));
  EXPECT_TRUE(at::equal(all_labels.narrow(1, 10, 2), at::full({1, 2}, -100, at::kLong)));
  EXPECT_TRUE(at::equal(all_pos, at::arange(12).view({1, 12})));
}

// Packed documents: the padding is one more document, positions restart in every document, the
// whole padded ids come back unsharded and each rank's shard of them is the shard of its tokens
// (balanced: the head and tail chunks), so a token and its document id always travel together.
TEST(SequenceSharding, ShardBatchShardsTheDocumentIdsWithTheTokens) {
  auto ids = at::arange(1, 11).view({1, 10});  // S = 10, P = 2, load balance: pad to 12
  auto labels = ids + 100;
  auto docs = at::tensor({0, 0, 0, 1, 1, 1, 1, 2, 2, 2}, at::kLong).view({1, 10});
  const auto want_docs = at::tensor({0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 3, 3}, at::kLong).view({1, 12});
  const auto want_pos = at::tensor({0, 1, 2, 0, 1, 2, 3, 0, 1, 2, 0, 1}, at::kLong).view({1, 12});
  for (bool lb : {false, true}) {
    std::vector<at::Tensor> got_ids, got_docs, got_pos;
    for (int64_t r = 0; r < 2; ++r) {
      auto b = shard_batch(ids, labels, r, 2, lb, docs);
      EXPECT_TRUE(at::equal(b.doc_ids, lb ? want_docs : want_docs.narrow(1, 0, 10))) << lb;
      ASSERT_EQ(b.local_doc_ids.sizes(), b.input_ids.sizes()) << lb;
      got_ids.push_back(b.input_ids);
      got_docs.push_back(b.local_doc_ids);
      got_pos.push_back(b.position_ids);
    }
    const int64_t n = lb ? 12 : 10;
    EXPECT_TRUE(at::equal(unshard_sequence(got_docs, 1, lb), want_docs.narrow(1, 0, n))) << lb;
    EXPECT_TRUE(at::equal(unshard_sequence(got_pos, 1, lb), want_pos.narrow(1, 0, n))) << lb;
    EXPECT_TRUE(at::equal(unshard_sequence(got_ids, 1, lb).narrow(1, 0, 10), ids)) << lb;
  }
}

// Sits in the primitive-call slot under the CP runtime and records, per primitive call on its
// rank, which global query and key positions the primitive was handed. Positions are found by
// matching the handed rows (batch 0, head 0) against the rows of the full q and k, so they come
// from what the rank really computed, not from the runtime's own causal metadata.
class WorkCounter final : public attention::AttentionInterceptor {
 public:
  WorkCounter(at::Tensor q_rows, at::Tensor k_rows)
      : q_rows_(std::move(q_rows)), k_rows_(std::move(k_rows)) {}
  std::string id() const override { return "test:work_counter"; }
  attention::AttentionResult intercept(const at::Tensor& q, const at::Tensor& k,
                                       const at::Tensor& v,
                                       const attention::AttentionOptions& options,
                                       const attention::AttentionFn& inner) override {
    auto qpos = positions(q.select(0, 0).select(0, 0).detach(), q_rows_, "query");
    auto kpos = positions(k.select(0, 0).select(0, 0).detach(), k_rows_, "key");
    // Causal work of this call: (query, key) pairs handed to the primitive with key <= query.
    visible_pairs += kpos.unsqueeze(0).le(qpos.unsqueeze(1)).sum().item<int64_t>();
    for (int64_t i = 0; i < qpos.size(0); ++i)
      query_positions.push_back(qpos[i].item<int64_t>());
    return inner(q, k, v, options);
  }

  int64_t visible_pairs = 0;
  std::vector<int64_t> query_positions;

 private:
  // Global index of each row of `rows` [n, D] in `full` [S, D] (exactly one match expected).
  static at::Tensor positions(const at::Tensor& rows, const at::Tensor& full, const char* what) {
    auto match = rows.unsqueeze(1).eq(full.unsqueeze(0)).all(-1);  // [n, S]
    EXPECT_TRUE(at::equal(match.sum(1), at::ones({rows.size(0)}, at::kLong)))
        << "a " << what << " row handed to the primitive is not exactly one row of the input";
    return match.to(at::kLong).argmax(1);
  }

  at::Tensor q_rows_, k_rows_;
};

// Causal work of query position i: keys 0..i.
int64_t causal_work(int64_t first, int64_t count) {
  int64_t w = 0;
  for (int64_t i = first; i < first + count; ++i)
    w += i + 1;
  return w;
}

// `form` unset: no load balance (contiguous shards, plain all_gather).
void run_lb(int p, std::optional<LoadBalanceForm> form) {
  const int64_t b = 1, nq = 4, nkv = 2, s = 8 * p, d = 16;
  auto q = seeded(1, {b, nq, s, d}), k = seeded(2, {b, nkv, s, d}), v = seeded(3, {b, nkv, s, d}),
       dout = seeded(4, {b, nq, s, d});
  attention::AttentionOptions o;
  o.causal = true;
  auto rq = q.clone().requires_grad_(true), rk = k.clone().requires_grad_(true),
       rv = v.clone().requires_grad_(true);
  auto ref = attention::AttentionRegistry::builtin().get("math").forward(rq, rk, rv, o).out;
  ref.backward(dout);
  ContextParallelConfig c;
  c.load_balance = form.has_value();
  if (form) c.load_balance_form = *form;
  auto cfg = *normalize(c, p);
  const bool data = form == LoadBalanceForm::kDataOrder;
  std::vector<at::Tensor> outs(p), dqs(p), dks(p), dvs(p);
  std::vector<int64_t> work(p);
  std::vector<std::vector<int64_t>> positions(p);
  run_ranks(p, [&](comm::World& w) {
    comm::DeviceMesh mesh(w, {{"cp", p}});
    auto topo = CPTopology::build(w, mesh.group_ptr({"cp"}), cfg);
    attention::CoreAttentionOptions co;
    co.attention.causal = true;
    co.attention.block_q = 4;
    co.attention.block_kv = 4;
    attention::CoreAttention core(co);
    CPModuleSpec spec;
    spec.module_path = "attn";
    spec.inner_wrapper = "sdpa_qkv";
    auto line = apply_context_parallel(core.host(), spec, cfg, topo, quiet());
    if (form) {
      EXPECT_NE(line.find(std::string("load_balance=") + to_string(*form)), std::string::npos)
          << line;
    } else {
      EXPECT_EQ(line.find("load_balance="), std::string::npos) << line;
    }
    auto counter = std::make_shared<WorkCounter>(q[0][0], k[0][0]);
    core.host().install(attention::AttentionHost::Slot::kPrimitiveCall, counter);
    const int r = w.rank();
    // Data order: shard with the helper; runtime swap and no balance: contiguous shards.
    auto part = [&](const at::Tensor& t) { return shard_sequence(t, 2, r, p, data); };
    auto lq = part(q).requires_grad_(true), lk = part(k).requires_grad_(true),
         lv = part(v).requires_grad_(true);
    auto out = core.forward(lq, lk, lv);
    out.backward(part(dout));
    outs[r] = out.detach();
    dqs[r] = lq.grad();
    dks[r] = lk.grad();
    dvs[r] = lv.grad();
    work[r] = counter->visible_pairs;
    positions[r] = counter->query_positions;
  });
  const std::string what =
      std::string(form ? to_string(*form) : "contiguous") + " P=" + std::to_string(p);
  expect_close(unshard_sequence(outs, 2, data), ref.detach(), what + " out");
  expect_close(unshard_sequence(dqs, 2, data), rq.grad(), what + " dq");
  expect_close(unshard_sequence(dks, 2, data), rk.grad(), what + " dk");
  expect_close(unshard_sequence(dvs, 2, data), rv.grad(), what + " dv");

  // Which queries each rank computed, and the causal work that implies.
  std::vector<int> seen(s, 0);
  for (int r = 0; r < p; ++r) {
    std::set<int64_t> expect;
    if (form) {  // 2P chunks of c; rank r: chunks 2r and 2P-2r-1
      const int64_t ch = s / (2 * p);
      for (int64_t i = 0; i < ch; ++i) {
        expect.insert(2 * r * ch + i);
        expect.insert((2 * p - 2 * r - 1) * ch + i);
      }
    } else {  // P chunks of S/P; rank r: chunk r
      for (int64_t i = 0; i < s / p; ++i)
        expect.insert(r * (s / p) + i);
    }
    EXPECT_EQ(positions[r].size(), static_cast<size_t>(s / p)) << what << " rank " << r;
    EXPECT_EQ(std::set<int64_t>(positions[r].begin(), positions[r].end()), expect)
        << what << " rank " << r;
    for (int64_t pos : positions[r])
      ++seen[pos];
  }
  EXPECT_EQ(seen, std::vector<int>(s, 1)) << what << ": every query computed exactly once";
  int64_t total = 0;
  for (int r = 0; r < p; ++r)
    total += work[r];
  EXPECT_EQ(total, s * (s + 1) / 2) << what;
  if (form) {
    // Head-tail: every rank does the same causal work, S(S+1)/(2P) visible pairs.
    for (int r = 0; r < p; ++r)
      EXPECT_EQ(work[r], s * (s + 1) / (2 * p)) << what << " rank " << r;
  } else {
    // Contiguous: rank r owns positions [rL, (r+1)L); its work grows with r, and the last rank
    // does 1 + 2(P-1)L/(L+1) times the first rank's.
    const int64_t l = s / p;
    for (int r = 0; r < p; ++r)
      EXPECT_EQ(work[r], causal_work(r * l, l)) << what << " rank " << r;
    const double ratio = static_cast<double>(work[p - 1]) / static_cast<double>(work[0]);
    EXPECT_DOUBLE_EQ(ratio, 1.0 + 2.0 * (p - 1) * l / (l + 1.0)) << what;
  }
}

TEST(LoadBalance, DataOrderP2) {
  run_lb(2, LoadBalanceForm::kDataOrder);
}
TEST(LoadBalance, DataOrderP3) {
  run_lb(3, LoadBalanceForm::kDataOrder);
}
TEST(LoadBalance, DataOrderP4) {
  run_lb(4, LoadBalanceForm::kDataOrder);
}
TEST(LoadBalance, RuntimeSwapP2) {
  run_lb(2, LoadBalanceForm::kRuntimeSwap);
}
TEST(LoadBalance, RuntimeSwapP3) {
  run_lb(3, LoadBalanceForm::kRuntimeSwap);
}
TEST(LoadBalance, RuntimeSwapP4) {
  run_lb(4, LoadBalanceForm::kRuntimeSwap);
}
// The contrast: contiguous shards give the last rank 1 + 2(P-1)L/(L+1) times the first's work.
TEST(LoadBalance, ContiguousShardsAreUnbalancedP2) {
  run_lb(2, std::nullopt);
}
TEST(LoadBalance, ContiguousShardsAreUnbalancedP4) {
  run_lb(4, std::nullopt);
}

TEST(LoadBalance, OddLocalLengthIsRefusedWithThePaddingToUse) {
  ContextParallelConfig c;
  c.load_balance = true;
  c.load_balance_form = LoadBalanceForm::kRuntimeSwap;
  auto cfg = *normalize(c, 2);
  run_ranks(2, [&](comm::World& w) {
    comm::DeviceMesh mesh(w, {{"cp", 2}});
    auto topo = CPTopology::build(w, mesh.group_ptr({"cp"}), cfg);
    attention::CoreAttentionOptions co;
    co.attention.causal = true;
    attention::CoreAttention core(co);
    CPModuleSpec spec;
    spec.inner_wrapper = "sdpa_qkv";
    apply_context_parallel(core.host(), spec, cfg, topo, quiet());
    auto x = at::randn({1, 2, 5, 8});
    try {
      core.forward(x, x, x);
      ADD_FAILURE() << "expected an error";
    } catch (const hp::Error& e) {
      EXPECT_NE(std::string(e.what()).find("head-tail load balance needs an even local sequence "
                                           "length, got 5 on CP rank " +
                                           std::to_string(w.rank()) +
                                           "; pad the sequence to a multiple of 2 * cp = 4"),
                std::string::npos)
          << e.what();
    }
  });
}

}  // namespace
}  // namespace hp::cp
