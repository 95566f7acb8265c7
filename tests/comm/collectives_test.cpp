// Every collective over world sizes 1..4, several dims and dtypes, against closed-form
// expectations; measured bytes against the formulas; bad input errors before communication.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "hp/comm/collectives.h"
#include "hp/common/check.h"
#include "rank_harness.h"

namespace hp::comm {
namespace {

using hp::testing::run_ranks;

// Rank r's input: small integers, exact in bfloat16 and in sums over 4 ranks.
at::Tensor input_for(int r, at::IntArrayRef shape, at::ScalarType dtype) {
  int64_t n = 1;
  for (auto s : shape)
    n *= s;
  return (at::arange(n, at::kLong).remainder(16) + 16 * r).reshape(shape).to(dtype);
}

std::vector<at::Tensor> all_inputs(int p, at::IntArrayRef shape, at::ScalarType dtype) {
  std::vector<at::Tensor> v;
  for (int r = 0; r < p; ++r)
    v.push_back(input_for(r, shape, dtype));
  return v;
}

void expect_equal(const at::Tensor& a, const at::Tensor& b, const std::string& what) {
  ASSERT_EQ(a.sizes(), b.sizes()) << what;
  ASSERT_EQ(a.scalar_type(), b.scalar_type()) << what;
  EXPECT_TRUE(at::equal(a, b)) << what;
}

class CollectivesTest : public ::testing::TestWithParam<std::tuple<int, at::ScalarType>> {};

TEST_P(CollectivesTest, AllGatherEveryDim) {
  auto [p, dtype] = GetParam();
  run_ranks(p, [p = p, dtype = dtype](World& w) {
    const std::vector<int64_t> shape = {2, 3, 4};
    auto inputs = all_inputs(p, shape, dtype);
    for (int64_t dim : {0, 1, 2, -1}) {
      auto& ctx = w.context();
      const int64_t before = ctx.counters.bytes(OpKind::kAllGather);
      auto out = all_gather(w.group(), inputs[w.rank()], dim);
      expect_equal(out, at::cat(inputs, dim), "all_gather dim " + std::to_string(dim));
      const int64_t in_bytes = inputs[0].numel() * inputs[0].element_size();
      EXPECT_EQ(ctx.counters.bytes(OpKind::kAllGather) - before, (p - 1) * in_bytes);
    }
  });
}

TEST_P(CollectivesTest, ReduceScatterSumAvgMax) {
  auto [p, dtype] = GetParam();
  run_ranks(p, [p = p, dtype = dtype](World& w) {
    const std::vector<int64_t> shape = {2, 2 * p, 3, p};
    auto inputs = all_inputs(p, shape, dtype);
    auto stacked = at::stack(inputs).to(at::kDouble);
    for (int64_t dim : {1, 3}) {
      auto sum = stacked.sum(0).chunk(p, dim)[w.rank()];
      auto& ctx = w.context();
      const int64_t before = ctx.counters.bytes(OpKind::kReduceScatter);
      auto out = reduce_scatter(w.group(), inputs[w.rank()], dim);
      expect_equal(out, sum.to(dtype), "reduce_scatter sum dim " + std::to_string(dim));
      const int64_t in_bytes = inputs[0].numel() * inputs[0].element_size();
      EXPECT_EQ(ctx.counters.bytes(OpKind::kReduceScatter) - before, in_bytes * (p - 1) / p);
      auto avg = reduce_scatter(w.group(), inputs[w.rank()], dim, ReduceOp::kAvg);
      hp::testing::expect_close(avg, (sum / p).to(dtype), "reduce_scatter avg", 1e-2, 1e-2);
      auto mx = reduce_scatter(w.group(), inputs[w.rank()], dim, ReduceOp::kMax);
      expect_equal(mx, std::get<0>(stacked.max(0)).chunk(p, dim)[w.rank()].to(dtype),
                   "reduce_scatter max");
    }
  });
}

TEST_P(CollectivesTest, AllToAllEverySplitConcatPair) {
  auto [p, dtype] = GetParam();
  run_ranks(p, [p = p, dtype = dtype](World& w) {
    const std::vector<int64_t> shape = {2, 2 * p, 3, p};
    auto inputs = all_inputs(p, shape, dtype);
    for (int64_t split : {1, 3}) {
      for (int64_t concat : {0, 1, 2, 3}) {
        std::vector<at::Tensor> pieces;
        for (int i = 0; i < p; ++i)
          pieces.push_back(inputs[i].chunk(p, split)[w.rank()]);
        auto& ctx = w.context();
        const int64_t before = ctx.counters.bytes(OpKind::kAllToAll);
        auto out = all_to_all(w.group(), inputs[w.rank()], split, concat);
        expect_equal(
            out, at::cat(pieces, concat),
            "all_to_all split " + std::to_string(split) + " concat " + std::to_string(concat));
        const int64_t in_bytes = inputs[0].numel() * inputs[0].element_size();
        EXPECT_EQ(ctx.counters.bytes(OpKind::kAllToAll) - before, in_bytes * (p - 1) / p);
      }
    }
  });
}

// Rank i sends (i + 2j) % 3 rows to rank j (zero-row segments included); every row carries its
// source, destination and index, so the received order is visible.
TEST_P(CollectivesTest, AllToAllVariableRowsArriveInRankOrder) {
  auto [p, dtype] = GetParam();
  run_ranks(p, [p = p, dtype = dtype](World& w) {
    auto rows = [](int from, int to) { return static_cast<int64_t>((from + 2 * to) % 3); };
    auto row_value = [](int from, int to, int64_t k) {
      return static_cast<double>(from * 16 + to * 4 + k);
    };
    const int me = w.rank();
    std::vector<int64_t> send, expected_recv;
    std::vector<at::Tensor> mine, expected;
    for (int j = 0; j < p; ++j) {
      send.push_back(rows(me, j));
      expected_recv.push_back(rows(j, me));
      for (int64_t k = 0; k < rows(me, j); ++k)
        mine.push_back(at::full({1, 2}, row_value(me, j, k), dtype));
      for (int64_t k = 0; k < rows(j, me); ++k)
        expected.push_back(at::full({1, 2}, row_value(j, me, k), dtype));
    }
    auto in = mine.empty() ? at::empty({0, 2}, dtype) : at::cat(mine);
    const auto recv = all_to_all_counts(w.group(), send);
    EXPECT_EQ(recv, expected_recv);
    auto& ctx = w.context();
    const int64_t before = ctx.counters.bytes(OpKind::kAllToAll);
    const int64_t formula_before = ctx.counters.formula_bytes(OpKind::kAllToAll);
    auto out = all_to_all_v(w.group(), in, send, recv);
    expect_equal(out, expected.empty() ? at::empty({0, 2}, dtype) : at::cat(expected),
                 "all_to_all_v");
    const int64_t to_others = in.size(0) - send[me];
    const int64_t row_bytes = 2 * static_cast<int64_t>(in.element_size());
    EXPECT_EQ(ctx.counters.bytes(OpKind::kAllToAll) - before, to_others * row_bytes);
    EXPECT_EQ(ctx.counters.formula_bytes(OpKind::kAllToAll) - formula_before,
              to_others * row_bytes);
    if (in.size(0) > 0) {
      EXPECT_THROW(
          {
            try {
              all_to_all_v(w.group(), in, std::vector<int64_t>(p, 0), recv);
            } catch (const hp::Error& e) {
              EXPECT_NE(std::string(e.what()).find("the counts must cover every row"),
                        std::string::npos)
                  << e.what();
              throw;
            }
          },
          hp::Error);
    }
    if (p > 1) {
      EXPECT_THROW(all_to_all_v(w.group(), in, {1}, {1}), hp::Error);
    }
  });
}

TEST_P(CollectivesTest, AllReduceOps) {
  auto [p, dtype] = GetParam();
  run_ranks(p, [p = p, dtype = dtype](World& w) {
    const std::vector<int64_t> shape = {3, 5};
    auto inputs = all_inputs(p, shape, dtype);
    auto stacked = at::stack(inputs).to(at::kDouble);
    auto& ctx = w.context();
    const int64_t before = ctx.counters.bytes(OpKind::kAllReduce);
    auto sum = all_reduce(w.group(), inputs[w.rank()]);
    expect_equal(sum, stacked.sum(0).to(dtype), "all_reduce sum");
    const int64_t in_bytes = inputs[0].numel() * inputs[0].element_size();
    // Counted: the buffer handed to Gloo (bfloat16 is reduced as float32: twice the bytes);
    // the ring moves 2(P-1)/P of it per rank, which is what the formula beside it says.
    const int64_t handed =
        p == 1 ? 0 : inputs[0].numel() * (dtype == at::kBFloat16 ? 4 : inputs[0].element_size());
    EXPECT_EQ(ctx.counters.bytes(OpKind::kAllReduce) - before, handed);
    EXPECT_EQ(ctx.counters.formula_bytes(OpKind::kAllReduce), 2 * in_bytes * (p - 1) / p);
    expect_equal(all_reduce(w.group(), inputs[w.rank()], ReduceOp::kMax),
                 std::get<0>(stacked.max(0)).to(dtype), "all_reduce max");
    expect_equal(all_reduce(w.group(), inputs[w.rank()], ReduceOp::kMin),
                 std::get<0>(stacked.min(0)).to(dtype), "all_reduce min");
    hp::testing::expect_close(all_reduce(w.group(), inputs[w.rank()], ReduceOp::kAvg),
                              (stacked.sum(0) / p).to(dtype), "all_reduce avg", 1e-2, 1e-2);
    // The input is never modified.
    expect_equal(inputs[w.rank()], input_for(w.rank(), shape, dtype), "input untouched");
  });
}

TEST_P(CollectivesTest, SendRecvRingAndExchange) {
  auto [p, dtype] = GetParam();
  if (p == 1) GTEST_SKIP() << "point-to-point needs two ranks";
  run_ranks(p, [p = p, dtype = dtype](World& w) {
    auto& g = w.group();
    const int r = w.rank();
    const std::vector<int64_t> shape = {4, 3};
    // Ring: send to r+1, receive from r-1; both in flight together.
    auto s = send_async(g, input_for(r, shape, dtype), (r + 1) % p);
    auto got = recv(g, shape, dtype, (r + p - 1) % p);
    s.wait();
    expect_equal(got, input_for((r + p - 1) % p, shape, dtype), "ring recv");
    EXPECT_EQ(w.context().counters.bytes(OpKind::kSend),
              12 * input_for(0, {1}, dtype).element_size());
    // Pairwise exchange (0<->1, 2<->3; an odd last rank exchanges with itself).
    const int peer = (r ^ 1) < p ? (r ^ 1) : r;
    expect_equal(exchange(g, input_for(r, shape, dtype), peer), input_for(peer, shape, dtype),
                 "exchange");
  });
}

INSTANTIATE_TEST_SUITE_P(WorldSizesAndDtypes, CollectivesTest,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4),
                                            ::testing::Values(at::kFloat, at::kDouble,
                                                              at::kBFloat16)),
                         [](const auto& info) {
                           return "P" + std::to_string(std::get<0>(info.param)) + "_" +
                                  std::string(c10::toString(std::get<1>(info.param)));
                         });

