#include "hp/bench/cp_bench.h"

#include <sys/resource.h>
#include <time.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <memory>

#include <ATen/ATen.h>

#include "hp/attention/masks.h"
#include "hp/bench/cp_layer.h"
#include "hp/bench/link.h"
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

// `n` documents of (nearly) equal length over `seq` positions: ids [1, seq].
at::Tensor equal_documents(int64_t seq, int64_t n) {
  std::vector<int64_t> cu;
  for (int64_t d = 0; d <= n; ++d)
    cu.push_back(d * seq / n);
  return attention::document_ids_from_cu_seqlens(cu, seq);
}

}  // namespace

double visible_tile_fraction(int64_t seq, bool causal, int64_t documents, int64_t tile) {
  attention::Documents docs;
  if (documents > 0) docs.ids = equal_documents(seq, documents);
  int64_t visible = 0, total = 0;
  for (int64_t qs = 0; qs < seq; qs += tile) {
    const int64_t qe = std::min(seq, qs + tile);
    for (int64_t ks = 0; ks < seq; ks += tile) {
      const int64_t ke = std::min(seq, ks + tile);
      ++total;
      if (causal && ks > qe - 1) continue;
      if (documents > 0 && attention::documents_hide_block(docs, qs, qe, ks, ke)) continue;
      ++visible;
    }
  }
  return static_cast<double>(visible) / static_cast<double>(total);
}

namespace {

CPBenchResult bench_one(const comm::World& world, const CPBenchOptions& o,
                        const cp::ContextParallelConfig& config, const comm::GroupPtr& cp_group,
                        comm::Group& timing) {
  const int64_t p = world.size();
  CPLayerOptions lo;
  lo.config = config;
  lo.adapter = o.adapter;
  lo.causal = o.causal;
  lo.projections = o.projections;
  lo.heads = o.heads;
  lo.kv_heads = o.kv_heads;
  lo.head_dim = o.head_dim;
  if (o.documents > 0) lo.doc_ids = equal_documents(o.seq, o.documents);
  const int64_t s_local = o.seq / p;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1234 + world.rank());
  at::Tensor q, k, v, dout, x, dy;
  if (o.projections) {
    x = at::randn({o.batch, s_local, o.heads * o.head_dim}, gen, at::kFloat);
    dy = at::randn({o.batch, s_local, o.heads * o.head_dim}, gen, at::kFloat);
  } else {
    q = at::randn({o.batch, o.heads, s_local, o.head_dim}, gen, at::kFloat);
    k = at::randn({o.batch, o.kv_heads, s_local, o.head_dim}, gen, at::kFloat);
    v = at::randn({o.batch, o.kv_heads, s_local, o.head_dim}, gen, at::kFloat);
    dout = at::randn({o.batch, o.heads, s_local, o.head_dim}, gen, at::kFloat);
  }
  std::vector<double> steps, cpu, waits, plain_steps, speedups;
  int64_t bytes = 0, wire = -1;
  {
    CPAttentionLayer layer(world, cp_group, lo);
    auto run_layer = [&](CPAttentionLayer& l) {
      if (o.projections) {
        l.run_block(x, dy);
      } else {
        l.run(q, k, v, dout);
      }
    };
    auto step = [&] { run_layer(layer); };
    // The same batch without documents, for the paired speed-up.
    std::unique_ptr<CPAttentionLayer> plain;
    if (o.documents > 0) {
      auto plain_options = lo;
      plain_options.doc_ids = at::Tensor();
      plain = std::make_unique<CPAttentionLayer>(world, cp_group, plain_options);
      run_layer(*plain);  // warm-up
    }
    // The slowest rank's wall time of one synchronised call of `fn`.
    auto slowest_time = [&](const std::function<void()>& fn) {
      comm::barrier(timing);
      auto t0 = std::chrono::steady_clock::now();
      fn();
      const double dt =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      auto slowest = comm::all_reduce(timing, at::full({1}, dt, at::kDouble), comm::ReduceOp::kMax);
      return slowest.item<double>();
    };
    step();  // warm-up
    auto& counters = world.context().counters;
    const bool on_wire = emulated_link_rate().has_value();
    if (on_wire) comm::barrier(timing);  // the warm-up's bytes are all delivered
    const int64_t wire_before = on_wire ? loopback_tx_bytes() : 0;
    int64_t paired_wire = 0;
    for (int i = 0; i < o.iters; ++i) {
      steps.push_back(slowest_time([&] {
        const int64_t before = counters.total_bytes();
        const int64_t wait_before = counters.wait_us();
        const double c0 = thread_cpu_s();
        step();
        cpu.push_back(thread_cpu_s() - c0);
        bytes = counters.total_bytes() - before;
        waits.push_back((counters.wait_us() - wait_before) * 1e-6);
      }));
      if (plain) {
        if (on_wire) comm::barrier(timing);
        const int64_t wire_pause = on_wire ? loopback_tx_bytes() : 0;
        plain_steps.push_back(slowest_time([&] { run_layer(*plain); }));
        speedups.push_back(plain_steps.back() / steps.back());
        if (on_wire) {  // the paired step's bytes are not this layer's
          comm::barrier(timing);
          paired_wire += loopback_tx_bytes() - wire_pause;
        }
      }
    }
    if (on_wire) {
      comm::barrier(timing);
      wire = (loopback_tx_bytes() - wire_before - paired_wire) / p / o.iters;
    }
  }
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  auto mine = at::tensor({static_cast<double>(u.ru_maxrss) * 1024.0, median(cpu), median(waits)},
                         at::kDouble);
  auto all = comm::all_gather(timing, mine.view({1, 3}), 0);

