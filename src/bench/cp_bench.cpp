#include "hp/bench/cp_bench.h"

#include <sys/resource.h>
#include <time.h>

#include <algorithm>
#include <chrono>

#include <ATen/ATen.h>

#include "hp/bench/cp_layer.h"
#include "hp/comm/collectives.h"
#include "hp/comm/device_mesh.h"
#include "hp/common/check.h"
#include "hp/cp/volume.h"

namespace hp::bench {
namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

// CPU time of the calling thread: the rank's attention compute (one intra-op thread per rank)
// without the backend's communication threads, and meaningful when ranks share cores.
double thread_cpu_s() {
  timespec ts{};
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<double>(ts.tv_sec) + ts.tv_nsec * 1e-9;
}

}  // namespace

CPBenchResult run_cp_bench(const comm::World& world, const CPBenchOptions& o) {
  const int64_t p = world.size();
  HP_CHECK(o.iters >= 1, "hp-bench cp: --iters=", o.iters, " must be >= 1");
  auto config = cp::normalize(o.config, p).value_or(cp::ContextParallelConfig{});
  cp::check_sequence(config, p, o.seq);
  cp::check_heads(config, p, o.heads, o.kv_heads);
  comm::DeviceMesh mesh(world, {{"cp", p}});
  auto timing = world.new_group(world.group().world_ranks(), "bench_timing");

  CPLayerOptions lo;
  lo.config = config;
  lo.adapter = o.adapter;
  lo.causal = o.causal;
  const int64_t s_local = o.seq / p;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1234 + world.rank());
  auto q = at::randn({o.batch, o.heads, s_local, o.head_dim}, gen, at::kFloat);
  auto k = at::randn({o.batch, o.kv_heads, s_local, o.head_dim}, gen, at::kFloat);
  auto v = at::randn({o.batch, o.kv_heads, s_local, o.head_dim}, gen, at::kFloat);
  auto dout = at::randn({o.batch, o.heads, s_local, o.head_dim}, gen, at::kFloat);

  std::vector<double> steps, cpu;
  int64_t bytes = 0;
  {
    // Constructed only when the ranks agree on the sizes: the layer builds groups.
    CPAttentionLayer layer(world, mesh.group_ptr({"cp"}), lo);
    layer.run(q, k, v, dout);  // warm-up
    auto& counters = world.context().counters;
    for (int i = 0; i < o.iters; ++i) {
      comm::barrier(*timing);
      const int64_t before = counters.total_bytes();
      const double c0 = thread_cpu_s();
      auto t0 = std::chrono::steady_clock::now();
      layer.run(q, k, v, dout);
      const double dt =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      cpu.push_back(thread_cpu_s() - c0);
      bytes = counters.total_bytes() - before;
      auto slowest =
          comm::all_reduce(*timing, at::full({1}, dt, at::kDouble), comm::ReduceOp::kMax);
      steps.push_back(slowest.item<double>());
    }
  }
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  auto mine = at::tensor({static_cast<double>(u.ru_maxrss) * 1024.0, median(cpu)}, at::kDouble);
  auto all = comm::all_gather(*timing, mine.view({1, 2}), 0);

  CPBenchResult r;
  r.algorithm = cp::to_string(config.algorithm);
  r.schedule = cp::to_string(config.schedule);
  r.cp = p;
  r.ulysses_degree = cp::ulysses_degree_of(config, p);
  r.seq = o.seq;
  r.step_time_s = median(steps);
  r.comm_bytes_per_rank = bytes;
  cp::AttentionShape shape{o.seq, o.heads, o.kv_heads, o.head_dim, o.batch, 4};
  r.comm_bytes_theory = p > 1 ? 2 * cp::forward_bytes_per_rank(config, p, shape) : 0;
  for (int64_t i = 0; i < p; ++i) {
    r.peak_rss_per_rank.push_back(static_cast<int64_t>(all[i][0].item<double>()));
    r.attention_cpu_s_per_rank.push_back(all[i][1].item<double>());
  }
  r.peak_rss_bytes = *std::max_element(r.peak_rss_per_rank.begin(), r.peak_rss_per_rank.end());
  return r;
}

}  // namespace hp::bench
