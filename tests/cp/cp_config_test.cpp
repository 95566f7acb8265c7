// Config parsing, normalisation and every static fail-fast case, asserting the message text.
#include <gtest/gtest.h>

#include "hp/common/check.h"
#include "hp/cp/config.h"
#include "rank_harness.h"

namespace hp::cp {
namespace {

ContextParallelConfig cfg(CPAlgorithm a, std::optional<int64_t> u = std::nullopt) {
  ContextParallelConfig c;
  c.algorithm = a;
  c.ulysses_degree = u;
  return c;
}

TEST(CPConfig, ParsesStringFormsAndListsValidValues) {
  EXPECT_EQ(parse_algorithm("hybrid"), CPAlgorithm::kHybrid);
  EXPECT_EQ(parse_schedule("async"), CPSchedule::kAsync);
  EXPECT_EQ(parse_async_fallback("sync"), AsyncFallback::kSync);
  EXPECT_EQ(parse_algorithm("ring"), CPAlgorithm("ring"));
  HP_EXPECT_ERROR(
      parse_algorithm("tree"),
      "cp algorithm 'tree' is not valid; valid: all_gather, ulysses, hybrid, ring, usp");
  HP_EXPECT_ERROR(parse_schedule("later"), "cp schedule 'later' is not valid; valid: sync, async");
  HP_EXPECT_ERROR(parse_async_fallback("warn"), "valid: error, sync");
}

TEST(CPConfig, Normalisation) {
  EXPECT_FALSE(normalize(cfg(CPAlgorithm::kHybrid, 3), 1).has_value()) << "cp_size 1 ignores CP";
  auto d = normalize(std::nullopt, 8);
  EXPECT_EQ(d->algorithm, CPAlgorithm::kAllGather);
  EXPECT_EQ(d->schedule, CPSchedule::kSync);
  EXPECT_EQ(*normalize(cfg(CPAlgorithm::kUlysses), 4)->ulysses_degree, 4);
  EXPECT_EQ(ulysses_degree_of(*normalize(cfg(CPAlgorithm::kHybrid, 2), 8), 8), 2);
  EXPECT_EQ(colossal_degree_of(*normalize(cfg(CPAlgorithm::kHybrid, 2), 8), 8), 4);
}

TEST(CPConfig, OneRankStillRefusesWhatNoCpSizeAllows) {
  // cp_size 1 runs no CP, but a setting that P > 1 refuses whatever P is is refused here too:
  // code tried on one rank first must not fail only once it runs on more.
  auto balanced_ulysses = cfg(CPAlgorithm::kUlysses);
  balanced_ulysses.load_balance = true;
  HP_EXPECT_ERROR(normalize(balanced_ulysses, 1), "cp_config.load_balance=true requires");
  auto repeat = cfg(CPAlgorithm::kAllGather);
  repeat.kv_head_policy = KVHeadPolicy::kRepeat;
  HP_EXPECT_ERROR(normalize(repeat, 1), "cp_config.kv_head_policy=repeat applies to");
  auto groups = cfg(CPAlgorithm::kUlysses);
  groups.ulysses_head_groups = 2;  // sync
  HP_EXPECT_ERROR(normalize(groups, 1), "with schedule=async");
  auto kept = cfg(CPAlgorithm::kHybrid, 2);
  kept.ring_keep_blocks = true;
  HP_EXPECT_ERROR(normalize(kept, 1), "ring_keep_blocks=true applies to algorithm=ring or usp");
  // What only a cp_size can judge waits for one: hybrid's degree, ulysses' head count.
  EXPECT_FALSE(normalize(cfg(CPAlgorithm::kHybrid, 7), 1).has_value());
  auto balanced_ring = cfg(CPAlgorithm::kRing);
  balanced_ring.load_balance = true;
  EXPECT_FALSE(normalize(balanced_ring, 1).has_value());
}

TEST(CPConfig, LegacyDegreeConvertsOnce) {
  EXPECT_EQ(from_legacy_degree(1, 8).algorithm, CPAlgorithm::kAllGather);
  EXPECT_EQ(from_legacy_degree(8, 8).algorithm, CPAlgorithm::kUlysses);
  auto h = from_legacy_degree(2, 8);
  EXPECT_EQ(h.algorithm, CPAlgorithm::kHybrid);
  EXPECT_EQ(*h.ulysses_degree, 2);
  HP_EXPECT_ERROR(from_legacy_degree(3, 8), "legacy ulysses_degree=3 does not divide cp_size=8");
}

TEST(CPConfig, FailFast) {
  HP_EXPECT_ERROR(
      normalize(cfg(CPAlgorithm::kHybrid, 3), 8),
      "cp_size=8 is not divisible by cp_config.ulysses_degree=3; choose a divisor of 8");
  HP_EXPECT_ERROR(normalize(cfg(CPAlgorithm::kUlysses, 2), 8),
                  "cp_config.ulysses_degree=2 with algorithm=ulysses must equal cp_size=8; use "
                  "algorithm=hybrid for a smaller degree");
  HP_EXPECT_ERROR(
      normalize(cfg(CPAlgorithm::kHybrid, 8), 8),
      "cp_config.ulysses_degree=8 with algorithm=hybrid must lie strictly between 1 and "
      "cp_size=8");
  HP_EXPECT_ERROR(normalize(cfg(CPAlgorithm::kHybrid, 1), 8), "must lie strictly between 1 and");
  HP_EXPECT_ERROR(normalize(cfg(CPAlgorithm::kHybrid), 8),
                  "algorithm=hybrid needs cp_config.ulysses_degree");
  HP_EXPECT_ERROR(normalize(cfg(CPAlgorithm::kAllGather, 2), 8),
                  "cp_config.ulysses_degree=2 with algorithm=all_gather");
  auto lb = cfg(CPAlgorithm::kUlysses);
  lb.load_balance = true;
  HP_EXPECT_ERROR(normalize(lb, 4),
                  "cp_config.load_balance=true requires algorithm=all_gather or hybrid or ring "
                  "or usp (got ulysses)");
  lb.algorithm = CPAlgorithm::kHybrid;
  lb.ulysses_degree = 2;
  EXPECT_TRUE(normalize(lb, 4)->load_balance);
  lb.load_balance_form = LoadBalanceForm::kRuntimeSwap;
  HP_EXPECT_ERROR(normalize(lb, 4),
                  "cp_config.load_balance_form=runtime_swap with algorithm=hybrid: hybrid "
                  "balances data-order shards");
}

TEST(CPConfig, HeadsAfterTP) {
  auto u4 = *normalize(cfg(CPAlgorithm::kUlysses), 4);
  EXPECT_NO_THROW(check_heads(u4, 4, 8, 4));
  HP_EXPECT_ERROR(check_heads(u4, 4, 8, 2),
                  "algorithm=ulysses: key/value heads = 2 are not divisible by the Ulysses degree "
                  "4; K/V heads are never repeated silently: set kv_head_policy=repeat "
                  "(--kv-head-policy repeat) to send each K/V head once and repeat it after the "
                  "exchange, or use algorithm=all_gather or a ulysses_degree that divides 2");
  // 16 query heads over TP=4 leave 4 local: fine for U=4; 8 over TP=4 leave 2: refused.
  EXPECT_NO_THROW(check_heads(u4, 4, 16 / 4, 16 / 4, 4));
  HP_EXPECT_ERROR(check_heads(u4, 4, 8 / 4, 8 / 4, 4),
                  "query heads (after TP) = 2 are not divisible by the Ulysses degree 4");
  EXPECT_NO_THROW(check_heads(*normalize(std::nullopt, 4), 4, 3, 1)) << "all_gather: no constraint";
  // The repeat policy where no strategy piece could repeat: refused, not ignored.
  for (auto algo : {CPAlgorithm::kAllGather, CPAlgorithm::kRing}) {
    auto c = cfg(algo);
    c.kv_head_policy = KVHeadPolicy::kRepeat;
    HP_EXPECT_ERROR(normalize(c, 4),
                    std::string("cp_config.kv_head_policy=repeat applies to algorithm=ulysses, "
                                "hybrid or usp (got ") +
                        algo + ", which moves every K/V head whole");
  }
}

TEST(CPConfig, SequenceDivisibility) {
  EXPECT_NO_THROW(check_sequence(*normalize(std::nullopt, 4), 4, 4096));
  HP_EXPECT_ERROR(check_sequence(*normalize(std::nullopt, 4), 4, 4098),
                  "sequence length 4098 is not divisible by 4 (cp_size); pad the sequence to a "
                  "multiple of 4");
  auto lb = *normalize(std::nullopt, 4);
  lb.load_balance = true;
  HP_EXPECT_ERROR(check_sequence(lb, 4, 4100), "not divisible by 8 (2 * cp_size, load balance)");
}

// What a run without CP refuses: every setting apart from the defaults, as the tools' flags.
TEST(CPConfig, SettingsGivenNameEveryNonDefaultField) {
  EXPECT_TRUE(settings_given(ContextParallelConfig{}).empty());
  ContextParallelConfig c;
  c.algorithm = "ring";
  c.schedule = CPSchedule::kAsync;
  c.ulysses_degree = 2;
  c.load_balance = true;
  c.async_fallback = AsyncFallback::kSync;
  c.kv_head_policy = KVHeadPolicy::kRepeat;
  c.ulysses_head_groups = 3;
  c.async_always_local_first = true;
  c.ring_keep_blocks = true;
  c.ring_backward = RingBackward::kQueries;
  c.ulysses_row_parts = 2;
  EXPECT_EQ(settings_given(c),
            (std::vector<std::string>{"--cp-algo ring", "--schedule async", "--ulysses-degree 2",
                                      "--load-balance", "--async-fallback sync",
                                      "--kv-head-policy repeat", "--ulysses-head-groups 3",
                                      "--always-local-first", "--ring-keep-blocks",
                                      "--ring-backward queries", "--ulysses-row-parts 2"}));
  EXPECT_NO_THROW(check_nothing_given_without_cp("tool", {}, "x"));
  HP_EXPECT_ERROR(
      check_nothing_given_without_cp("tool", {"--load-balance"}, "the plain layer runs"),
      "tool: --load-balance configures context parallelism, but --cp is 1 (the plain "
      "layer runs); drop it or set --cp > 1");
}

}  // namespace
}  // namespace hp::cp
