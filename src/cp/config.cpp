#include "hp/cp/config.h"

#include <algorithm>

#include "hp/common/check.h"
#include "hp/common/strings.h"
#include "hp/cp/strategy.h"

namespace hp::cp {

const std::string& to_string(const CPAlgorithm& a) {
  return a.name();
}

const char* to_string(CPSchedule s) {
  return s == CPSchedule::kSync ? "sync" : "async";
}
const char* to_string(AsyncFallback f) {
  return f == AsyncFallback::kError ? "error" : "sync";
}

const char* to_string(LoadBalanceForm f) {
  return f == LoadBalanceForm::kDataOrder ? "data_order" : "runtime_swap";
}

const char* to_string(KVHeadPolicy p) {
  return p == KVHeadPolicy::kError ? "error" : "repeat";
}

KVHeadPolicy parse_kv_head_policy(const std::string& s) {
  if (s == "error") return KVHeadPolicy::kError;
  if (s == "repeat") return KVHeadPolicy::kRepeat;
  HP_CHECK(false, "kv_head_policy '", s, "' is not valid; valid: error, repeat");
}

const char* to_string(RingBackward b) {
  return b == RingBackward::kAuto ? "auto" : b == RingBackward::kBlocks ? "blocks" : "queries";
}

RingBackward parse_ring_backward(const std::string& s) {
  for (auto b : {RingBackward::kAuto, RingBackward::kBlocks, RingBackward::kQueries}) {
    if (s == to_string(b)) return b;
  }
  HP_CHECK(false, "ring_backward '", s, "' is not valid; valid: auto, blocks, queries");
}

bool repeats_kv(KVHeadPolicy policy, int64_t u, int64_t kv_heads) {
  return policy == KVHeadPolicy::kRepeat && u > 1 && kv_heads % u != 0;
}

namespace {

const StrategyRegistry& registry_or_builtin(const StrategyRegistry* r) {
  return r != nullptr ? *r : StrategyRegistry::builtin();
}

}  // namespace

CPAlgorithm parse_algorithm(const std::string& s, const StrategyRegistry* strategies) {
  const auto& r = registry_or_builtin(strategies);
  HP_CHECK(r.contains(s), "cp algorithm '", s, "' is not valid; valid: ", r.names_list());
  return CPAlgorithm(s);
}

CPSchedule parse_schedule(const std::string& s) {
  if (s == "sync") return CPSchedule::kSync;
  if (s == "async") return CPSchedule::kAsync;
  HP_CHECK(false, "cp schedule '", s, "' is not valid; valid: sync, async");
}

AsyncFallback parse_async_fallback(const std::string& s) {
  if (s == "error") return AsyncFallback::kError;
  if (s == "sync") return AsyncFallback::kSync;
  HP_CHECK(false, "cp async_fallback '", s, "' is not valid; valid: error, sync");
}

ContextParallelConfig parse_flags(const CPFlags& f) {
  ContextParallelConfig c;
  c.algorithm = parse_algorithm(f.algo);
  c.schedule = parse_schedule(f.schedule);
  HP_CHECK(f.degree >= 0, "cp --ulysses-degree ", f.degree,
           " must be a positive degree (hybrid and usp need one), or 0 / absent (ulysses: the "
           "whole CP group)");
  if (f.degree > 0) c.ulysses_degree = f.degree;
  c.load_balance = f.load_balance;
  c.kv_head_policy = parse_kv_head_policy(f.kv_head_policy);
  c.ulysses_head_groups = f.head_groups;
  c.ulysses_row_parts = f.row_parts;
  c.ring_keep_blocks = f.ring_keep_blocks;
  c.ring_backward = parse_ring_backward(f.ring_backward);
  return c;
}

std::vector<std::string> settings_given(const ContextParallelConfig& c) {
  const ContextParallelConfig d;
  std::vector<std::string> given;
  auto valued = [&](const char* flag, const auto& value) {
    given.push_back(common::str_cat(flag, " ", value));
  };
  if (c.algorithm != d.algorithm) valued("--cp-algo", to_string(c.algorithm));
  if (c.schedule != d.schedule) valued("--schedule", to_string(c.schedule));
  if (c.ulysses_degree) valued("--ulysses-degree", *c.ulysses_degree);
  if (c.load_balance) given.push_back("--load-balance");
  if (c.async_fallback != d.async_fallback) valued("--async-fallback", to_string(c.async_fallback));
  if (c.kv_head_policy != d.kv_head_policy) valued("--kv-head-policy", to_string(c.kv_head_policy));
  if (c.ulysses_head_groups != d.ulysses_head_groups)
    valued("--ulysses-head-groups", c.ulysses_head_groups);
  if (c.async_always_local_first) given.push_back("--always-local-first");
  if (c.ring_keep_blocks) given.push_back("--ring-keep-blocks");
  if (c.ring_backward != d.ring_backward) valued("--ring-backward", to_string(c.ring_backward));
  if (c.ulysses_row_parts != d.ulysses_row_parts)
    valued("--ulysses-row-parts", c.ulysses_row_parts);
  return given;
}

void check_nothing_given_without_cp(const std::string& tool, const std::vector<std::string>& given,
                                    const std::string& what_runs) {
  HP_CHECK(given.empty(), tool, ": ", common::str_join(given), " configure",
           given.size() == 1 ? "s" : "", " context parallelism, but --cp is 1 (", what_runs,
           "); drop ", given.size() == 1 ? "it" : "them", " or set --cp > 1");
}

ContextParallelConfig from_legacy_degree(int64_t degree, int64_t cp_size) {
  HP_CHECK(degree >= 1 && cp_size >= 1 && cp_size % degree == 0, "legacy ulysses_degree=", degree,
           " does not divide cp_size=", cp_size, "; choose a divisor of ", cp_size);
  ContextParallelConfig c;
  if (degree == 1) {
    c.algorithm = CPAlgorithm::kAllGather;
  } else if (degree == cp_size) {
    c.algorithm = CPAlgorithm::kUlysses;
    c.ulysses_degree = degree;
  } else {
    c.algorithm = CPAlgorithm::kHybrid;
    c.ulysses_degree = degree;
  }
  return c;
}

namespace {

// The checks that need only the config: they hold at every cp_size, so a one-rank run refuses
// what the same code would be refused at P > 1.
void check_settings(const ContextParallelConfig& c, const StrategyRegistry& registry) {
  HP_CHECK(registry.contains(c.algorithm.name()), "cp_config.algorithm='", c.algorithm.name(),
           "' is not a CP strategy; valid: ", registry.names_list());
  const auto strategy = registry.get(c.algorithm.name());
  HP_CHECK(c.ulysses_head_groups >= 0, "cp_config.ulysses_head_groups=", c.ulysses_head_groups,
           " must be >= 0 (0: automatic, 1: no head groups)");
  HP_CHECK(c.ulysses_head_groups == 0 || ((c.algorithm.name() == CPAlgorithm::kUlysses ||
                                           c.algorithm.name() == CPAlgorithm::kHybrid ||
                                           c.algorithm.name() == CPAlgorithm::kUsp ||
                                           c.algorithm.name() == CPAlgorithm::kAllGather) &&
                                          c.schedule == CPSchedule::kAsync),
           "cp_config.ulysses_head_groups=", c.ulysses_head_groups,
           " applies to algorithm=ulysses, hybrid, usp or all_gather with schedule=async (got ",
           c.algorithm.name(), ", ", to_string(c.schedule),
           "); drop it or use the async ulysses, hybrid, usp or all_gather schedule");
  HP_CHECK(c.ulysses_row_parts >= 0, "cp_config.ulysses_row_parts=", c.ulysses_row_parts,
           " must be >= 0 (0: automatic, 1: the last head group's output in one all-to-all)");
  HP_CHECK(c.ulysses_row_parts == 0 ||
               (c.algorithm.name() == CPAlgorithm::kUlysses && c.schedule == CPSchedule::kAsync),
           "cp_config.ulysses_row_parts=", c.ulysses_row_parts,
           " applies to algorithm=ulysses with schedule=async (got ", c.algorithm.name(), ", ",
           to_string(c.schedule), "); drop it or use the async ulysses schedule");
  HP_CHECK(
      c.kv_head_policy != KVHeadPolicy::kRepeat || (c.algorithm.name() != CPAlgorithm::kAllGather &&
                                                    c.algorithm.name() != CPAlgorithm::kRing),
      "cp_config.kv_head_policy=repeat applies to algorithm=ulysses, hybrid or usp (got ",
      c.algorithm.name(),
      ", which moves every K/V head whole: nothing is repeated); drop it "
      "or use a Ulysses strategy");
  const bool ring_like =
      c.algorithm.name() == CPAlgorithm::kRing || c.algorithm.name() == CPAlgorithm::kUsp;
  HP_CHECK(!c.ring_keep_blocks || ring_like,
           "cp_config.ring_keep_blocks=true applies to algorithm=ring or usp (got ",
           c.algorithm.name(), "); drop it or use ring or usp");
  HP_CHECK(c.ring_backward == RingBackward::kAuto || ring_like,
           "cp_config.ring_backward=", to_string(c.ring_backward),
           " applies to algorithm=ring or usp (got ", c.algorithm.name(),
           "); drop it or use ring or usp");
  HP_CHECK(!(c.ring_keep_blocks && c.ring_backward == RingBackward::kQueries),
           "cp_config.ring_backward=queries with ring_keep_blocks=true: kept blocks send only the "
           "dK/dV accumulators, so the queries have nothing to save; drop one of the two");
  if (c.load_balance && !strategy->supports_load_balance()) {
    std::string balanced;
    for (const auto& n : registry.names()) {
      if (registry.get(n)->supports_load_balance()) {
        balanced += common::str_cat(balanced.empty() ? "" : " or ", n);
      }
    }
    HP_CHECK(false, "cp_config.load_balance=true requires algorithm=", balanced, " (got ",
             c.algorithm.name(), "); ", strategy->name(),
             " needs no head-tail balancing: set load_balance=false or use ", balanced);
  }
}

}  // namespace

std::optional<ContextParallelConfig> normalize(const std::optional<ContextParallelConfig>& config,
                                               int64_t cp_size,
                                               const StrategyRegistry* strategies) {
  HP_CHECK(cp_size >= 1, "cp_size=", cp_size, " must be >= 1");
  const auto& registry = registry_or_builtin(strategies);
  if (cp_size == 1) {
    if (config) check_settings(*config, registry);
    return std::nullopt;
  }
  ContextParallelConfig c = config.value_or(ContextParallelConfig{});
  check_settings(c, registry);
  const auto strategy = registry.get(c.algorithm.name());
  strategy->normalize(c, cp_size);
  HP_INTERNAL_ASSERT(c.ulysses_degree.has_value() && cp_size % *c.ulysses_degree == 0, "strategy '",
                     strategy->name(), "' left an invalid ulysses_degree");
  return c;
}

int64_t ulysses_head_groups_of(const ContextParallelConfig& c, int64_t nq, int64_t nkv,
                               int64_t cp_size, int64_t local_seq) {
  if (c.ulysses_head_groups > 0) return c.ulysses_head_groups;
  // usp: a ring per group, so at most 2 (measured at P = 4, U = 2 on the 1 Gbit/s link, with
  // Q/K/V in pieces of head groups: 2 groups hid 0.70 of the link time at S = 16384 against
  // 0.66 with 4 and 0.57 with one). With fewer than kUspMinRowsForHeadGroups tokens per rank
  // there is too little attention to hide the second ring's pieces behind, and the group
  // holding its pieces back until the first ring's shift has landed costs more than it hides:
  // at S = 4096, P = 4 the async step took 0.91-0.95 s with 2 groups against 0.81 s with one
  // (and sync 0.82-0.83 s); docs/benchmarks.md.
  if (c.algorithm.name() == CPAlgorithm::kUsp) {
    if (local_seq > 0 && local_seq < kUspMinRowsForHeadGroups) return 1;
    return nq % 2 == 0 && nkv % 2 == 0 ? 2 : 1;
  }
  // all_gather: up to 8 groups, 4 at P = 2 (one call per group and chunk costs little; measured
  // at S = 16384 on the 1 Gbit/s link, P = 4: 8 groups exposed 0.95 s, 4 groups 1.05-1.12 s,
  // one 2.11 s; at P = 2 the held chunks are half the attention, and 8 groups exposed
  // 0.04-0.18 s where 4 and one exposed none; docs/benchmarks.md).
  if (c.algorithm.name() == CPAlgorithm::kAllGather) {
    const int64_t most = cp_size > 0 ? std::min<int64_t>(8, 2 * cp_size) : 8;
    for (int64_t g = std::min(most, nkv); g > 1; --g) {
      if (nq % g == 0 && nkv % g == 0) return g;
    }
    return 1;
  }
  for (int64_t g : {4, 3, 2}) {
    if (nq % g == 0 && nkv % g == 0) return g;
  }
  return 1;
}

int64_t ulysses_row_parts_of(const ContextParallelConfig& c, int64_t local_seq) {
  if (c.ulysses_row_parts > 0)
    return std::min(c.ulysses_row_parts, std::max<int64_t>(local_seq, 1));
  return local_seq >= 2 * kUlyssesMinRowsPerPart ? 2 : 1;
}

int64_t ulysses_degree_of(const ContextParallelConfig& c, int64_t cp_size) {
  if (c.ulysses_degree) return *c.ulysses_degree;
  return *normalize(c, std::max<int64_t>(cp_size, 2))->ulysses_degree;
}

int64_t colossal_degree_of(const ContextParallelConfig& c, int64_t cp_size) {
  return cp_size / ulysses_degree_of(c, cp_size);
}

void check_heads(const ContextParallelConfig& c, int64_t cp_size, int64_t local_q_heads,
                 int64_t local_kv_heads, int64_t tp_size) {
  const int64_t u = ulysses_degree_of(c, cp_size);
  check_heads_for_degree(c.algorithm.name(), u, local_q_heads, local_kv_heads, tp_size,
                         c.kv_head_policy);
  const int64_t g = c.ulysses_head_groups;
  if (g > 0 && repeats_kv(c.kv_head_policy, u, local_kv_heads)) {
    // Each rank reads one repeated K/V head, shared by all its query groups.
    HP_CHECK(g == 1 || c.algorithm.name() != CPAlgorithm::kUsp, "cp_config.ulysses_head_groups=", g,
             " with kv_head_policy=repeat (", local_kv_heads, " key/value heads, Ulysses degree ",
             u,
             "): usp runs one head group on the repeat path (a ring per group); drop "
             "ulysses_head_groups or use algorithm=ulysses or hybrid");
    HP_CHECK((local_q_heads / u) % g == 0, "cp_config.ulysses_head_groups=", g,
             " does not divide the ", local_q_heads / u,
             " query heads each rank attends after the all-to-all (its one repeated key/value "
             "head is shared by every group); choose a divisor, or 0 (automatic)");
    return;
  }
  HP_CHECK(g == 0 || ((local_q_heads / u) % g == 0 && (local_kv_heads / u) % g == 0),
           "cp_config.ulysses_head_groups=", g, " does not divide the ", local_q_heads / u,
           " query and ", local_kv_heads / u,
           " key/value heads each rank attends after the "
           "all-to-all; choose a common divisor, or 0 (automatic)");
}

void check_heads_for_degree(const std::string& algorithm, int64_t u, int64_t local_q_heads,
                            int64_t local_kv_heads, int64_t tp_size, KVHeadPolicy policy) {
  if (u == 1) return;
  const char* after_tp = tp_size > 1 ? " (after TP)" : "";
  HP_CHECK(local_q_heads % u == 0, "algorithm=", algorithm, ": query heads", after_tp, " = ",
           local_q_heads, " are not divisible by the Ulysses degree ", u,
           "; use algorithm=all_gather or a smaller ulysses_degree that divides ", local_q_heads);
  if (local_kv_heads % u == 0) return;
  if (policy == KVHeadPolicy::kRepeat) {
    HP_CHECK(u % local_kv_heads == 0, "algorithm=", algorithm, ": kv_head_policy=repeat needs the ",
             "Ulysses degree ", u, " to be a multiple of the key/value heads", after_tp, " = ",
             local_kv_heads, "; use a Ulysses degree that divides or is a multiple of ",
             local_kv_heads);
    return;
  }
  HP_CHECK(false, "algorithm=", algorithm, ": key/value heads", after_tp, " = ", local_kv_heads,
           " are not divisible by the Ulysses degree ", u,
           "; K/V heads are never repeated silently: set kv_head_policy=repeat "
           "(--kv-head-policy repeat) to send each K/V head once and repeat it after the "
           "exchange, or use algorithm=all_gather or a ulysses_degree that divides ",
           local_kv_heads);
}

void check_sequence(const ContextParallelConfig& c, int64_t cp_size, int64_t global_seq_len) {
  const int64_t parts = c.load_balance ? 2 * cp_size : cp_size;
  HP_CHECK(global_seq_len % parts == 0, "sequence length ", global_seq_len, " is not divisible by ",
           parts, c.load_balance ? " (2 * cp_size, load balance)" : " (cp_size)",
           "; pad the sequence to a multiple of ", parts);
}

std::string describe(const ContextParallelConfig& c, int64_t cp_size) {
  return common::str_cat(
      "algorithm=", to_string(c.algorithm), " schedule=", to_string(c.schedule),
      " cp_size=", cp_size, " ulysses_degree=", ulysses_degree_of(c, cp_size),
      " colossal_degree=", colossal_degree_of(c, cp_size),
      " load_balance=", c.load_balance ? "true" : "false",
      c.kv_head_policy == KVHeadPolicy::kRepeat ? " kv_head_policy=repeat" : "",
      c.ring_keep_blocks ? " ring_keep_blocks=true" : "",
      c.ring_backward != RingBackward::kAuto
          ? common::str_cat(" ring_backward=", to_string(c.ring_backward))
          : "",
      c.ulysses_row_parts > 0 ? common::str_cat(" ulysses_row_parts=", c.ulysses_row_parts) : "");
}

}  // namespace hp::cp
