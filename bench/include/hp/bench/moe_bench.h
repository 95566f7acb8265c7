// `hp-bench moe`: one MoE MLP layer (moe/moe.h) forward + backward on every rank's own tokens,
// with its experts split over the ranks (expert parallelism, EP = the world size) and, in the
// same run, with every expert local to every rank (no communication). The exposed
// dispatch/combine time is what the ranks spent blocked in the EP all-to-alls (the comm layer's
// wait time; dispatch and combine are synchronous, so it is their whole duration). The step
// difference to the all-local layer also holds the experts' matmul sizes: with EP each expert
// runs the rows of every rank at once, bigger matmuls than all-local's.
//
// Bytes: counted (what the all-to-alls handed the transport in one forward + backward) against
// the formula from this step's routing: per rank, the rows it routes to other ranks' experts
// (dispatch) and the rows other ranks route to its experts (combine), each sent once forward
// and once backward, times H x 4 bytes, plus the counts exchange (E / P int64 to each other
// rank) in forward. Uniform routing would give T k (P-1) / P rows each way.
#pragma once

#include <cstdint>
#include <vector>

#include "hp/comm/world.h"

namespace hp::bench {

struct MoEBenchOptions {
  int64_t tokens = 4096;  // per rank
  int64_t hidden = 512;
  int64_t expert_ffn = 256;
  int64_t experts = 16;
  int64_t top_k = 2;
  int iters = 3;
};

struct MoEBenchResult {
  int64_t ep = 1;
  double ep_s = 0, local_s = 0;  // fwd+bwd medians of the slowest rank
  double exposed_s = 0;          // blocked in the EP all-to-alls per fwd+bwd (slowest rank)
  double vs_local_s = 0;         // ep_s - local_s
  double ep_tokens_per_s = 0, local_tokens_per_s = 0;  // every rank's tokens together
  std::vector<int64_t> a2a_bytes_per_rank;             // counted, one fwd+bwd
  std::vector<int64_t> formula_bytes_per_rank;         // from the routing
  int64_t uniform_bytes_per_rank = 0;                  // uniform routing's expectation
  int64_t peak_rss_bytes = 0;                          // max over ranks
};

// Sizes positive, top_k <= experts, experts divisible by the rank count.
void check_moe_bench(const MoEBenchOptions& o, int64_t ranks);

// Collective over the world; every rank returns the same result.
MoEBenchResult run_moe_bench(const comm::World& world, const MoEBenchOptions& o);

}  // namespace hp::bench
