#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "hp/comm/collectives.h"
#include "hp/common/check.h"
#include "hp/common/trace.h"
#include "rank_harness.h"

namespace hp::comm {
namespace {

using hp::testing::run_ranks;

TEST(CommHandle, ContinuationRunsExactlyOnceAndSecondWaitIsAnError) {
  auto w = World::fake(0, 2);
  int runs = 0;
  CommHandle h(w.group(), OpKind::kAllGather, 0, nullptr, {}, [&] {
    ++runs;
    return at::ones({2});
  });
  EXPECT_TRUE(h.valid());
  EXPECT_TRUE(at::equal(h.wait(), at::ones({2})));
  EXPECT_EQ(runs, 1);
  EXPECT_FALSE(h.valid());
  try {
    h.wait();
    FAIL() << "expected an error";
  } catch (const hp::Error& e) {
    EXPECT_NE(std::string(e.what()).find("CommHandle::wait called a second time for all_gather "
                                         "on group 'world'"),
              std::string::npos)
        << e.what();
  }
  EXPECT_EQ(runs, 1);
  CommHandle empty;
  EXPECT_THROW(empty.wait(), hp::Error);
}

// then() composes after the continuation, once, at wait(); a waited or empty handle refuses it.
TEST(CommHandle, ThenAppliesItsStepToWhatWaitReturns) {
  auto w = World::fake(0, 2);
  int runs = 0;
  CommHandle h(w.group(), OpKind::kAllToAll, 0, nullptr, {}, [&] {
    ++runs;
    return at::arange(4, at::kFloat);
  });
  auto doubled = std::move(h).then([](const at::Tensor& t) { return t * 2; });
  EXPECT_EQ(runs, 0) << "nothing runs before wait()";
  auto summed = std::move(doubled).then([](const at::Tensor& t) { return t.view({2, 2}).sum(1); });
  EXPECT_TRUE(at::equal(summed.wait(), at::tensor({2.0f, 10.0f})));
  EXPECT_EQ(runs, 1);
  EXPECT_THROW(std::move(summed).then([](const at::Tensor& t) { return t; }), hp::Error);
  EXPECT_THROW(CommHandle().then([](const at::Tensor& t) { return t; }), hp::Error);
}

TEST(CommHandle, SeveralInFlightWaitedInAnyOrder) {
  run_ranks(3, [](World& w) {
    auto& g = w.group();
    const double r = w.rank();
    auto a = all_reduce_async(g, at::full({4}, r));
    auto b = all_gather_async(g, at::full({2}, r), 0);
    auto c = all_to_all_async(g, at::arange(6, at::kFloat) + 10 * r, 0, 0);
    auto cc = c.wait();
    auto bb = b.wait();
    auto aa = a.wait();
    EXPECT_TRUE(at::equal(aa, at::full({4}, 3.0)));
    EXPECT_TRUE(at::equal(bb, at::tensor({0.f, 0.f, 1.f, 1.f, 2.f, 2.f})));
    // Rank r receives element pair r from every rank i: [2r, 2r+1] + 10 i.
    auto expect = at::cat({at::arange(2 * r, 2 * r + 2, at::kFloat),
                           at::arange(2 * r, 2 * r + 2, at::kFloat) + 10,
                           at::arange(2 * r, 2 * r + 2, at::kFloat) + 20});
    EXPECT_TRUE(at::equal(cc, expect)) << cc;
  });
}

TEST(CommHandle, HandleDroppedWithoutWaitKeepsBuffersUntilDone) {
  run_ranks(2, [](World& w) {
    {
      auto h = all_gather_async(w.group(), at::randn({1 << 16}), 0);
      // Dropped here: the destructor waits, so the backend never writes into freed memory.
    }
    auto ok = all_reduce(w.group(), at::ones({1}));
    EXPECT_EQ(ok.item<float>(), 2.0f);
  });
}

TEST(CommHandle, TraceRecordsEveryCollectiveOnItsRankTrack) {
  auto tracer = std::make_shared<common::Tracer>();
  hp::testing::RankOptions o;
  o.tracer = tracer;
  run_ranks(
      2,
      [](World& w) {
        all_gather(w.group(), at::ones({8}), 0);
        all_reduce(w.group(), at::ones({8}));
      },
      o);
  auto events = tracer->events();
  int gathers = 0;
  for (const auto& e : events) {
    if (e.category != "comm") continue;
    EXPECT_EQ(e.group, "world");
    EXPECT_LE(e.begin_us, e.end_us);
    if (e.name == "all_gather") {
      ++gathers;
      EXPECT_EQ(e.bytes, 32);
    }
  }
  EXPECT_EQ(gathers, 2);  // one per rank
  const std::string path = ::testing::TempDir() + "/hp_trace_test.json";
  common::write_chrome_trace(path, events);
  auto back = common::read_chrome_trace(path);
  EXPECT_EQ(back.size(), events.size());
  std::set<int> ranks;
  for (const auto& e : back)
    ranks.insert(e.rank);
  EXPECT_EQ(ranks, (std::set<int>{0, 1}));
}

TEST(CommHandle, CountersResetAndSplitByGroup) {
  run_ranks(2, [](World& w) {
    all_reduce(w.group(), at::ones({100}));
    auto& c = w.context().counters;
    EXPECT_EQ(c.bytes(OpKind::kAllReduce, "world"), 400);
    EXPECT_EQ(c.bytes(OpKind::kAllReduce, "other"), 0);
    EXPECT_EQ(c.calls(OpKind::kAllReduce), 1);
    c.reset();
    EXPECT_EQ(c.total_bytes(), 0);
  });
}

TEST(Groups, TimeoutIsPerGroup) {
  WorldOptions o;
  o.timeout = std::chrono::milliseconds(1234);
  auto w = World::fake(0, 2, o);
  EXPECT_EQ(w.group().timeout().count(), 1234);
  auto g = w.new_group({0, 1}, "short", std::chrono::milliseconds(50));
  EXPECT_EQ(g->timeout().count(), 50);
  EXPECT_EQ(w.new_group({1}, "not_mine"), nullptr);
}

}  // namespace
}  // namespace hp::comm
