// Communication volume of one CP attention layer per rank (DESIGN section 5.2); the benches
// and hp-cp-run report measured bytes next to these.
#pragma once

#include <cstdint>

#include "hp/cp/config.h"

namespace hp::cp {

struct AttentionShape {
  int64_t seq = 0;       // global sequence length S
  int64_t q_heads = 0;   // h = q_heads * head_dim
  int64_t kv_heads = 0;  // h_kv = kv_heads * head_dim
  int64_t head_dim = 0;
  int64_t batch = 1;
  int64_t element_size = 4;
};

// Forward bytes sent per rank:
//   all_gather  2 * S * h_kv * e * (P-1)/P
//   ulysses     (2h + 2h_kv) * (S/P) * e * (P-1)/P
//   hybrid      (2h + 2h_kv) * (S/P) * e * (U-1)/U  +  2 * S * h_kv * e * (C-1)/(C*U)
//   + head-tail load balance in the runtime-swap form: the query tail and the output tail
//     travel to the mirror rank, 2 * (S/2P) * h * e (nothing on the middle rank of an odd P)
// The backward moves the same bytes again (reduce-scatter / inverse all-to-alls / the swaps),
// so forward + backward is twice this.
int64_t forward_bytes_per_rank(const ContextParallelConfig& config, int64_t cp_size,
                               const AttentionShape& shape, int64_t cp_rank = 0);

}  // namespace hp::cp
