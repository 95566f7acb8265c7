// `hp-bench comm`: per-collective volume and throughput on a World.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "hp/comm/world.h"

namespace hp::bench {

struct CommBenchOptions {
  int64_t bytes = 16 << 20;  // input bytes per rank (float32 elements)
  int iters = 10;
  int warmup = 2;
};

struct CommBenchResult {
  std::string op;
  int64_t bytes_in = 0;               // input bytes per rank
  int64_t bytes_sent_per_rank = 0;    // counted by the comm layer, per call
  int64_t theory_bytes_per_rank = 0;  // theory_bytes_per_rank()
  double median_s = 0;                // median over iterations of the slowest rank's time
  double gbps = 0;                    // bytes_sent_per_rank / median_s / 1e9
  // Inside an emulated link (--link-rate): loopback bytes that crossed the wire per call and
  // rank (the namespace's counter over the timed calls / P / iters; rank 0); -1 elsewhere.
  int64_t wire_bytes_per_rank = -1;
};

// Collective over the world; every rank gets the same results.
std::vector<CommBenchResult> run_comm_bench(const comm::World& world,
                                            const CommBenchOptions& options);

}  // namespace hp::bench
