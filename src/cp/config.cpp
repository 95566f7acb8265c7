#include "hp/cp/config.h"

#include "hp/common/check.h"

namespace hp::cp {

const char* to_string(CPAlgorithm a) {
  switch (a) {
    case CPAlgorithm::kAllGather:
      return "all_gather";
    case CPAlgorithm::kUlysses:
      return "ulysses";
    case CPAlgorithm::kHybrid:
      return "hybrid";
  }
  return "?";
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

CPAlgorithm parse_algorithm(const std::string& s) {
  if (s == "all_gather") return CPAlgorithm::kAllGather;
  if (s == "ulysses") return CPAlgorithm::kUlysses;
  if (s == "hybrid") return CPAlgorithm::kHybrid;
  HP_CHECK(false, "cp algorithm '", s, "' is not valid; valid: all_gather, ulysses, hybrid");
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

std::optional<ContextParallelConfig> normalize(const std::optional<ContextParallelConfig>& config,
                                               int64_t cp_size) {
  HP_CHECK(cp_size >= 1, "cp_size=", cp_size, " must be >= 1");
  if (cp_size == 1) return std::nullopt;
  ContextParallelConfig c = config.value_or(ContextParallelConfig{});
  switch (c.algorithm) {
    case CPAlgorithm::kAllGather:
      HP_CHECK(!c.ulysses_degree || *c.ulysses_degree == 1,
               "cp_config.ulysses_degree=", *c.ulysses_degree,
               " with algorithm=all_gather: all_gather uses no Ulysses "
               "groups; drop ulysses_degree, or choose algorithm=hybrid (1 < degree < cp_size=",
               cp_size, ") or ulysses (degree == cp_size)");
      c.ulysses_degree = 1;
      break;
    case CPAlgorithm::kUlysses:
      if (!c.ulysses_degree) c.ulysses_degree = cp_size;
      HP_CHECK(cp_size % *c.ulysses_degree == 0, "cp_size=", cp_size,
               " is not divisible by cp_config.ulysses_degree=", *c.ulysses_degree,
               "; choose a divisor of ", cp_size);
      HP_CHECK(*c.ulysses_degree == cp_size, "cp_config.ulysses_degree=", *c.ulysses_degree,
               " with algorithm=ulysses must equal cp_size=", cp_size,
               "; use algorithm=hybrid for a smaller degree");
      break;
    case CPAlgorithm::kHybrid:
      HP_CHECK(c.ulysses_degree.has_value(), "algorithm=hybrid needs cp_config.ulysses_degree, ",
               "an integer in (1, cp_size=", cp_size, ") that divides ", cp_size);
      HP_CHECK(*c.ulysses_degree > 1 && *c.ulysses_degree < cp_size,
               "cp_config.ulysses_degree=", *c.ulysses_degree,
               " with algorithm=hybrid must lie strictly between 1 and cp_size=", cp_size,
               "; degree 1 is all_gather and degree ", cp_size, " is ulysses");
      HP_CHECK(cp_size % *c.ulysses_degree == 0, "cp_size=", cp_size,
               " is not divisible by cp_config.ulysses_degree=", *c.ulysses_degree,
               "; choose a divisor of ", cp_size);
      break;
  }
  HP_CHECK(!c.load_balance || c.algorithm == CPAlgorithm::kAllGather,
           "cp_config.load_balance=true requires algorithm=all_gather (got ",
           to_string(c.algorithm),
           "); Ulysses attends over the full sequence and needs no "
           "balancing: set load_balance=false or use all_gather");
  return c;
}

int64_t ulysses_degree_of(const ContextParallelConfig& c, int64_t cp_size) {
  switch (c.algorithm) {
    case CPAlgorithm::kAllGather:
      return 1;
    case CPAlgorithm::kUlysses:
      return cp_size;
    case CPAlgorithm::kHybrid:
      return c.ulysses_degree.value_or(1);
  }
  return 1;
}

int64_t colossal_degree_of(const ContextParallelConfig& c, int64_t cp_size) {
  return cp_size / ulysses_degree_of(c, cp_size);
}

void check_heads(const ContextParallelConfig& c, int64_t cp_size, int64_t local_q_heads,
                 int64_t local_kv_heads, int64_t tp_size) {
  const int64_t u = ulysses_degree_of(c, cp_size);
  if (u == 1) return;
  const char* after_tp = tp_size > 1 ? " (after TP)" : "";
  HP_CHECK(local_q_heads % u == 0, "algorithm=", to_string(c.algorithm), ": query heads", after_tp,
           " = ", local_q_heads, " are not divisible by the Ulysses degree ", u,
           "; use algorithm=all_gather or a smaller ulysses_degree that divides ", local_q_heads);
  HP_CHECK(local_kv_heads % u == 0, "algorithm=", to_string(c.algorithm), ": key/value heads",
           after_tp, " = ", local_kv_heads, " are not divisible by the Ulysses degree ", u,
           "; K/V heads are never repeated silently: use algorithm=all_gather or a smaller "
           "ulysses_degree that divides ",
           local_kv_heads);
}

void check_sequence(const ContextParallelConfig& c, int64_t cp_size, int64_t global_seq_len) {
  const int64_t parts = c.load_balance ? 2 * cp_size : cp_size;
  HP_CHECK(global_seq_len % parts == 0, "sequence length ", global_seq_len, " is not divisible by ",
           parts, c.load_balance ? " (2 * cp_size, load balance)" : " (cp_size)",
           "; pad the sequence to a multiple of ", parts);
}

std::string describe(const ContextParallelConfig& c, int64_t cp_size) {
  return common::str_cat("algorithm=", to_string(c.algorithm), " schedule=", to_string(c.schedule),
                         " cp_size=", cp_size, " ulysses_degree=", ulysses_degree_of(c, cp_size),
                         " colossal_degree=", colossal_degree_of(c, cp_size),
                         " load_balance=", c.load_balance ? "true" : "false");
}

}  // namespace hp::cp
