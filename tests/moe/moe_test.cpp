// The MoE MLP against the float64 token-by-token reference (outputs, aux and z losses, every
// gradient), its capacity, its fail-fast checks, and expert parallelism (EP = 2, 4) against the
// single-process layer, including the order in which routed rows arrive.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include "hp/comm/collectives.h"
#include "hp/common/check.h"
#include "hp/moe/dispatch.h"
#include "hp/moe/moe.h"
#include "rank_harness.h"
#include "reference_moe.h"

namespace hp::moe {
namespace {

using hp::testing::expect_close;
using hp::testing::run_ranks;

MoEConfig small_config(int64_t experts, int64_t top_k, int64_t shared_ffn = 0) {
  MoEConfig c;
  c.hidden = 12;
  c.expert_ffn = 10;
  c.shared_ffn = shared_ffn;
  c.router.experts = experts;
  c.router.top_k = top_k;
  c.aux_loss_coef = 0.5;
  c.z_loss_coef = 0.25;
  c.seed = 7;
  return c;
}

at::Tensor tokens(int64_t seed, int64_t n, int64_t h) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(500 + seed);
  return at::randn({n, h}, gen, at::kDouble);
}

// The layer's weights as float64 leaves of the reference.
testing::ReferenceMoEWeights leaves(MoEImpl& m) {
  auto leaf = [](const at::Tensor& t) {
    return t.defined() ? t.detach().clone().requires_grad_(true) : at::Tensor();
  };
  return {leaf(m.router),      leaf(m.gate_proj), leaf(m.up_proj),    leaf(m.down_proj),
          leaf(m.shared_gate), leaf(m.shared_up), leaf(m.shared_down)};
}

struct Case {
  int64_t experts, top_k, shared;
  bool renormalize;
  double capacity;
};

class MoEReference : public ::testing::TestWithParam<Case> {};

TEST_P(MoEReference, OutputsLossesAndEveryGradientEqualTheTokenReference) {
  const auto cs = GetParam();
  auto c = small_config(cs.experts, cs.top_k, cs.shared);
  c.router.renormalize = cs.renormalize;
  c.router.capacity_factor = cs.capacity;
  MoE moe(c, /*layer=*/3);
  moe->to(at::kDouble);
  auto w = leaves(*moe);
  auto x = tokens(1, 24, c.hidden).view({2, 12, c.hidden}).requires_grad_(true);
  auto xr = x.detach().reshape({24, c.hidden}).clone().requires_grad_(true);
  auto y = moe->forward(x);
  auto ref = testing::reference_moe(xr, w, cs.top_k, cs.renormalize, cs.capacity);
  expect_close(y.reshape({24, c.hidden}), ref.out, "out", 1e-10, 1e-10);
  EXPECT_NEAR(moe->stats().aux_loss, ref.aux.item<double>(), 1e-12);
  EXPECT_NEAR(moe->stats().z_loss, ref.z.item<double>(), 1e-12);
  EXPECT_EQ(moe->stats().dropped, ref.dropped);
  EXPECT_EQ(moe->stats().per_expert,
            std::vector<int64_t>(ref.counts.data_ptr<int64_t>(),
                                 ref.counts.data_ptr<int64_t>() + cs.experts));
  if (cs.capacity > 0) {
    EXPECT_GT(ref.dropped, 0) << "the capacity case must drop something";
  } else {
    EXPECT_EQ(moe->stats().dropped, 0);
  }
  // One objective over the output and both losses: every gradient.
  auto probe = tokens(2, 24, c.hidden);
  ((y.reshape({24, c.hidden}) * probe).sum() + moe->loss()).backward();
  ((ref.out * probe).sum() + ref.aux * c.aux_loss_coef + ref.z * c.z_loss_coef).backward();
  expect_close(x.grad().reshape({24, c.hidden}), xr.grad(), "dx", 1e-9, 1e-10);
  expect_close(moe->router.grad(), w.router.grad(), "drouter", 1e-9, 1e-10);
  expect_close(moe->gate_proj.grad(), w.gate.grad(), "dgate", 1e-9, 1e-10);
  expect_close(moe->up_proj.grad(), w.up.grad(), "dup", 1e-9, 1e-10);
  expect_close(moe->down_proj.grad(), w.down.grad(), "ddown", 1e-9, 1e-10);
  if (cs.shared > 0) {
    expect_close(moe->shared_gate.grad(), w.shared_gate.grad(), "dshared_gate", 1e-9, 1e-10);
    expect_close(moe->shared_down.grad(), w.shared_down.grad(), "dshared_down", 1e-9, 1e-10);
  }
}

INSTANTIATE_TEST_SUITE_P(Routing, MoEReference,
                         ::testing::Values(Case{8, 2, 0, true, 0}, Case{8, 2, 6, false, 0},
                                           Case{4, 1, 0, true, 0}, Case{4, 4, 0, true, 0},
                                           Case{8, 2, 6, true, 0.5}),
                         [](const auto& info) {
                           const auto& c = info.param;
                           return "E" + std::to_string(c.experts) + "_k" + std::to_string(c.top_k) +
                                  (c.shared ? "_shared" : "") +
                                  (c.renormalize ? "_renorm" : "_raw") +
                                  (c.capacity > 0 ? "_capacity" : "");
                         });

TEST(MoE, BadConfigurationsFailNamingTheField) {
  auto expect_error = [](const std::function<void()>& fn, const std::string& needle) {
    try {
      fn();
      ADD_FAILURE() << "expected an error containing: " << needle;
    } catch (const hp::Error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  expect_error([] { MoE(small_config(4, 5), 0); },
               "RouterOptions.top_k=5 must be between 1 and experts=4");
  expect_error([] { MoE(small_config(0, 1), 0); }, "RouterOptions.experts=0");
  auto c = small_config(4, 2);
  c.router.capacity_factor = -1;
  expect_error([&] { MoE(c, 0); }, "capacity_factor=-1");
  run_ranks(3, [&](comm::World& w) {
    MoE m(small_config(4, 2), 0);
    expect_error([&] { m->set_expert_parallel(w.group_ptr(), nullptr); },
                 "experts=4 is not divisible by ep=3");
  });
}

// The capacity is at most every assignment: a huge factor keeps them all (it overflowed the
// integer cast and dropped every one), and a tight one drops past ceil(f T k / E).
TEST(MoE, CapacityNeverExceedsTheAssignments) {
  auto logits = at::randn({16, 4}, at::kDouble);
  RouterOptions o;
  o.experts = 4;
  o.top_k = 2;
  for (double f : {1e17, 1e30, 1e300}) {
    o.capacity_factor = f;
    auto r = route(logits, o);
    EXPECT_EQ(r.dropped, 0) << f;
    EXPECT_TRUE(r.kept.all().item<bool>()) << f;
  }
  o.capacity_factor = 0.5;  // 4 assignments per expert of 32
  auto r = route(logits, o);
  EXPECT_EQ(r.dropped, 32 - (expert_counts(r, 4).clamp_max(4)).sum().item<int64_t>());
}

// EP over P ranks, each with its own tokens, equals the single-process layer over all of them:
// outputs, the loss (the shares sum to it), the router's and shared expert's gradients (summed
// over ranks), and each rank's experts' gradients.
void expect_ep_equals_single_process(int p, int64_t shared) {
  auto c = small_config(8, 2, shared);
  const int64_t n = 10;
  MoE single(c, 1);
  single->to(at::kDouble);
  std::vector<at::Tensor> xs;
  for (int r = 0; r < p; ++r)
    xs.push_back(tokens(10 + r, n + r, c.hidden));
  auto all = at::cat(xs).requires_grad_(true);
  auto y_all = single->forward(all);
  auto probe_all = tokens(99, all.size(0), c.hidden);
  ((y_all * probe_all).sum() + single->loss()).backward();
  run_ranks(p, [&](comm::World& w) {
    const int r = w.rank();
    MoE m(c, 1);
    m->to(at::kDouble);
    m->set_expert_parallel(w.group_ptr(), w.group_ptr());
    EXPECT_EQ(m->local_experts(), 8 / p);
    int64_t begin = 0;
    for (int i = 0; i < r; ++i)
      begin += xs[i].size(0);
    auto x = xs[r].clone().requires_grad_(true);
    auto y = m->forward(x);
    expect_close(y, y_all.detach().narrow(0, begin, x.size(0)), "EP out", 1e-10, 1e-10);
    auto loss = comm::all_reduce(w.group(), m->loss().detach().reshape({1}));
    EXPECT_NEAR(loss.item<double>(), single->loss().item<double>(), 1e-12);
    ((y * probe_all.narrow(0, begin, x.size(0))).sum() + m->loss()).backward();
    expect_close(x.grad(), all.grad().narrow(0, begin, x.size(0)), "EP dx", 1e-9, 1e-10);
    expect_close(comm::all_reduce(w.group(), m->router.grad()), single->router.grad(), "EP drouter",
                 1e-9, 1e-10);
    const int64_t first = m->first_expert(), local = m->local_experts();
    EXPECT_EQ(first, r * local);
    expect_close(m->gate_proj.grad(), single->gate_proj.grad().narrow(0, first, local), "EP dgate",
                 1e-9, 1e-10);
    expect_close(m->up_proj.grad(), single->up_proj.grad().narrow(0, first, local), "EP dup", 1e-9,
                 1e-10);
    expect_close(m->down_proj.grad(), single->down_proj.grad().narrow(0, first, local), "EP ddown",
                 1e-9, 1e-10);
    if (shared > 0) {
      expect_close(comm::all_reduce(w.group(), m->shared_up.grad()), single->shared_up.grad(),
                   "EP dshared_up", 1e-9, 1e-10);
    }
    // The dispatch and combine moved exactly the rows routed between this rank and the others'
    // experts, forward and backward (8-byte values), plus this rank's counts per local expert.
    const int64_t moved = w.context().counters.bytes(comm::OpKind::kAllToAll);
    const auto& per_expert = m->stats().per_expert;  // this rank's rows per global expert
    auto everyone = comm::all_gather(w.group(), at::tensor(per_expert, at::kLong).view({1, 8}), 0);
    int64_t to_others = 0, from_others = 0;
    for (int64_t e = 0; e < 8; ++e) {
      if (e / local != r) to_others += per_expert[static_cast<size_t>(e)];
      for (int s = 0; s < p && e / local == r; ++s)
        if (s != r) from_others += everyone[s][e].item<int64_t>();
    }
    EXPECT_GT(to_others + from_others, 0);
    EXPECT_EQ(moved, 2 * (to_others + from_others) * c.hidden * 8 + local * (p - 1) * 8);
  });
}

TEST(MoEExpertParallel, TwoRanksEqualTheSingleProcessLayer) {
  expect_ep_equals_single_process(2, 0);
}

TEST(MoEExpertParallel, FourRanksWithASharedExpertEqualTheSingleProcessLayer) {
  expect_ep_equals_single_process(4, 6);
}

// Rows carry (source rank, token, expert): each rank's experts receive them grouped by expert,
// then in source-rank order, then in token order; combine returns every row to its place.
TEST(MoEExpertParallel, RoutedRowsArriveInSourceThenTokenOrder) {
  const int p = 3;
  const int64_t experts = 6;
  run_ranks(p, [&](comm::World& w) {
    const int me = w.rank();
    // Token t of rank s goes to expert (t * (s + 1)) % E; rows sorted by expert, then token.
    std::vector<std::vector<int64_t>> by_expert(experts);
    for (int64_t t = 0; t < 9; ++t)
      by_expert[(t * (me + 1)) % experts].push_back(t);
    std::vector<int64_t> counts;
    std::vector<at::Tensor> rows;
    for (int64_t e = 0; e < experts; ++e) {
      counts.push_back(static_cast<int64_t>(by_expert[e].size()));
      for (auto t : by_expert[e])
        rows.push_back(
            at::tensor({static_cast<double>(me), static_cast<double>(t), static_cast<double>(e)}));
    }
    auto x = at::stack(rows);
    const auto plan = plan_dispatch(counts, w.group());
    auto got = dispatch(x, plan, w.group_ptr());
    ASSERT_EQ(got.size(0), std::accumulate(plan.rows_per_expert.begin(), plan.rows_per_expert.end(),
                                           int64_t{0}));
    int64_t row = 0;
    for (int64_t j = 0; j < experts / p; ++j) {
      const int64_t expert = me * (experts / p) + j;
      double last_src = -1, last_token = -1;
      for (int64_t k = 0; k < plan.rows_per_expert[j]; ++k, ++row) {
        const double src = got[row][0].item<double>(), tok = got[row][1].item<double>();
        EXPECT_EQ(got[row][2].item<double>(), static_cast<double>(expert));
        EXPECT_TRUE(src > last_src || (src == last_src && tok > last_token))
            << "row " << row << " (src " << src << ", token " << tok << ") after (" << last_src
            << ", " << last_token << ")";
        last_src = src;
        last_token = tok;
      }
    }
    expect_close(combine(got, plan, w.group_ptr()), x, "combine inverts dispatch", 0, 0);
  });
}

}  // namespace
}  // namespace hp::moe
