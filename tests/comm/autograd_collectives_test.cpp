// Differentiable collectives: outputs and input gradients equal a single-process computation
// of the same math over all ranks' inputs.
#include <chrono>
#include <thread>

#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/generated/variable_factories.h>

#include "hp/comm/async_transfer.h"
#include "hp/comm/autograd_collectives.h"
#include "hp/common/check.h"
#include "rank_harness.h"

namespace hp::comm {
namespace {

using hp::testing::expect_close;
using hp::testing::run_ranks;

at::Tensor seeded(int seed, at::IntArrayRef shape) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + seed);
  return at::randn(shape, gen, at::kFloat);
}

// Reference: leaves x_0..x_{P-1}; per-rank outputs y_r = f(r, xs); loss = sum_r <y_r, w_r>.
// Returns the grads of every x_r.
std::vector<at::Tensor> reference_grads(
    int p, at::IntArrayRef in_shape,
    const std::function<at::Tensor(int, const std::vector<at::Tensor>&)>& f,
    std::vector<at::Tensor>* outputs, at::IntArrayRef out_shape) {
  std::vector<at::Tensor> xs;
  for (int r = 0; r < p; ++r)
    xs.push_back(seeded(r, in_shape).requires_grad_(true));
  at::Tensor loss = at::zeros({});
  for (int r = 0; r < p; ++r) {
    auto y = f(r, xs);
    outputs->push_back(y.detach());
    loss = loss + (y * seeded(100 + r, out_shape)).sum();
  }
  loss.backward();
  std::vector<at::Tensor> grads;
  for (auto& x : xs)
    grads.push_back(x.grad());
  return grads;
}

class AutogradCollectivesTest : public ::testing::TestWithParam<int> {};

TEST_P(AutogradCollectivesTest, AllGatherBackwardIsReduceScatter) {
  const int p = GetParam();
  const std::vector<int64_t> in_shape = {2, 3, 4};
  const std::vector<int64_t> out_shape = {2, 3 * p, 4};
  std::vector<at::Tensor> ref_out;
  auto ref = reference_grads(
      p, in_shape, [](int, const std::vector<at::Tensor>& xs) { return at::cat(xs, 1); }, &ref_out,
      out_shape);
  run_ranks(p, [&](World& w) {
    auto x = seeded(w.rank(), in_shape).requires_grad_(true);
    auto y = all_gather_autograd(x, 1, w.group_ptr());
    expect_close(y, ref_out[w.rank()], "all_gather out");
    (y * seeded(100 + w.rank(), out_shape)).sum().backward();
    expect_close(x.grad(), ref[w.rank()], "all_gather dx");
  });
}

TEST_P(AutogradCollectivesTest, ReduceScatterBackwardIsAllGather) {
  const int p = GetParam();
  const std::vector<int64_t> in_shape = {2 * p, 3};
  const std::vector<int64_t> out_shape = {2, 3};
  std::vector<at::Tensor> ref_out;
  auto ref = reference_grads(
      p, in_shape,
      [p](int r, const std::vector<at::Tensor>& xs) { return at::stack(xs).sum(0).chunk(p, 0)[r]; },
      &ref_out, out_shape);
  run_ranks(p, [&](World& w) {
    auto x = seeded(w.rank(), in_shape).requires_grad_(true);
    auto y = reduce_scatter_autograd(x, 0, w.group_ptr());
    expect_close(y, ref_out[w.rank()], "reduce_scatter out");
    (y * seeded(100 + w.rank(), out_shape)).sum().backward();
    expect_close(x.grad(), ref[w.rank()], "reduce_scatter dx");
  });
}

// BNSD and BSHD layouts for the Ulysses pair.
struct Layout {
  int64_t seq_dim, head_dim;
};

