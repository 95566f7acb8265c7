#include "hp/bench/mla_bench.h"

#include <sys/resource.h>

#include <algorithm>
#include <chrono>

#include <ATen/ATen.h>

#include "hp/bench/link.h"
#include "hp/comm/collectives.h"
#include "hp/comm/device_mesh.h"
#include "hp/common/check.h"
#include "hp/cp/dsa.h"
#include "hp/cp/mla.h"
#include "hp/cp/topology.h"

namespace hp::bench {
namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

void check_mla_bench(const MLABenchOptions& o, int64_t cp_size) {
  const std::string who = "hp-bench cp --attention mla";
  HP_CHECK(o.seq >= 1 && o.batch >= 1 && o.iters >= 1, who,
           ": --seq, --batch and --iters must be >= 1");
  const int64_t multiple = o.load_balance ? 2 * cp_size : cp_size;
  HP_CHECK(o.seq % multiple == 0, who, ": --seq ", o.seq, " is not divisible by ", multiple,
           o.load_balance ? " (2 * --cp, load balance)" : " (--cp)", "; choose a --seq it divides");
  for (const auto& s : o.strategies) {
    if (s == "dsa") {
      attention::DSAOptions d;
      d.topk = o.topk;
      d.loss = o.index_loss;
      d.check(who);
      HP_CHECK(o.index_heads >= 1 && o.index_dim >= 1, who,
               ": --index-heads and --index-dim must be >= 1");
      continue;
    }
    cp::MLACPOptions c;
    c.strategy = s;
    c.load_balance = o.load_balance;
    cp::check_mla_cp(who, c, o.shape, o.seq / cp_size, cp_size);
  }
}

std::vector<MLABenchResult> run_mla_bench(const comm::World& world, const MLABenchOptions& o) {
  const int64_t p = world.size(), r = world.rank(), s = o.seq / p;
  check_mla_bench(o, p);
  const auto& shape = o.shape;
  comm::DeviceMesh mesh(world, {{"cp", p}});
  auto topo =
      cp::CPTopology::build(world, mesh.group_ptr({"cp"}),
                            cp::normalize(std::nullopt, p).value_or(cp::ContextParallelConfig{}));
  auto timing = world.new_group(world.group().world_ranks(), "bench_timing");
  auto gen = at::make_generator<at::CPUGeneratorImpl>(977 + static_cast<uint64_t>(r));
  auto q = at::randn({o.batch, s, shape.heads, shape.qk_dim()}, gen);
  auto latent = at::randn({o.batch, s, shape.kv_rank}, gen);
  auto k_rope = at::randn({o.batch, s, shape.d_rope}, gen);
  auto w_ukv = at::randn({shape.heads * (shape.d_nope + shape.d_v), shape.kv_rank}, gen) /
               std::sqrt(static_cast<double>(shape.kv_rank));
  auto dout = at::randn({o.batch, s, shape.heads, shape.d_v}, gen);
  auto q_index = at::randn({o.batch, s, o.index_heads, o.index_dim}, gen);
  auto w_index = at::rand({o.batch, s, o.index_heads}, gen);
  auto k_index = at::randn({o.batch, s, o.index_dim}, gen);
  auto& counters = world.context().counters;
  const bool on_wire = emulated_link_rate().has_value();
  std::vector<MLABenchResult> results;
  for (const auto& strategy : o.strategies) {
    cp::MLACPOptions co;
    co.strategy = strategy;
    co.schedule = o.schedule;
    co.load_balance = o.load_balance;
    const bool dsa = strategy == "dsa";
    attention::DSAOptions dsa_options;
    dsa_options.topk = o.topk;
    dsa_options.loss = o.index_loss;
    cp::DSACPOptions dsa_cp;
    dsa_cp.load_balance = o.load_balance;
    dsa_cp.schedule = o.schedule;
    auto step = [&] {
      auto ql = q.detach().requires_grad_(true), ll = latent.detach().requires_grad_(true);
      auto rl = k_rope.detach().requires_grad_(true), wl = w_ukv.detach().requires_grad_(true);
      if (dsa) {
        attention::DSAIndexer index{q_index.detach().requires_grad_(true),
                                    w_index.detach().requires_grad_(true),
                                    k_index.detach().requires_grad_(true)};
        auto res = cp::dsa_attention_cp(ql, ll, rl, wl, shape, index, dsa_options, dsa_cp, *topo);
        ((res.out * dout).sum() + res.loss).backward();
        return;
      }
      auto out = cp::mla_attention_cp([&] { return ql; }, ll, rl, wl, shape, co, *topo);
      out.backward(dout);
    };
    step();  // warm-up
    if (on_wire) comm::barrier(*timing);
    const int64_t wire_before = on_wire ? loopback_tx_bytes() : 0;
    std::vector<double> steps;
    int64_t bytes = 0;
    for (int i = 0; i < o.iters; ++i) {
      comm::barrier(*timing);
      const int64_t before = counters.total_bytes();
      auto t0 = std::chrono::steady_clock::now();
      step();
      const double dt =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      bytes = counters.total_bytes() - before;
      steps.push_back(
          comm::all_reduce(*timing, at::full({1}, dt, at::kDouble), comm::ReduceOp::kMax)
              .item<double>());
    }
    MLABenchResult res;
    if (on_wire) {
      comm::barrier(*timing);
      res.wire_bytes_per_rank = (loopback_tx_bytes() - wire_before) / p / o.iters;
    }
    res.strategy = strategy;
    res.schedule = cp::to_string(o.schedule);
    res.cp = p;
    res.step_time_s = median(steps);
    res.comm_bytes_per_rank = bytes;
    res.comm_bytes_theory =
        p == 1 ? 0
        : dsa  ? 2 * cp::dsa_forward_bytes_per_rank(shape, o.index_dim, o.batch, o.seq, p, 4)
               : 2 * cp::mla_forward_bytes_per_rank(strategy, shape, o.batch, o.seq, p, 4);
    results.push_back(res);
  }
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  auto rss = comm::all_reduce(*timing,
                              at::full({1}, static_cast<double>(u.ru_maxrss) * 1024.0, at::kDouble),
                              comm::ReduceOp::kMax)
                 .item<double>();
  for (auto& res : results)
    res.peak_rss_bytes = static_cast<int64_t>(rss);
  return results;
}

}  // namespace hp::bench
