// `hp-bench hsdp`: a decoder stack's forward + backward under HSDP, the pipelined gradient path
// against a baseline that waits every collective right after issuing it (and gathers without
// prefetch), measured in the same run on the same model and data.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "hp/comm/world.h"

namespace hp::bench {

struct HsdpBenchOptions {
  int64_t dp_shard = 1, dp_replicate = 1;
  bool comm_fusion = false;
  int64_t layers = 4, hidden = 512, ffn = 1408, heads = 8, kv_heads = 4, head_dim = 64;
  int64_t vocab = 1024, seq = 512, batch = 1;
  int iters = 3;
};

struct HsdpBenchResult {
  std::string mode;                      // "pipelined" or "baseline"
  double backward_s = 0, forward_s = 0;  // medians, slowest rank
  double exposed_comm_s = 0;             // backward: blocked in HSDP waits (median, max rank)
  double drain_s = 0;                    // inside the root drain (median, max rank)
  int64_t bytes_all_gather = 0, bytes_reduce_scatter = 0, bytes_all_reduce = 0;  // rank 0
  int64_t formula_all_gather = 0, formula_reduce_scatter = 0, formula_all_reduce = 0;
  int64_t wire_bytes_per_rank = -1;  // emulated link: loopback bytes per step / P (rank 0)
  int64_t param_bytes_per_rank = 0;  // shards (padding included)
  int64_t full_param_bytes = 0;      // the unsharded model (this rank's TP view)
};

// Collective over the world (R * Sd ranks); every rank returns the same two results.
std::vector<HsdpBenchResult> run_hsdp_bench(const comm::World& world,
                                            const HsdpBenchOptions& options);

}  // namespace hp::bench