  CPBenchResult r;
  r.algorithm = cp::to_string(config.algorithm);
  r.schedule = cp::to_string(config.schedule);
  r.cp = p;
  r.ulysses_degree = cp::ulysses_degree_of(config, p);
  r.seq = o.seq;
  r.step_time_s = median(steps);
  if (!plain_steps.empty()) {
    r.step_time_without_documents_s = median(plain_steps);
    r.documents_speedup = median(speedups);
  }
  r.wire_bytes_per_rank = wire;
  r.comm_bytes_per_rank = bytes;
  cp::AttentionShape shape{o.seq, o.heads, o.kv_heads, o.head_dim, o.batch, 4};
  r.comm_bytes_theory = p > 1 ? cp::step_bytes_per_rank(config, p, shape) : 0;
  for (int64_t i = 0; i < p; ++i) {
    r.peak_rss_per_rank.push_back(static_cast<int64_t>(all[i][0].item<double>()));
    r.attention_cpu_s_per_rank.push_back(all[i][1].item<double>());
    r.exposed_comm_s += all[i][2].item<double>() / static_cast<double>(p);
  }
  r.peak_rss_bytes = *std::max_element(r.peak_rss_per_rank.begin(), r.peak_rss_per_rank.end());
  return r;
}

}  // namespace

std::vector<CPBenchResult> run_cp_bench(const comm::World& world, const CPBenchOptions& o) {
  const int64_t p = world.size();
  HP_CHECK(o.iters >= 1, "hp-bench cp: --iters=", o.iters, " must be >= 1");
  auto config = cp::normalize(o.config, p).value_or(cp::ContextParallelConfig{});
  cp::check_sequence(config, p, o.seq);
  cp::check_heads(config, p, o.heads, o.kv_heads);
  comm::DeviceMesh mesh(world, {{"cp", p}});
  auto timing = world.new_group(world.group().world_ranks(), "bench_timing");
  std::vector<CPBenchResult> out;
  if (config.schedule == cp::CPSchedule::kAsync) {
    auto sync = config;
    sync.schedule = cp::CPSchedule::kSync;
    out.push_back(bench_one(world, o, sync, mesh.group_ptr({"cp"}), *timing));
  }
  out.push_back(bench_one(world, o, config, mesh.group_ptr({"cp"}), *timing));
  if (out.size() == 2 && out[0].exposed_comm_s > 0) {
    out[1].overlap_fraction = std::max(0.0, 1.0 - out[1].exposed_comm_s / out[0].exposed_comm_s);
  }
  return out;
}

}  // namespace hp::bench
