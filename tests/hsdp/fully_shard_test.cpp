// FullyShard on a small stack (root = input/output projections, one unit per layer) against
// the single-process run on the union of every rank's data: loss and full gradients, for the
// data meshes (R, Sd) in {(1,4), (2,2), (4,1)}, fusion on and off, with and without recompute;
// the recorded pipeline schedule; one drain per backward; accumulation; memory; bytes.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <algorithm>

#include "hp/comm/collectives.h"
#include "hp/comm/device_mesh.h"
#include "hp/common/check.h"
#include "hp/hsdp/fully_shard.h"
#include "rank_harness.h"

namespace hp::hsdp {
namespace {

using hp::testing::expect_close;
using hp::testing::run_ranks;

constexpr int64_t kIn = 8, kHidden = 10, kOut = 3, kRowsPerRank = 4;

struct Stack {
  std::vector<std::pair<std::string, at::Tensor>> named;  // all leaves, requires grad
  at::Tensor w_in, w_out;
  std::vector<at::Tensor> w, b;
};

Stack make_stack(int layers) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(11);
  Stack s;
  auto leaf = [&](const std::string& name, std::vector<int64_t> shape) {
    auto t = (at::randn(shape, gen) * 0.4).requires_grad_(true);
    s.named.emplace_back(name, t);
    return t;
  };
  s.w_in = leaf("w_in", {kIn, kHidden});
  for (int i = 0; i < layers; ++i) {
    s.w.push_back(leaf("layers." + std::to_string(i) + ".w", {kHidden, kHidden}));
    s.b.push_back(leaf("layers." + std::to_string(i) + ".b", {kHidden}));
  }
  s.w_out = leaf("w_out", {kHidden, kOut});
  return s;
}

at::Tensor layer_fn(const Stack& s, int i, const at::Tensor& h) {
  return at::tanh(h.mm(s.w[i]) + s.b[i]);
}

// Rows of the global batch: rank d of the data mesh takes rows [d*k, (d+1)*k).
at::Tensor data(int64_t ranks, int micro = 0) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(7 + micro);
  return at::randn({ranks * kRowsPerRank, kIn}, gen);
}

at::Tensor loss_of(const at::Tensor& out) {
  return out.pow(2).sum(1).sin().sum();  // per-row loss, summed
}

struct Ref {
  double loss;
  std::map<std::string, at::Tensor> grads;
};

// Mean over the rows of `micro` micro-batches of the global batch.
Ref reference(int layers, int64_t ranks, int micros = 1) {
  auto s = make_stack(layers);
  double total = 0;
  for (int m = 0; m < micros; ++m) {
    auto h = data(ranks, m).mm(s.w_in);
    for (int i = 0; i < layers; ++i)
      h = layer_fn(s, i, h);
    auto loss = loss_of(h.mm(s.w_out)) / static_cast<double>(ranks * kRowsPerRank);
    loss.backward();
    total += loss.item<double>();
  }
  Ref r{total, {}};
  for (auto& [n, t] : s.named)
    r.grads[n] = t.grad();
  return r;
}

struct RunOptions {
  int64_t r = 1, sd = 4;
  int layers = 3;
  HsdpOptions hsdp;
  bool recompute = false;
  int micros = 1;
  int backwards = 1;  // repeated forward/backward of micro 0 (drain count)
};

struct RankRun {
  Stack stack;
  std::unique_ptr<FullyShard> fs;
};

std::unique_ptr<FullyShard> shard_stack(Stack& s, comm::DeviceMesh& mesh, const HsdpOptions& o) {
  std::vector<UnitSpec> units{{"root", {{"w_in", s.w_in}, {"w_out", s.w_out}}}};
  for (size_t i = 0; i < s.w.size(); ++i) {
    const auto base = "layers." + std::to_string(i);
    units.push_back({base, {{base + ".w", s.w[i]}, {base + ".b", s.b[i]}}});
  }
  return std::make_unique<FullyShard>(
      std::move(units),
      HsdpGroups{mesh.group_ptr({"dp_shard"}), mesh.group_ptr({"dp_replicate"}), nullptr}, o);
}

