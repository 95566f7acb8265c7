// Communication volume of one CP attention layer per rank (DESIGN section 5.2); the benches
// and hp-cp-run report counted bytes next to these.
#pragma once

#include <cstdint>
#include <vector>

#include "hp/cp/config.h"

namespace hp::cp {

struct AttentionShape {
  int64_t seq = 0;       // global sequence length S
  int64_t q_heads = 0;   // h = q_heads * qk_dim
  int64_t kv_heads = 0;  // h_kv = kv_heads * qk_dim (K), kv_heads * v_dim (V)
  int64_t qk_dim = 0;    // per-head feature size of Q and K
  int64_t batch = 1;
  int64_t element_size = 4;
  int64_t v_dim = 0;    // per-head feature size of V (and the output); 0: qk_dim
  bool causal = false;  // the ring and usp send a causal layer's chunks only where attended
  int64_t v_dim_or_qk() const { return v_dim > 0 ? v_dim : qk_dim; }
};

// Forward bytes sent per rank, by the config's strategy (CPStrategy::forward_bytes_per_rank;
// `strategies` null: the built-in registry). The built-in ones (Dv = Dqk):
//   all_gather  2 * S * h_kv * e * (P-1)/P
//   ulysses     (2h + 2h_kv) * (S/P) * e * (P-1)/P
//   hybrid      (2h + 2h_kv) * (S/P) * e * (U-1)/U  +  2 * S * h_kv * e * (C-1)/(C*U)
//   (with a value head dim of its own, the output's h and V's h_kv count Dv, not Dqk)
//   kv_head_policy=repeat with h_kv heads fewer than U: Q and the output as above, K and V by
//     an all-to-all that hands each other rank of the Ulysses group only the one head it reads,
//     2 * D * (S/P) * e * (U-1), then that head across the C groups, 2 * D * (S/C) * e * (C-1)
//   + head-tail load balance in the runtime-swap form: the query tail and the output tail
//     travel to the mirror rank, 2 * (S/2P) * h * e (nothing on the middle rank of an odd P)
//   ring        the [k | v] chunks this rank sends (ring_chunk_counts; not causal: P-1 blocks of
//               S/P positions, 2 * S * h_kv * e * (P-1)/P)
//   usp         the Ulysses all-to-alls in groups of U, and the ring across the C groups
int64_t forward_bytes_per_rank(const ContextParallelConfig& config, int64_t cp_size,
                               const AttentionShape& shape, int64_t cp_rank = 0,
                               const StrategyRegistry* strategies = nullptr);
// Backward bytes (CPStrategy::backward_bytes_per_rank): the inverse collectives move the same
// bytes again (reduce-scatter / inverse all-to-alls / the swaps), except the ring's backward
// (usp: its ring piece over the C groups): ring_backward_bytes.
int64_t backward_bytes_per_rank(const ContextParallelConfig& config, int64_t cp_size,
                                const AttentionShape& shape, int64_t cp_rank = 0,
                                const StrategyRegistry* strategies = nullptr);
// The heads of one ring (usp: after its all-to-all), as the ring's backward weighs them.
struct RingHeads {
  int64_t heads = 0, kv_heads = 0;  // query and K/V heads on the ring
  int64_t qk_dim = 0, v_dim = 0;
  int64_t element_size = 4;  // q, k, v, dout; the statistics (lse, delta) take 8 where it is 8,
                             // else 4 (float32)
};
// Whether the ring's backward passes the queries: `choice` (ContextParallelConfig::
// ring_backward) kQueries, or kAuto where that sends fewer bytes than the blocks per position
// and step (never with kept blocks, `keep_blocks`):
//   blocks    2 kv_heads (Dqk + Dv) e   the [k | v] chunk and its dK/dV accumulator
//   queries   heads ((2 Dqk + Dv) e + 2 e_stats)   [q | dout], [lse | delta] and the dQ
//             accumulator
bool ring_moves_queries(RingBackward choice, bool keep_blocks, const RingHeads& h);

// The chunk ids each member of a ring over the C = P/U groups of a CP group of P holds (ring:
// U = 1; usp: after its all-to-all): chunk c of C (each S/C positions), or with head-tail
// balance the data-order chunks of the member's U ranks (load_balance_chunks, each S/2P).
std::vector<std::vector<int64_t>> ring_member_chunks(int64_t p, int64_t u, bool balanced);

// How many chunks one ring member sends in one pass, and how many arrive to it
// (cp/strategy_ring.cpp: every chunk travels one way round, all in the direction with fewer
// hops in all, and stops after the last member that attends it; without packed documents these
// counts, with them at most these). `chunks`: ring_member_chunks; `queries`: the query bundles
// of the queries backward, else the [k | v] chunks. Not causal, every chunk reaches every other
// member; causal, a key chunk reaches only the members holding a later query chunk, a query
// chunk only those holding an earlier key chunk.
struct RingChunkCounts {
  int64_t sends = 0, arrivals = 0;
};
RingChunkCounts ring_chunk_counts(const std::vector<std::vector<int64_t>>& chunks, int64_t member,
                                  bool causal, bool queries);
// The bytes member `member` of a ring (`chunks`) sends in forward (the [k | v] chunks) and in
// backward (the chunks again and their dK/dV accumulators, the accumulators alone with kept
// blocks, or the query bundles and their dQ accumulators: ring_moves_queries), for `positions`
// per member (the batch included) and the ring's heads `h`.
int64_t ring_forward_bytes(const std::vector<std::vector<int64_t>>& chunks, int64_t member,
                           int64_t positions, const RingHeads& h, bool causal);
int64_t ring_backward_bytes(RingBackward choice, bool keep_blocks,
                            const std::vector<std::vector<int64_t>>& chunks, int64_t member,
                            int64_t positions, const RingHeads& h, bool causal);

// Forward + backward: what one training step of the layer sends per rank.
int64_t step_bytes_per_rank(const ContextParallelConfig& config, int64_t cp_size,
                            const AttentionShape& shape, int64_t cp_rank = 0,
                            const StrategyRegistry* strategies = nullptr);

}  // namespace hp::cp
