// `hp-bench linear`: one linear-attention mixer (GDN, KDA) forward and forward + backward, alone
// or under CP (cp/linear_mixer.h) over the world's ranks, against a plain matmul rate measured
// in the same run.
//
// FLOPs are counted analytically for the chunked algorithm (attention/delta_rule.h), per batch
// row, value head and chunk of C tokens (N = ceil(T / C) chunks), K key and V value dims:
//   (K e^G)(K e^-G)^T and (Q e^G)(K e^-G)^T        2 * 2 C^2 K
//   the triangular solve for T (C right-hand sides) C^3
//   U = T (beta V), W = T (beta K e^G)              2 C^2 V + 2 C^2 K
//   the state through the chunk: W h, K_end^T v     2 * 2 C K V
//   out = (Q e^G) h + tril(QK) v                    2 C K V + 2 C^2 V
// = B * HV * N * (6 C^2 K + 4 C^2 V + C^3 + 6 C K V) for the forward, whatever kernel runs (so
// rates compare); forward + backward is counted as 3x the forward. Work a CP mode adds (the
// state summaries of state_passing) is not counted: it shows as a lower rate.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "hp/comm/world.h"

namespace hp::bench {

struct LinearBenchOptions {
  std::string mixer = "gdn";  // gdn | kda
  int64_t seq = 4096;         // global T
  int64_t heads = 8;          // q/k heads H
  int64_t value_heads = 0;    // HV; 0: H
  int64_t head_dim = 128;     // K
  int64_t value_dim = 0;      // V; 0: K
  int64_t batch = 1;
  int64_t chunk_size = 64;
  std::string mode = "state_passing";         // CP with more than one rank: ulysses | ...
  std::string state_exchange = "all_gather";  // all_gather | p2p
  std::string kernel = "chunked";             // chunked | recurrent
  int iters = 3;                              // timed iterations (median), after a warm-up
};

struct LinearBenchResult {
  int64_t cp = 1;
  double fwd_s = 0, fwd_bwd_s = 0;  // medians of the slowest rank
  double flops_fwd = 0;             // the chunked algorithm on the whole sequence
  // Per rank: (flops_fwd / P) / fwd_s and (3 flops_fwd / P) / fwd_bwd_s.
  double fwd_gflops = 0, fwd_bwd_gflops = 0;
  double matmul_gflops = 0;  // [64,128]x[128,128] batched matmul, every rank at once (mean)
  std::vector<int64_t> comm_bytes_per_rank;  // counted, one forward + backward
  int64_t comm_bytes_theory = 0;             // 2 x linear_mixer_forward_bytes_per_rank
  std::vector<int64_t> peak_rss_per_rank;
  int64_t peak_rss_bytes = 0;  // max over ranks
};

// Checks the options (names, sizes, divisibility) for `cp_size` ranks; rank-independent.
void check_linear_bench(const LinearBenchOptions& o, int64_t cp_size);

// The forward FLOPs of the header's formula.
double linear_chunked_fwd_flops(const LinearBenchOptions& o);

// GFLOP/s of a [512 x [64,128]] x [128,128] batched fp32 matmul (median of 5): the size of the
// chunk matmuls.
double measure_chunk_matmul_gflops();

// Collective over the world (the CP ranks); every rank returns the same result.
LinearBenchResult run_linear_bench(const comm::World& world, const LinearBenchOptions& o);

}  // namespace hp::bench