TEST_P(AutogradCollectivesTest, UlyssesSeqToHeadAndBack) {
  const int p = GetParam();
  for (Layout lay : {Layout{2, 1}, Layout{1, 2}}) {
    // Full tensor [B=2, N=2p, S=3p, D=4] in BNSD, or [B, S, N, D] in BSHD.
    std::vector<int64_t> full = {2, 0, 0, 4};
    full[lay.head_dim] = 2 * p;
    full[lay.seq_dim] = 3 * p;
    auto in_shape = full;
    in_shape[lay.seq_dim] /= p;  // sequence shard
    auto out_shape = full;
    out_shape[lay.head_dim] /= p;  // head shard
    std::vector<at::Tensor> ref_out;
    auto ref = reference_grads(
        p, in_shape,
        [&](int r, const std::vector<at::Tensor>& xs) {
          return at::cat(xs, lay.seq_dim).chunk(p, lay.head_dim)[r];
        },
        &ref_out, out_shape);
    run_ranks(p, [&](World& w) {
      auto x = seeded(w.rank(), in_shape).requires_grad_(true);
      auto y = ulysses_seq_to_head(x, lay.seq_dim, lay.head_dim, w.group_ptr());
      expect_close(y, ref_out[w.rank()], "seq_to_head out");
      // Round trip restores the shard exactly; its backward is the inverse too.
      auto back = ulysses_head_to_seq(y, lay.seq_dim, lay.head_dim, w.group_ptr());
      EXPECT_TRUE(at::equal(back, x.detach()));
      (y * seeded(100 + w.rank(), out_shape)).sum().backward();
      expect_close(x.grad(), ref[w.rank()], "seq_to_head dx");
    });
  }
}

TEST_P(AutogradCollectivesTest, UlyssesHeadToSeq) {
  const int p = GetParam();
  const std::vector<int64_t> in_shape = {1, 2, 3 * p, 4};   // [B, N/P, S, D]
  const std::vector<int64_t> out_shape = {1, 2 * p, 3, 4};  // [B, N, S/P, D]
  std::vector<at::Tensor> ref_out;
  auto ref = reference_grads(
      p, in_shape,
      [p](int r, const std::vector<at::Tensor>& xs) {
        std::vector<at::Tensor> parts;
        for (const auto& x : xs)
          parts.push_back(x.chunk(p, 2)[r]);
        return at::cat(parts, 1);
      },
      &ref_out, out_shape);
  run_ranks(p, [&](World& w) {
    auto x = seeded(w.rank(), in_shape).requires_grad_(true);
    auto y = ulysses_head_to_seq(x, 2, 1, w.group_ptr());
    expect_close(y, ref_out[w.rank()], "head_to_seq out");
    (y * seeded(100 + w.rank(), out_shape)).sum().backward();
    expect_close(x.grad(), ref[w.rank()], "head_to_seq dx");
  });
}