// One rank's loss (already divided as `op` wants) for micro-batch `micro`.
at::Tensor rank_loss(Stack& s, FullyShard& fs, comm::DeviceMesh& mesh, const RunOptions& o,
                     int micro) {
  const int64_t ranks = o.r * o.sd;
  const int64_t d = mesh.coordinate("dp_replicate") * o.sd + mesh.coordinate("dp_shard");
  auto x = data(ranks, micro).narrow(0, d * kRowsPerRank, kRowsPerRank);
  auto out = fs.forward_root([&] {
    auto h = x.mm(s.w_in);
    for (size_t i = 0; i < s.w.size(); ++i) {
      h = fs.forward_unit(
          i + 1, h, [&, i](const at::Tensor& t) { return layer_fn(s, i, t); }, o.recompute);
    }
    return h.mm(s.w_out);
  });
  // kSum: normalise by the global row count (the gradient is then a plain sum); kAvg: by the
  // local one (mean over ranks).
  const double rows = o.hsdp.reduce_op == ReduceOp::kSum ? static_cast<double>(ranks * kRowsPerRank)
                                                         : static_cast<double>(kRowsPerRank);
  return loss_of(out) / rows;
}

void expect_matches_reference(const RunOptions& o) {
  const auto ref = reference(o.layers, o.r * o.sd, o.micros);
  run_ranks(static_cast<int>(o.r * o.sd), [&](comm::World& w) {
    comm::DeviceMesh mesh(w, {{"dp_replicate", o.r}, {"dp_shard", o.sd}});
    auto s = make_stack(o.layers);
    auto fs = shard_stack(s, mesh, o.hsdp);
    double loss_sum = 0;
    for (int m = 0; m < o.micros; ++m) {
      fs->set_requires_all_reduce(m == o.micros - 1);
      auto loss = rank_loss(s, *fs, mesh, o, m);
      loss.backward();
      loss_sum += loss.item<double>();
    }
    auto total = comm::all_reduce(w.group(), at::full({1}, loss_sum, at::kDouble)).item<double>();
    if (o.hsdp.reduce_op == ReduceOp::kAvg) total /= static_cast<double>(o.r * o.sd);
    const std::string what = "R=" + std::to_string(o.r) + " Sd=" + std::to_string(o.sd) +
                             (o.hsdp.comm_fusion ? " fused " : " unfused ");
    EXPECT_NEAR(total, ref.loss, 1e-5) << what;
    for (auto& [name, g] : ref.grads)
      expect_close(fs->full_gradient(name), g, what + name, 1e-5, 1e-6);
    EXPECT_EQ(fs->stats().backwards, o.micros);
    EXPECT_EQ(fs->stats().resident_unsharded_numel, 0) << "parameters left gathered";
  });
}

TEST(FullyShard, MatchesSingleProcessOnEveryMeshFusedAndUnfused) {
  for (auto [r, sd] : {std::pair<int64_t, int64_t>{1, 4}, {2, 2}, {4, 1}}) {
    for (bool fusion : {false, true}) {
      RunOptions o;
      o.r = r;
      o.sd = sd;
      o.hsdp.comm_fusion = fusion;
      expect_matches_reference(o);
    }
  }
}

TEST(FullyShard, SumReductionAndRecompute) {
  RunOptions o;
  o.r = 2;
  o.sd = 2;
  o.hsdp.reduce_op = ReduceOp::kSum;
  o.recompute = true;
  expect_matches_reference(o);
  o.hsdp.comm_fusion = true;
  expect_matches_reference(o);
}

TEST(FullyShard, BaselineWithoutPipelineAndWithoutReshard) {
  RunOptions o;
  o.r = 2;
  o.sd = 2;
  o.hsdp.pipeline = false;
  expect_matches_reference(o);
  o.hsdp.pipeline = true;
  o.hsdp.reshard_after_forward = false;
  expect_matches_reference(o);
}

TEST(FullyShard, AccumulationSkipsTheAllReduceUntilTheLastMicroStep) {
  for (bool fusion : {false, true}) {
    RunOptions o;
    o.r = 2;
    o.sd = 2;
    o.micros = 3;
    o.hsdp.comm_fusion = fusion;
    expect_matches_reference(o);  // partials added before the final AR
  }
  RunOptions o;  // R == 1: no AR at all, gradients accumulate in the shards
  o.micros = 2;
  expect_matches_reference(o);
}

