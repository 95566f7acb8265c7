#include "hp/cp/volume.h"

#include "hp/cp/sequence.h"
#include "hp/cp/strategy.h"
#include "ring_routes.h"

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

int64_t kv_bytes_per_position(const RingHeads& h) {
  return h.kv_heads * (h.qk_dim + h.v_dim) * h.element_size;
}
int64_t queries_bytes(const RingHeads& h) {
  const int64_t stats = h.element_size == 8 ? 8 : 4;
  return h.heads * ((2 * h.qk_dim + h.v_dim) * h.element_size + 2 * stats);
}

}  // namespace

bool ring_moves_queries(RingBackward choice, bool keep_blocks, const RingHeads& h) {
  if (keep_blocks || choice == RingBackward::kBlocks) return false;
  return choice == RingBackward::kQueries || queries_bytes(h) < 2 * kv_bytes_per_position(h);
}

std::vector<std::vector<int64_t>> ring_member_chunks(int64_t p, int64_t u, bool balanced) {
  std::vector<std::vector<int64_t>> out;
  for (int64_t c = 0; c < p / u; ++c) {
    std::vector<int64_t> ids;
    for (int64_t j = 0; balanced && j < u; ++j) {
      for (int64_t id : load_balance_chunks(c * u + j, p))
        ids.push_back(id);
    }
    out.push_back(balanced ? ids : std::vector<int64_t>{c});
  }
  return out;
}

RingChunkCounts ring_chunk_counts(const std::vector<std::vector<int64_t>>& chunks, int64_t member,
                                  bool causal, bool queries) {
  const auto n = static_cast<int64_t>(chunks.size());
  std::vector<size_t> held;
  for (const auto& ids : chunks)
    held.push_back(ids.size());
  // Whether member d attends chunk c of member o, by the chunks' ids (not the ring's pairs).
  auto needs = [&](int64_t d, int64_t o, size_t c) {
    const int64_t x = chunks[static_cast<size_t>(o)][c];
    for (int64_t y : chunks[static_cast<size_t>(d)]) {
      if (!causal || (queries ? y <= x : x <= y)) return true;
    }
    return false;
  };
  // Ties: keys forward, queries back (as the ring's plan_routes is asked).
  const auto routes = detail::ring::route_chunks(held, needs, queries ? -1 : 1);
  RingChunkCounts out;
  for (int64_t o = 0; o < n; ++o) {
    for (int64_t last : routes.hops[static_cast<size_t>(o)]) {
      for (int64_t i = 0; i < last; ++i) {  // held at step i by member o + dir i, sent on
        const int64_t holder = ((o + routes.dir * i) % n + n) % n;
        if (holder == member) ++out.sends;
        if ((holder + routes.dir + n) % n == member) ++out.arrivals;
      }
    }
  }
  return out;
}

namespace {

int64_t chunk_positions(const std::vector<std::vector<int64_t>>& chunks, int64_t positions) {
  return positions / static_cast<int64_t>(chunks.front().size());
}

}  // namespace

int64_t ring_forward_bytes(const std::vector<std::vector<int64_t>>& chunks, int64_t member,
                           int64_t positions, const RingHeads& h, bool causal) {
  return ring_chunk_counts(chunks, member, causal, false).sends *
         chunk_positions(chunks, positions) * kv_bytes_per_position(h);
}

int64_t ring_backward_bytes(RingBackward choice, bool keep_blocks,
                            const std::vector<std::vector<int64_t>>& chunks, int64_t member,
                            int64_t positions, const RingHeads& h, bool causal) {
  const int64_t chunk = chunk_positions(chunks, positions);
  if (ring_moves_queries(choice, keep_blocks, h)) {
    const auto n = ring_chunk_counts(chunks, member, causal, true);
    const int64_t dq = h.heads * h.qk_dim * h.element_size;  // the dQ accumulator
    return chunk * (n.sends * (queries_bytes(h) - dq) + n.arrivals * dq);
  }
  const auto n = ring_chunk_counts(chunks, member, causal, false);
  return chunk * kv_bytes_per_position(h) * ((keep_blocks ? 0 : n.sends) + n.arrivals);
}

int64_t step_bytes_per_rank(const ContextParallelConfig& config, int64_t p, const AttentionShape& s,
                            int64_t cp_rank, const StrategyRegistry* strategies) {
  return forward_bytes_per_rank(config, p, s, cp_rank, strategies) +
         backward_bytes_per_rank(config, p, s, cp_rank, strategies);
}

}  // namespace hp::cp
