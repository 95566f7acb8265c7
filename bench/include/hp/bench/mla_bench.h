// hp-bench cp --attention mla|dsa: MLA's core under CP (cp/mla.h), forward + backward, one or
// more strategies on the same data in one run (default: latent_all_gather, then all_gather of
// the expanded K/V, the comparison the latent form is for). With dsa: "dsa" (cp/dsa.h: the
// indexer, top-k, sparse attention and the indexer loss, fwd + bwd) and, as its comparison,
// dense causal MLA of the same shape ("latent_all_gather"; one process: the blockwise kernel).
// Under --link-rate the bytes on the wire are counted too.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "hp/attention/mla.h"
#include "hp/comm/world.h"
#include "hp/cp/config.h"

namespace hp::bench {

struct MLABenchOptions {
  int64_t seq = 8192;  // global S
  int64_t batch = 1;
  attention::MLAShape shape;                                               // heads and the MLA dims
  std::vector<std::string> strategies{"latent_all_gather", "all_gather"};  // or "dsa"
  int64_t index_heads = 4, index_dim = 32, topk = 2048;                    // dsa
  std::string index_loss = "sparse";                                       // dsa
  cp::CPSchedule schedule = cp::CPSchedule::kSync;
  bool load_balance = false;
  int iters = 3;
};

struct MLABenchResult {
  std::string strategy, schedule;
  int64_t cp = 1;
  double step_time_s = 0;            // fwd + bwd, median over iterations of the slowest rank
  int64_t comm_bytes_per_rank = 0;   // counted, one step, rank 0
  int64_t comm_bytes_theory = 0;     // 2 x the forward formula (cp/mla.h, cp/dsa.h)
  int64_t wire_bytes_per_rank = -1;  // emulated link: loopback bytes per step / P
  int64_t peak_rss_bytes = 0;        // max over ranks
};

// Checks before any process starts (messages name the flag, the value and the fix).
void check_mla_bench(const MLABenchOptions& o, int64_t cp_size);
// Collective over the world; every rank returns the same results, one per strategy.
std::vector<MLABenchResult> run_mla_bench(const comm::World& world, const MLABenchOptions& o);

}  // namespace hp::bench
