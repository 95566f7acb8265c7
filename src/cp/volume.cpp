#include "hp/cp/volume.h"

#include "hp/cp/strategy.h"

namespace hp::cp {

int64_t forward_bytes_per_rank(const ContextParallelConfig& config, int64_t p,
                               const AttentionShape& s, int64_t cp_rank,
                               const StrategyRegistry* strategies) {
  const auto& r = strategies != nullptr ? *strategies : StrategyRegistry::builtin();
  return r.get(config.algorithm.name())->forward_bytes_per_rank(config, p, s, cp_rank);
}

int64_t backward_bytes_per_rank(const ContextParallelConfig& config, int64_t p,
                                const AttentionShape& s, int64_t cp_rank,
                                const StrategyRegistry* strategies) {
  const auto& r = strategies != nullptr ? *strategies : StrategyRegistry::builtin();
  return r.get(config.algorithm.name())->backward_bytes_per_rank(config, p, s, cp_rank);
}

int64_t step_bytes_per_rank(const ContextParallelConfig& config, int64_t p, const AttentionShape& s,
                            int64_t cp_rank, const StrategyRegistry* strategies) {
  return forward_bytes_per_rank(config, p, s, cp_rank, strategies) +
         backward_bytes_per_rank(config, p, s, cp_rank, strategies);
}

}  // namespace hp::cp
