#include "hp/cp/volume.h"

namespace hp::cp {

int64_t forward_bytes_per_rank(const ContextParallelConfig& config, int64_t p,
                               const AttentionShape& s, int64_t cp_rank) {
  const int64_t e = s.element_size * s.batch;
  const int64_t h = s.q_heads * s.head_dim, hkv = s.kv_heads * s.head_dim;
  const int64_t u = ulysses_degree_of(config, p), c = p / u;
  // Per-rank chunk sizes first, then the fraction that leaves the rank: exact in integers.
  const int64_t a2a = u > 1 ? (2 * h + 2 * hkv) * (s.seq / p) * e / u * (u - 1) : 0;
  // After the A2A each rank holds S/C positions of h_kv/U: (S/P) * h_kv elements per tensor.
  const int64_t gather = c > 1 ? 2 * (s.seq / p) * hkv * e * (c - 1) : 0;
  const bool swaps = config.load_balance &&
                     config.load_balance_form == LoadBalanceForm::kRuntimeSwap &&
                     p - 1 - cp_rank != cp_rank;
  const int64_t swap = swaps ? 2 * (s.seq / (2 * p)) * h * e : 0;
  return a2a + gather + swap;
}

}  // namespace hp::cp
