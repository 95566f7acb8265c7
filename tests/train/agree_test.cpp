// Agreement among ranks (src/train/agree.h): a step that failed on one rank fails on all with that
// rank's message, and a value every rank must share (the planned layout) is compared before any
// rank acts on it. Threads as ranks.
#include <string>

#include <gtest/gtest.h>

#include "hp/common/check.h"
#include "rank_harness.h"
#include "train/agree.h"

namespace {

using hp::testing::run_ranks;

TEST(Agree, RanksThatPlannedDifferentlyAllFailNamingTheirOwnPlan) {
  run_ranks(3, [](hp::comm::World& w) {
    const std::string mine = w.rank() == 2 ? "mesh (cp=3) cp: ring" : "mesh (cp=3) cp: ulysses";
    HP_EXPECT_ERROR(hp::train::check_same_on_every_rank(w, mine, "the planned layout", "Fix it."),
                    "the planned layout differs between ranks (rank 2's differs from rank 0's); "
                    "this rank's: " +
                        mine + ". Fix it.");
  });
  run_ranks(3, [](hp::comm::World& w) {
    hp::train::check_same_on_every_rank(w, "mesh (cp=3) cp: ring", "the planned layout", "");
  });
}

TEST(Agree, AFailureOnOneRankIsEveryRanksError) {
  run_ranks(2, [](hp::comm::World& w) {
    HP_EXPECT_ERROR(
        hp::train::run_agreed(w, [&] { HP_CHECK(w.rank() != 1, "rank 1 cannot write 'x'"); }),
        "rank 1 cannot write 'x'");
  });
}

}  // namespace