// Full gradients under fused and unfused AVG are the same numbers; SUM / AVG = R * Sd when
// every rank's loss is the same.
TEST(FullyShard, FusedUnfusedParityAndSumOverAvgIsTheWorldSize) {
  run_ranks(4, [&](comm::World& w) {
    comm::DeviceMesh mesh(w, {{"dp_replicate", 2}, {"dp_shard", 2}});
    std::map<std::string, std::vector<at::Tensor>> grads;
    for (auto [fusion, op] :
         {std::pair{false, ReduceOp::kAvg}, {true, ReduceOp::kAvg}, {false, ReduceOp::kSum}}) {
      RunOptions o;
      o.r = 2;
      o.sd = 2;
      o.hsdp.comm_fusion = fusion;
      o.hsdp.reduce_op = op;
      auto s = make_stack(3);
      auto fs = shard_stack(s, mesh, o.hsdp);
      o.hsdp.reduce_op = ReduceOp::kAvg;  // same per-rank loss in all three runs
      rank_loss(s, *fs, mesh, o, 0).backward();
      for (auto& [name, t] : s.named)
        grads[name].push_back(fs->full_gradient(name));
    }
    for (auto& [name, g] : grads) {
      expect_close(g[1], g[0], "fused vs unfused " + name, 1e-6, 1e-7);
      expect_close(g[2], g[0] * 4.0, "sum vs avg*4 " + name, 1e-5, 1e-6);
    }
  });
}

size_t index_of(const std::vector<std::string>& ev, const std::string& e, size_t from = 0) {
  auto it = std::find(ev.begin() + static_cast<std::ptrdiff_t>(from), ev.end(), e);
  EXPECT_NE(it, ev.end()) << "no event '" << e << "'";
  return static_cast<size_t>(it - ev.begin());
}

// The recorded HSDP events of one backward over (R=2, Sd=2) and a 4-layer stack.
std::vector<std::string> recorded_schedule(comm::World& w, bool fusion) {
  comm::DeviceMesh mesh(w, {{"dp_replicate", 2}, {"dp_shard", 2}});
  RunOptions o;
  o.r = 2;
  o.sd = 2;
  o.layers = 4;
  o.hsdp.record_schedule = true;
  o.hsdp.comm_fusion = fusion;
  auto s = make_stack(o.layers);
  auto fs = shard_stack(s, mesh, o.hsdp);
  rank_loss(s, *fs, mesh, o, 0).backward();
  return fs->schedule();
}

TEST(FullyShard, UnfusedScheduleIssuesRsBeforeThePreviousArAndWaitsArsAtTheDrain) {
  run_ranks(4, [&](comm::World& w) {
    const auto ev = recorded_schedule(w, false);
    const size_t drain = index_of(ev, "drain begin");
    // Backward order: layers.3, layers.2, layers.1, layers.0, root.
    const std::vector<std::string> order{"layers.3", "layers.2", "layers.1", "layers.0", "root"};
    for (size_t n = 1; n < order.size(); ++n) {
      const size_t wait_prev = index_of(ev, "wait RS " + order[n - 1]);
      const size_t issue_rs = index_of(ev, "issue RS " + order[n]);
      EXPECT_LT(wait_prev, issue_rs) << order[n];
      const size_t issue_ar_prev = index_of(ev, "issue AR " + order[n - 1]);
      EXPECT_LT(issue_rs, issue_ar_prev)
          << "RS(" << order[n] << ") before AR(" << order[n - 1] << ")";
    }
    for (size_t i = 0; i < ev.size(); ++i) {
      if (ev[i].rfind("wait AR", 0) == 0) {
        EXPECT_GT(i, drain) << ev[i];
      }
    }
    EXPECT_LT(index_of(ev, "issue AR root"), index_of(ev, "wait AR root"));
    EXPECT_EQ(std::count(ev.begin(), ev.end(), "drain begin"), 1);
  });
}

TEST(FullyShard, FusedScheduleWaitsArTwoUnitsBack) {
  run_ranks(4, [&](comm::World& w) {
    const auto ev = recorded_schedule(w, true);
    // Post-backward of layers.1 (N): wait AR(layers.3) -> wait RS(layers.2), issue AR(layers.2)
    // -> issue RS(layers.1).
    const size_t a = index_of(ev, "wait AR layers.3");
    const size_t b = index_of(ev, "wait RS layers.2");
    const size_t c = index_of(ev, "issue AR layers.2");
    const size_t d = index_of(ev, "issue RS layers.1");
    EXPECT_LT(a, b);
    EXPECT_LT(b, c);
    EXPECT_LT(c, d);
    EXPECT_LT(d, index_of(ev, "drain begin"));
    EXPECT_GT(index_of(ev, "wait AR root"), index_of(ev, "drain begin"));
  });
}

