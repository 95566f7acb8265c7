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

namespace {

int64_t blocks_bytes(const RingHeads& h, bool keep) {
  return (keep ? 1 : 2) * h.kv_heads * (h.qk_dim + h.v_dim) * h.element_size;
}
int64_t queries_bytes(const RingHeads& h) {
  const int64_t stats = h.element_size == 8 ? 8 : 4;
  return h.heads * ((2 * h.qk_dim + h.v_dim) * h.element_size + 2 * stats);
}

}  // namespace

bool ring_moves_queries(RingBackward choice, bool keep_blocks, const RingHeads& h) {
  if (keep_blocks || choice == RingBackward::kBlocks) return false;
  return choice == RingBackward::kQueries || queries_bytes(h) < blocks_bytes(h, false);
}

int64_t ring_backward_bytes_per_position(RingBackward choice, bool keep_blocks,
                                         const RingHeads& h) {
  return ring_moves_queries(choice, keep_blocks, h) ? queries_bytes(h)
                                                    : blocks_bytes(h, keep_blocks);
}

int64_t step_bytes_per_rank(const ContextParallelConfig& config, int64_t p, const AttentionShape& s,
                            int64_t cp_rank, const StrategyRegistry* strategies) {
  return forward_bytes_per_rank(config, p, s, cp_rank, strategies) +
         backward_bytes_per_rank(config, p, s, cp_rank, strategies);
}

}  // namespace hp::cp