TEST(CollectivesErrors, BadInputFailsBeforeCommunication) {
  run_ranks(2, [](World& w) {
    auto& g = w.group();
    auto rec = w.context().recorder;
    auto x = at::zeros({2, 3});
    auto expect_error = [&](const std::function<void()>& fn, const std::string& needle) {
      try {
        fn();
        ADD_FAILURE() << "expected an error containing: " << needle;
      } catch (const hp::Error& e) {
        EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
      }
    };
    expect_error([&] { all_gather(g, x, 2); },
                 "all_gather on group 'world': dim=2 is out of range for a 2-d tensor of shape "
                 "[2,3] (valid: -2..1)");
    expect_error([&] { reduce_scatter(g, x, 1); },
                 "reduce_scatter on group 'world': dim=1 of shape [2,3] has size 3, which is not "
                 "divisible by the group size 2; pad that dim to a multiple of 2");
    expect_error([&] { all_to_all(g, x, 1, 0); }, "split_dim=1 of shape [2,3] has size 3");
    expect_error([&] { all_to_all(g, x, 0, 5); }, "concat_dim=5 is out of range");
    expect_error([&] { all_reduce(g, at::Tensor()); }, "the input tensor is undefined");
    expect_error([&] { send(g, x, w.rank()); },
                 "dst=" + std::to_string(w.rank()) + " must be another rank of the group");
    EXPECT_TRUE(rec->records().empty()) << "a rejected call must not reach the backend";
  });
}

TEST(CollectivesErrors, ShapeMismatchAcrossRanksIsAClearError) {
  EXPECT_THROW(
      {
        try {
          run_ranks(2, [](World& w) { all_gather(w.group(), at::zeros({2, 3 + w.rank()}), 0); });
        } catch (const hp::Error& e) {
          const std::string msg = e.what();
          EXPECT_NE(msg.find("ranks disagree on the input (rank 0 [2,3] Float, rank 1 [2,4] "
                             "Float); every rank must pass the same shape and dtype"),
                    std::string::npos)
              << msg;
          throw;
        }
      },
      hp::Error);
}

}  // namespace
}  // namespace hp::comm
