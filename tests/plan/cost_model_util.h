// The cost-model tests' synthetic calibrations, workloads and configs.
#pragma once

#include <cstdint>

#include "hp/cp/config.h"
#include "hp/plan/cost_model.h"

namespace hp::plan::testing {

// Every collective at `seconds_per_byte` after 0.1 ms, attention and matmul at 100 GFLOP/s.
inline Calibration synthetic(double seconds_per_byte, int cores = 64) {
  Calibration c;
  c.link = "test";
  c.cores = cores;
  c.attention_gflops = 100;
  c.matmul_gflops = 100;
  for (const char* kind : {"all_gather", "reduce_scatter", "all_to_all", "all_reduce"}) {
    for (int p : {2, 4})
      c.collectives[kind][p] = {1e-4, seconds_per_byte};
  }
  return c;
}

// S = 16384, D = 64, causal, with projections.
inline CPWorkload workload(int64_t heads = 8, int64_t kv_heads = 8) {
  CPWorkload w;
  w.seq = 16384;
  w.heads = heads;
  w.kv_heads = kv_heads;
  w.head_dim = 64;
  return w;
}

// Sync, contiguous unless `lb`; `u` > 0 sets the Ulysses degree.
inline cp::ContextParallelConfig config(const char* algo, bool lb = false, int64_t u = 0) {
  cp::ContextParallelConfig c;
  c.algorithm = cp::parse_algorithm(algo);
  if (u > 0) c.ulysses_degree = u;
  c.load_balance = lb;
  return c;
}

}  // namespace hp::plan::testing
