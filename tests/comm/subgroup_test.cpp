// Sub-groups over a parent group's point-to-point legs (comm/subgroup.h): each collective gives
// what the same collective over a group of just those ranks gives, with disjoint and overlapping
// sub-groups in flight at once, and counts the bytes it handed the parent's transport.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "hp/comm/collectives.h"
#include "hp/comm/subgroup.h"
#include "hp/common/check.h"
#include "rank_harness.h"

namespace hp::comm {
namespace {

using hp::testing::run_ranks;

at::Tensor value_of(int world_rank, at::IntArrayRef shape) {
  return at::arange(c10::multiply_integers(shape), at::kFloat).view(shape) + 100.0 * world_rank;
}

TEST(Subgroup, CollectivesEqualTheirDefinitionOverTheMembers) {
  // World of 4; "pairs" {0,1},{2,3} and "strided" {0,2},{1,3} (hybrid's Ulysses and co groups).
  run_ranks(4, [](World& w) {
    auto world = w.group_ptr();
    GroupPtr pair, strided;
    for (auto members : std::vector<std::vector<int>>{{0, 1}, {2, 3}})
      if (auto g = make_subgroup(world, members, "pair")) pair = g;
    for (auto members : std::vector<std::vector<int>>{{0, 2}, {1, 3}})
      if (auto g = make_subgroup(world, members, "strided")) strided = g;
    ASSERT_TRUE(pair && strided);
    EXPECT_EQ(pair->size(), 2);
    EXPECT_EQ(pair->rank(), w.rank() % 2);
    EXPECT_EQ(strided->rank(), w.rank() / 2);
    const int r = w.rank();
    auto x = value_of(r, {2, 3});

    // all_gather on both at once: the pair's then the strided group's members' inputs in order.
    auto h1 = all_gather_async(*pair, x, 0);
    auto h2 = all_gather_async(*strided, x, 0);
    auto g1 = h1.wait(), g2 = h2.wait();
    const int p0 = r - r % 2, s0 = r % 2;
    EXPECT_TRUE(at::equal(g1, at::cat({value_of(p0, {2, 3}), value_of(p0 + 1, {2, 3})}, 0)));
    EXPECT_TRUE(at::equal(g2, at::cat({value_of(s0, {2, 3}), value_of(s0 + 2, {2, 3})}, 0)));

    // all_to_all: chunk j of member i lands in chunk i of member j.
    auto y = value_of(r, {2, 4});
    auto t = all_to_all(*pair, y, 1, 0);  // [4, 2]: rows from each member's column half
    const int me = pair->rank();
    auto expected = at::cat(
        {value_of(p0, {2, 4}).narrow(1, 2 * me, 2), value_of(p0 + 1, {2, 4}).narrow(1, 2 * me, 2)},
        0);
    EXPECT_TRUE(at::equal(t, expected));

    // all_reduce: the members' sum.
    auto s = all_reduce(*strided, x);
    EXPECT_TRUE(at::equal(s, value_of(s0, {2, 3}) + value_of(s0 + 2, {2, 3})));

    // send / recv between the members, by sub-group rank.
    auto peer = 1 - pair->rank();
    auto got = exchange(*pair, x, peer);
    EXPECT_TRUE(at::equal(got, value_of(p0 + peer, {2, 3})));
    barrier(*strided);

    // all_to_all_v with unequal rows.
    std::vector<int64_t> send_rows = {static_cast<int64_t>(1 + me), static_cast<int64_t>(2 - me)};
    auto rows = value_of(r, {3, 2});
    auto v = all_to_all_v(*pair, rows, send_rows, all_to_all_counts(*pair, send_rows));
    // Member m sends rows [0, 1+m) to member 0 and the rest to member 1.
    std::vector<at::Tensor> parts;
    for (int m = 0; m < 2; ++m) {
      auto theirs = value_of(p0 + m, {3, 2});
      parts.push_back(me == 0 ? theirs.narrow(0, 0, 1 + m) : theirs.narrow(0, 1 + m, 2 - m));
    }
    EXPECT_TRUE(at::equal(v, at::cat(parts, 0)));
  });
}

TEST(Subgroup, SubgroupsWithTheSameMembersNeverMatchEachOthersMessages) {
  // {0,1} made twice and {0,1,2} once; rank 0 issues A, B, C and rank 1 C, B, A (each in flight
  // before the next is issued), with different sizes: a shared tag would pair the wrong
  // messages (a size error or wrong values). Without verify_shapes: its blocking shape exchange
  // before each collective would itself need the same order on every rank.
  hp::testing::RankOptions options;
  options.verify_shapes = false;
  run_ranks(
      3,
      [](World& w) {
        auto world = w.group_ptr();
        auto a = make_subgroup(world, {0, 1}, "a");
        auto b = make_subgroup(world, {0, 1}, "b");
        auto c = make_subgroup(world, {0, 1, 2}, "c");
        const int r = w.rank();
        auto xa = value_of(r, {2}), xb = value_of(r, {3}), xc = value_of(r, {5});
        if (r == 2) {
          auto gc = all_gather(*c, xc, 0);
          EXPECT_TRUE(at::equal(gc, at::cat({value_of(0, {5}), value_of(1, {5}), xc})));
          return;
        }
        std::vector<std::pair<std::string, CommHandle>> handles;
        auto issue = [&](const std::string& which) {
          if (which == "a") handles.push_back({which, all_gather_async(*a, xa, 0)});
          if (which == "b") handles.push_back({which, all_gather_async(*b, xb, 0)});
          if (which == "c") handles.push_back({which, all_gather_async(*c, xc, 0)});
        };
        for (const auto& which : r == 0 ? std::vector<std::string>{"a", "b", "c"}
                                        : std::vector<std::string>{"c", "b", "a"})
          issue(which);
        for (auto& [which, h] : handles) {
          auto got = h.wait();
          const int64_t n = which == "a" ? 2 : which == "b" ? 3 : 5;
          std::vector<at::Tensor> want{value_of(0, {n}), value_of(1, {n})};
          if (which == "c") want.push_back(value_of(2, {n}));
          EXPECT_TRUE(at::equal(got, at::cat(want))) << which;
        }
      },
      options);
}

TEST(Subgroup, CountsWhatItHandsTheParentAndRefusesBadMembers) {
  run_ranks(3, [](World& w) {
    auto world = w.group_ptr();
    auto g = make_subgroup(world, {2, 0}, "pair");
    if (w.rank() == 1) {
      EXPECT_EQ(g, nullptr);
    } else {
      ASSERT_NE(g, nullptr);
      EXPECT_EQ(g->rank(), w.rank() == 2 ? 0 : 1);
      EXPECT_EQ(g->world_ranks(), (std::vector<int>{2, 0}));
      const int64_t before = w.context().counters.total_bytes();
      auto x = at::ones({4, 8}, at::kFloat);
      all_gather(*g, x, 0);
      EXPECT_EQ(w.context().counters.total_bytes() - before, 4 * 8 * 4);  // one peer
    }
    auto self = make_subgroup(world, {w.rank()}, "self");
    ASSERT_NE(self, nullptr);
    EXPECT_EQ(self->size(), 1);
    EXPECT_THROW(make_subgroup(world, {0, 3}, "bad"), hp::Error);
    EXPECT_THROW(make_subgroup(world, {1, 1}, "twice"), hp::Error);
  });
}

}  // namespace
}  // namespace hp::comm