TEST(FullyShard, OneDrainPerBackwardWithRecompute) {
  run_ranks(2, [&](comm::World& w) {
    comm::DeviceMesh mesh(w, {{"dp_replicate", 1}, {"dp_shard", 2}});
    RunOptions o;
    o.r = 1;
    o.sd = 2;
    o.recompute = true;
    o.hsdp.record_schedule = true;
    auto s = make_stack(3);
    auto fs = shard_stack(s, mesh, o.hsdp);
    for (int k = 0; k < 3; ++k)
      rank_loss(s, *fs, mesh, o, 0).backward();
    EXPECT_EQ(fs->stats().backwards, 3);
    const auto& ev = fs->schedule();
    EXPECT_EQ(std::count(ev.begin(), ev.end(), "drain begin"), 3);
    // Each drain comes after every unit's RS of its backward (none drained inside a recompute).
    const size_t first_drain = index_of(ev, "drain begin");
    EXPECT_LT(index_of(ev, "issue RS layers.0"), first_drain);
    EXPECT_LT(index_of(ev, "issue RS root"), first_drain);
  });
}

TEST(FullyShard, ParameterMemoryIsOneOverSdAndBytesMatchTheFormula) {
  run_ranks(4, [&](comm::World& w) {
    comm::DeviceMesh mesh(w, {{"dp_replicate", 1}, {"dp_shard", 4}});
    for (bool fusion : {false, true}) {
      RunOptions o;
      o.r = 1;
      o.sd = 4;
      o.hsdp.comm_fusion = fusion;
      auto s = make_stack(3);
      int64_t full = 0, padded = 0;
      for (auto& [n, t] : s.named) {
        full += t.numel();
        padded += (t.size(0) + 3) / 4 * 4 * (t.numel() / t.size(0));
      }
      auto fs = shard_stack(s, mesh, o.hsdp);
      EXPECT_EQ(fs->stats().full_numel, full);
      EXPECT_EQ(fs->stats().shard_numel * 4, padded);  // 1/Sd of the padded model
      EXPECT_EQ(fs->stats().resident_unsharded_numel, 0);
      w.context().counters.reset();
      rank_loss(s, *fs, mesh, o, 0).backward();
      const auto f = fs->bytes_per_step();
      auto& c = w.context().counters;
      EXPECT_EQ(c.bytes(comm::OpKind::kAllGather), f.all_gather);
      EXPECT_EQ(c.bytes(comm::OpKind::kReduceScatter), f.reduce_scatter);
      EXPECT_EQ(c.bytes(comm::OpKind::kAllReduce), f.all_reduce);
      EXPECT_GT(f.all_gather, 0);
    }
  });
}

// An update of the shards (what the optimizer does) is what the next forward gathers; a no-grad
// forward between a forward and its backward leaves that backward intact.
TEST(FullyShard, NextForwardSeesUpdatedShardsAndEvalInBetweenIsSafe) {
  RunOptions o;
  o.r = 2;
  o.sd = 2;
  auto ref_stack = make_stack(o.layers);
  {
    at::NoGradGuard g;
    for (auto& [n, t] : ref_stack.named)
      t.sub_(0.01 * at::ones_like(t));
  }
  auto h = data(4).mm(ref_stack.w_in);
  for (int i = 0; i < o.layers; ++i)
    h = layer_fn(ref_stack, i, h);
  const double ref_loss = (loss_of(h.mm(ref_stack.w_out)) / 16.0).item<double>();
  run_ranks(4, [&](comm::World& w) {
    comm::DeviceMesh mesh(w, {{"dp_replicate", 2}, {"dp_shard", 2}});
    auto s = make_stack(o.layers);
    auto fs = shard_stack(s, mesh, o.hsdp);
    auto loss = rank_loss(s, *fs, mesh, o, 0);
    {
      at::NoGradGuard g;
      rank_loss(s, *fs, mesh, o, 0);  // an evaluation in the middle of the step
    }
    loss.backward();
    {
      at::NoGradGuard g;
      for (auto& [name, shard] : fs->sharded_parameters())
        shard.sub_(0.01 * at::ones_like(shard));  // padding rows change too: never gathered
    }
    auto next = rank_loss(s, *fs, mesh, o, 0).detach();
    auto total = comm::all_reduce(w.group(), next).item<double>() / 4.0;
    EXPECT_NEAR(total, ref_loss, 1e-5);
    EXPECT_EQ(fs->stats().backwards, 1);
  });
}