TEST_P(AutogradCollectivesTest, P2PExchangeBackwardIsExchange) {
  const int p = GetParam();
  auto peer_of = [p](int r) { return (r ^ 1) < p ? (r ^ 1) : r; };
  const std::vector<int64_t> shape = {3, 5};
  std::vector<at::Tensor> ref_out;
  auto ref = reference_grads(
      p, shape, [&](int r, const std::vector<at::Tensor>& xs) { return xs[peer_of(r)] * 1.0; },
      &ref_out, shape);
  run_ranks(p, [&](World& w) {
    auto x = seeded(w.rank(), shape).requires_grad_(true);
    auto y = p2p_exchange(x, peer_of(w.rank()), w.group_ptr());
    expect_close(y, ref_out[w.rank()], "exchange out");
    (y * seeded(100 + w.rank(), shape)).sum().backward();
    expect_close(x.grad(), ref[w.rank()], "exchange dx");
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizes, AutogradCollectivesTest, ::testing::Values(1, 2, 3, 4),
                         [](const auto& info) { return "P" + std::to_string(info.param); });

// Rank i sends (i + j + 1) % 3 rows to rank j; the backward returns each row's gradient to
// the rank and place it came from.
TEST_P(AutogradCollectivesTest, AllToAllVariableRowsBackwardReturnsEachRow) {
  const int p = GetParam();
  auto rows = [](int from, int to) { return static_cast<int64_t>((from + to + 1) % 3); };
  auto total = [&](int from) {
    int64_t n = 0;
    for (int j = 0; j < p; ++j)
      n += rows(from, j);
    return n;
  };
  auto total_in = [&](int to) {
    int64_t n = 0;
    for (int i = 0; i < p; ++i)
      n += rows(i, to);
    return n;
  };
  // Reference: rank j's output is the concatenation over i of rank i's segment j.
  std::vector<at::Tensor> xs, ys;
  at::Tensor loss = at::zeros({});
  for (int i = 0; i < p; ++i)
    xs.push_back(seeded(i, {total(i), 3}).requires_grad_(true));
  for (int j = 0; j < p; ++j) {
    std::vector<at::Tensor> parts;
    for (int i = 0; i < p; ++i) {
      int64_t start = 0;
      for (int k = 0; k < j; ++k)
        start += rows(i, k);
      parts.push_back(xs[i].narrow(0, start, rows(i, j)));
    }
    ys.push_back(at::cat(parts));
    loss = loss + (ys.back() * seeded(100 + j, {total_in(j), 3})).sum();
  }
  loss.backward();
  run_ranks(p, [&](World& w) {
    const int me = w.rank();
    std::vector<int64_t> send, recv;
    for (int j = 0; j < p; ++j) {
      send.push_back(rows(me, j));
      recv.push_back(rows(j, me));
    }
    auto x = seeded(me, {total(me), 3}).requires_grad_(true);
    auto y = all_to_all_v_autograd(x, send, recv, w.group_ptr());
    expect_close(y, ys[me].detach(), "all_to_all_v out");
    (y * seeded(100 + me, {total_in(me), 3})).sum().backward();
    expect_close(x.grad(), xs[me].grad(), "all_to_all_v dx");
  });
}

// A started all-gather or all-to-all says whether its wait would block: not while a peer has
// not launched it (rank 1 enters 300 ms late), yes once every rank has (polled, bounded).
// Without the harness's shape exchange, which would hold each launch until the peer arrives.
TEST(AsyncTransfer, StartedCollectivesTellWhenTheyHaveLanded) {
  hp::testing::RankOptions o;
  o.verify_shapes = false;
  run_ranks(
      2,
      [](World& w) {
        const double r = w.rank();
        if (w.rank() == 1) std::this_thread::sleep_for(std::chrono::milliseconds(300));
        auto gather = all_gather_start(at::full({2}, r), 0, w.group_ptr());
        auto moved = all_to_all_start(at::full({2}, r), 0, 0, w.group_ptr());
        if (w.rank() == 0) {
          EXPECT_FALSE(gather.landed()) << "rank 1 has not launched the gather yet";
          EXPECT_FALSE(moved.landed());
        }
        auto landed = [&] { return gather.landed() && moved.landed(); };
        for (int i = 0; i < 2000 && !landed(); ++i)
          std::this_thread::sleep_for(std::chrono::milliseconds(5));
        EXPECT_TRUE(landed());
        EXPECT_TRUE(at::equal(gather.wait(), at::tensor({0.f, 0.f, 1.f, 1.f})));
        EXPECT_TRUE(at::equal(moved.wait(), at::tensor({0.f, 1.f})));
        EXPECT_TRUE(gather.landed());  // finished
      },
      o);
}

// A ring step in which only some members take part (the ring's routes): rank 0 only sends (to
// rank 1), rank 1 receives from rank 0 and sends to rank 2, rank 2 only receives; a sender and
// its receiver agree on each leg. An offset that would send a rank to itself is refused.
TEST(AsyncTransfer, ShiftLegsRunOnlyWhereTheMembersTakePart) {
  run_ranks(3, [](World& w) {
    const int64_t r = w.rank();
    auto mine = at::full({2}, static_cast<double>(r));
    auto got =
        shift_legs_async(w.group(), r < 2 ? mine : at::Tensor(), r > 0 ? mine : at::Tensor(), 1)();
    if (r == 0) {
      EXPECT_FALSE(got.defined());
    } else {
      EXPECT_TRUE(at::equal(got, at::full({2}, static_cast<double>(r - 1))));
    }
  });
  run_ranks(2, [](World& w) {
    HP_EXPECT_ERROR(shift_legs_async(w.group(), at::ones({1}), at::ones({1}), 2),
                    "shift_legs_async: offset 2 is a multiple of the size of group 'world'");
  });
}

TEST(AutogradCollectivesErrors, SameSeqAndHeadDimIsRejected) {
  run_ranks(2, [](World& w) {
    try {
      ulysses_seq_to_head(at::zeros({1, 2, 4, 2}), 2, -2, w.group_ptr());
      ADD_FAILURE() << "expected an error";
    } catch (const hp::Error& e) {
      EXPECT_NE(std::string(e.what()).find("seq_dim and head_dim are both 2"), std::string::npos)
          << e.what();
    }
  });
}

}  // namespace
}  // namespace hp::comm
