// Head-tail load balance, both forms, P in {2, 3, 4}: out and q/k/v gradients equal the
// single-process reference; the sharding helpers round-trip, padding included.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "cp_test_util.h"
#include "hp/attention/core_attention.h"
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

void run_lb(int p, LoadBalanceForm form) {
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
  c.load_balance = true;
  c.load_balance_form = form;
  auto cfg = *normalize(c, p);
  const bool data = form == LoadBalanceForm::kDataOrder;
  std::vector<at::Tensor> outs(p), dqs(p), dks(p), dvs(p);
  std::vector<double> work(p);
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
    EXPECT_NE(line.find(std::string("load_balance=") + to_string(form)), std::string::npos);
    const int r = w.rank();
    // Data order: shard with the helper; runtime swap: contiguous shards.
    auto part = [&](const at::Tensor& t) { return shard_sequence(t, 2, r, p, data); };
    auto lq = part(q).requires_grad_(true), lk = part(k).requires_grad_(true),
         lv = part(v).requires_grad_(true);
    auto out = core.forward(lq, lk, lv);
    out.backward(part(dout));
    outs[r] = out.detach();
    dqs[r] = lq.grad();
    dks[r] = lk.grad();
    dvs[r] = lv.grad();
  });
  const std::string what = std::string(to_string(form)) + " P=" + std::to_string(p);
  expect_close(unshard_sequence(outs, 2, data), ref.detach(), what + " out");
  expect_close(unshard_sequence(dqs, 2, data), rq.grad(), what + " dq");
  expect_close(unshard_sequence(dks, 2, data), rk.grad(), what + " dk");
  expect_close(unshard_sequence(dvs, 2, data), rv.grad(), what + " dv");
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