// A forward that threw inside the root (on every rank, after unit 1 gathered and prefetched
// unit 2), and one whose output was dropped without a backward, are forgotten by the next
// forward_root: that step's loss and gradients equal the reference, and nothing stays gathered.
TEST(FullyShard, AForwardThatThrewOrWasDroppedIsForgotten) {
  RunOptions o;
  o.r = 2;
  o.sd = 2;
  const auto ref = reference(o.layers, 4);
  run_ranks(4, [&](comm::World& w) {
    comm::DeviceMesh mesh(w, {{"dp_replicate", 2}, {"dp_shard", 2}});
    auto s = make_stack(o.layers);
    auto fs = shard_stack(s, mesh, o.hsdp);
    auto x = data(4).narrow(0, w.rank() * kRowsPerRank, kRowsPerRank);
    HP_EXPECT_ERROR(fs->forward_root([&] {
      auto h =
          fs->forward_unit(1, x.mm(s.w_in), [&](const at::Tensor& t) { return layer_fn(s, 0, t); });
      HP_CHECK(false, "injected failure after unit 1");
      return h;
    }),
                    "injected failure after unit 1");
    EXPECT_GT(fs->stats().resident_unsharded_numel, 0) << "the failed forward left units gathered";
    rank_loss(s, *fs, mesh, o, 0);  // built and dropped: no backward will come
    auto loss = rank_loss(s, *fs, mesh, o, 0);
    loss.backward();
    auto total = comm::all_reduce(w.group(), loss.detach()).item<double>() / 4.0;
    EXPECT_NEAR(total, ref.loss, 1e-5);
    for (auto& [name, g] : ref.grads)
      expect_close(fs->full_gradient(name), g, "after the forgotten forwards: " + name, 1e-5, 1e-6);
    EXPECT_EQ(fs->stats().backwards, 1);
    EXPECT_EQ(fs->stats().resident_unsharded_numel, 0) << "parameters left gathered";
  });
}

TEST(FullyShard, MisuseFailsClearly) {
  run_ranks(2, [&](comm::World& w) {
    comm::DeviceMesh mesh(w, {{"dp_replicate", 1}, {"dp_shard", 2}});
    RunOptions o;
    o.sd = 2;
    auto s = make_stack(2);
    auto fs = shard_stack(s, mesh, o.hsdp);
    HP_EXPECT_ERROR(fs->forward_unit(7, s.w_in, [](const at::Tensor& t) { return t; }),
                    "forward_unit(7) is out of range; units 1..2");
    auto loss = rank_loss(s, *fs, mesh, o, 0);
    HP_EXPECT_ERROR(rank_loss(s, *fs, mesh, o, 0),
                    "unit 'root' ran forward twice without a backward in between");
    loss.backward();
    rank_loss(s, *fs, mesh, o, 0).backward();  // fine again
    auto t = at::ones({4}).requires_grad_(true);
    auto view = t.detach().view({2, 2}).requires_grad_(true);  // a tie through a view
    HP_EXPECT_ERROR(FullyShard({{"root", {{"a", t}, {"b", view}}}},
                               HsdpGroups{mesh.group_ptr({"dp_shard"}),
                                          mesh.group_ptr({"dp_replicate"}), nullptr}),
                    "parameter 'b' shares its memory with 'a' (a tied parameter); list it once");
    // An integer reduce dtype would truncate every gradient; a TP-partial gradient needs TP.
    HsdpOptions ints;
    ints.reduce_dtype = at::kLong;
    HP_EXPECT_ERROR(FullyShard({{"root", {{"a", t}}}},
                               HsdpGroups{mesh.group_ptr({"dp_shard"}),
                                          mesh.group_ptr({"dp_replicate"}), nullptr},
                               ints),
                    "HsdpOptions.reduce_dtype=Long is not a floating type");
    UnitParam partial{"a", t};
    partial.tp_partial_grad = true;
    HP_EXPECT_ERROR(
        FullyShard({{"root", {partial}}}, HsdpGroups{mesh.group_ptr({"dp_shard"}),
                                                     mesh.group_ptr({"dp_replicate"}), nullptr}),
        "parameter 'a' has tp_partial_grad=true (its gradient is summed over TP), but "
        "HsdpGroups.tp is null");
    // A refusal shards nothing: the parameters listed before the frozen one keep their memory
    // and values (before, they were released and their only copies lost with the throw).
    auto kept = at::arange(4, at::kFloat).requires_grad_(true);
    auto frozen = at::ones({2});
    HP_EXPECT_ERROR(FullyShard({{"root", {{"kept", kept}}}, {"layers.0", {{"frozen", frozen}}}},
                               HsdpGroups{mesh.group_ptr({"dp_shard"}),
                                          mesh.group_ptr({"dp_replicate"}), nullptr}),
                    "parameter 'frozen' does not require grad (frozen): HSDP shards parameters "
                    "it trains; unfreeze it");
    ASSERT_GT(kept.storage().nbytes(), 0u);
    EXPECT_TRUE(at::equal(kept, at::arange(4, at::kFloat)));
  });
}

}  // namespace
}  // namespace hp::hsdp
