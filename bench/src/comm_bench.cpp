#include "hp/bench/comm_bench.h"

#include <algorithm>
#include <chrono>
#include <functional>

#include <ATen/ATen.h>

#include "hp/bench/link.h"
#include "hp/comm/collectives.h"
#include "hp/common/check.h"

namespace hp::bench {

std::vector<CommBenchResult> run_comm_bench(const comm::World& world, const CommBenchOptions& o) {
  using comm::OpKind;
  auto& g = world.group();
  // Barriers and timing reductions go through their own group so they never mix into the
  // measured collectives' counters.
  auto timing = world.new_group(g.world_ranks(), "bench_timing");
  const int64_t p = g.size();
  // Element count: a multiple of P (for the split collectives), at least P.
  int64_t n = std::max<int64_t>(p, o.bytes / 4 / p * p);
  HP_CHECK(o.iters >= 1, "hp-bench comm: --iters=", o.iters, " must be >= 1");
  auto x = at::randn({n});

  struct Case {
    OpKind op;
    std::function<void()> run;
  };
  std::vector<Case> cases = {
      {OpKind::kAllGather, [&] { comm::all_gather(g, x, 0); }},
      {OpKind::kReduceScatter, [&] { comm::reduce_scatter(g, x, 0); }},
      {OpKind::kAllToAll, [&] { comm::all_to_all(g, x, 0, 0); }},
      {OpKind::kAllReduce, [&] { comm::all_reduce(g, x); }},
  };
  std::vector<CommBenchResult> results;
  for (auto& c : cases) {
    for (int i = 0; i < o.warmup; ++i)
      c.run();
    auto& counters = world.context().counters;
    const int64_t before = counters.bytes(c.op, g.name());
    const bool wire = emulated_link_rate().has_value();
    // Barriers around the counter readings: a collective's bytes are all delivered (and
    // counted) once every rank has finished it.
    if (wire) comm::barrier(*timing);
    const int64_t wire_before = wire ? loopback_tx_bytes() : 0;
    std::vector<double> times;
    for (int i = 0; i < o.iters; ++i) {
      comm::barrier(*timing);
      auto t0 = std::chrono::steady_clock::now();
      c.run();
      double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      // The slowest rank's time is the collective's time.
      auto slowest =
          comm::all_reduce(*timing, at::full({1}, dt, at::kDouble), comm::ReduceOp::kMax);
      times.push_back(slowest.item<double>());
    }
    std::sort(times.begin(), times.end());
    CommBenchResult r;
    if (wire) {
      comm::barrier(*timing);
      r.wire_bytes_per_rank = (loopback_tx_bytes() - wire_before) / p / o.iters;
    }
    r.op = comm::op_name(c.op);
    r.bytes_in = n * 4;
    r.bytes_sent_per_rank = (counters.bytes(c.op, g.name()) - before) / o.iters;
    r.theory_bytes_per_rank = comm::theory_bytes_per_rank(c.op, r.bytes_in, static_cast<int>(p));
    r.median_s = times[times.size() / 2];
    r.gbps = r.median_s > 0 ? static_cast<double>(r.bytes_sent_per_rank) / r.median_s / 1e9 : 0;
    results.push_back(r);
  }
  return results;
}

}  // namespace hp::bench
