#include "hp/bench/cp_bench.h"

#include <malloc.h>
#include <sys/resource.h>
#include <time.h>

#include <algorithm>
#include <chrono>
#include <fstream>
#include <functional>
#include <memory>
#include <string>

#include <ATen/ATen.h>

#include "hp/attention/masks.h"
#include "hp/bench/attention_bench.h"
#include "hp/bench/cp_layer.h"
#include "hp/bench/link.h"
#include "hp/bench/tensor_bytes.h"
#include "hp/comm/collectives.h"
#include "hp/comm/device_mesh.h"
#include "hp/common/check.h"
#include "hp/common/host_allocator.h"
#include "hp/common/trace.h"
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

// One layer the bench times: a schedule, with or without the documents.
struct Variant {
  cp::ContextParallelConfig config;
  bool documents = false;
  std::vector<double> steps, cpu, waits, fresh;  // fresh: host cache's new pages (bytes)
  int64_t bytes = 0, wire = 0;
  int64_t peak_rss = 0;      // this process's peak after the variant's warm-up
  int64_t step_peak = -1;    // what its untimed measuring step raised the resident set (StepPeak)
  int64_t tensor_peak = -1;  // the most a timed step raised the live tensor bytes
};

// A field of /proc/self/status in bytes ("VmRSS", "VmHWM"); -1 if absent.
int64_t proc_status_bytes(const std::string& field) {
  std::ifstream in("/proc/self/status");
  std::string line;
  while (std::getline(in, line)) {
    if (line.rfind(field + ":", 0) == 0) return std::stoll(line.substr(field.size() + 1)) * 1024;
  }
  return -1;
}

// The peak resident memory one step adds: start() hands the allocator's free pages back and
// resets the kernel's high-water mark to the resident set; added() is the high-water mark
// since, minus that set. -1 where /proc/self/clear_refs cannot be written. Under the caching
// host allocator (common/host_allocator.h) the blocks it holds stay resident and a step reuses
// them without raising the resident set, so the step's large blocks are counted by the cache
// (its live high-water mark since start() minus the live bytes then) and the resident set's
// rise stands only for what the cache did not serve (its rise minus the bytes of the blocks the
// cache took from the system meanwhile).
class StepPeak {
 public:
  void start() {
    if ((cache_ = common::installed_host_cache())) {
      cache_->mark();
      const auto s = cache_->stats();
      live0_ = s.live_bytes;
      system0_ = s.system_bytes;
    }
    malloc_trim(0);
    std::ofstream reset("/proc/self/clear_refs");
    reset << "5";
    reset.close();
    ok_ = static_cast<bool>(reset);
    base_ = proc_status_bytes("VmRSS");
  }
  int64_t added() const {
    const int64_t hwm = proc_status_bytes("VmHWM");
    if (!ok_ || base_ < 0 || hwm < 0) return -1;
    const int64_t rise = std::max<int64_t>(0, hwm - base_);
    if (cache_ == nullptr) return rise;
    const auto s = cache_->stats();
    return std::max<int64_t>(0, s.marked_peak_bytes - live0_) +
           std::max<int64_t>(0, rise - (s.system_bytes - system0_));
  }

 private:
  bool ok_ = false;
  int64_t base_ = -1;
  common::HostBlockCache* cache_ = nullptr;
  int64_t live0_ = 0, system0_ = 0;
};

int64_t peak_rss_now() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<int64_t>(u.ru_maxrss) * 1024;
}

// Times the variants' steps in turn, iteration by iteration, so that the machine's drift hits
// each alike. Each layer is built and warmed up in the variants' order. With
// o.reference_step, each round ends with the reference step on every rank at once (its
// slowest rank's times in `reference`).
void time_variants(const comm::World& world, const CPBenchOptions& o,
                   std::vector<Variant>& variants, const comm::GroupPtr& cp_group,
                   comm::Group& timing, std::vector<double>& reference) {
  const int64_t p = world.size();
  const int64_t s_local = o.seq / p;
  const bool count_tensors = tensor_bytes::install();
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
  auto run_layer = [&](CPAttentionLayer& l) {
    if (o.projections) {
      l.run_block(x, dy);
    } else {
      l.run(q, k, v, dout);
    }
  };
  std::vector<std::unique_ptr<CPAttentionLayer>> layers;
  for (auto& var : variants) {
    CPLayerOptions lo;
    lo.config = var.config;
    lo.adapter = o.adapter;
    lo.causal = o.causal;
    lo.projections = o.projections;
    lo.heads = o.heads;
    lo.kv_heads = o.kv_heads;
    lo.head_dim = o.head_dim;
    if (var.documents) lo.doc_ids = equal_documents(o.seq, o.documents);
    layers.push_back(std::make_unique<CPAttentionLayer>(world, cp_group, lo));
    run_layer(*layers.back());  // warm-up
    var.peak_rss = peak_rss_now();
  }
  // A step's own resident peak, on one untimed step per variant: StepPeak hands the C heap's
  // free pages back before it (malloc_trim), so that step faults them in again, which a
  // training loop never pays (on a VM whose page faults trap to the hypervisor, about 10% of a
  // step, more for the async schedule's many small tensors). The timed steps trim nothing.
  for (size_t n = 0; n < variants.size(); ++n) {
    comm::barrier(timing);
    StepPeak peak;
    peak.start();
    run_layer(*layers[n]);
    variants[n].step_peak = peak.added();
  }
  std::function<double()> reference_step;
  if (o.reference_step) {
    reference_step = make_reference_step();
    reference_step();  // warm-up
  }
  auto slowest = [&](double dt) {
    return comm::all_reduce(timing, at::full({1}, dt, at::kDouble), comm::ReduceOp::kMax)
        .item<double>();
  };
  auto& counters = world.context().counters;
  const bool on_wire = emulated_link_rate().has_value();
  // With a tracer (hp-bench cp --trace) each timed step is one "step" event on the rank's track.
  common::Tracer* tracer = world.context().tracer.get();
  if (tracer != nullptr && !tracer->enabled()) tracer = nullptr;
  for (int i = 0; i < o.iters; ++i) {
    for (size_t n = 0; n < variants.size(); ++n) {
      auto& var = variants[n];
      if (on_wire) comm::barrier(timing);  // the bytes before are all delivered
      const int64_t wire_before = on_wire ? loopback_tx_bytes() : 0;
      tensor_bytes::reset_peak();
      const int64_t tensors_before = tensor_bytes::current();
      // The slowest rank's wall time of the step.
      comm::barrier(timing);
      const int64_t before = counters.total_bytes();
      const int64_t wait_before = counters.wait_us();
      auto* cache = common::installed_host_cache();
      const int64_t fresh0 = cache ? cache->stats().system_bytes : 0;
      const double c0 = thread_cpu_s();
      const int64_t traced0 = common::Tracer::now_us();
      auto t0 = std::chrono::steady_clock::now();
      run_layer(*layers[n]);
      if (tracer != nullptr) {
        tracer->record(
            {common::str_cat("step ", cp::to_string(var.config.algorithm), "/",
                             cp::to_string(var.config.schedule), var.documents ? " documents" : ""),
             "step", world.rank(), traced0, common::Tracer::now_us(), "", -1});
      }
      const double dt =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
      var.cpu.push_back(thread_cpu_s() - c0);
      var.fresh.push_back(cache ? static_cast<double>(cache->stats().system_bytes - fresh0) : -1);
      if (count_tensors)
        var.tensor_peak = std::max(var.tensor_peak, tensor_bytes::peak() - tensors_before);
      var.bytes = counters.total_bytes() - before;
      var.waits.push_back((counters.wait_us() - wait_before) * 1e-6);
      var.steps.push_back(slowest(dt));
      if (on_wire) {
        comm::barrier(timing);
        var.wire += loopback_tx_bytes() - wire_before;
      }
    }
    if (reference_step) {
      comm::barrier(timing);
      reference.push_back(slowest(reference_step()));
    }
  }
}

// The variant's result; collective over `timing` (per-rank figures are gathered).
CPBenchResult result_of(const Variant& var, const CPBenchOptions& o, int64_t p,
                        comm::Group& timing) {
  auto mine = at::tensor({static_cast<double>(var.peak_rss), median(var.cpu), median(var.waits),
                          static_cast<double>(var.step_peak), static_cast<double>(var.tensor_peak),
                          median(var.fresh), static_cast<double>(var.bytes)},
                         at::kDouble);
  auto all = comm::all_gather(timing, mine.view({1, 7}), 0);
  CPBenchResult r;
  r.algorithm = cp::to_string(var.config.algorithm);
  r.schedule = cp::to_string(var.config.schedule);
  r.ring_keep_blocks = var.config.ring_keep_blocks;
  r.kv_head_policy = var.config.kv_head_policy;
  r.ulysses_head_groups = var.config.ulysses_head_groups;
  r.ulysses_row_parts = var.config.ulysses_row_parts;
  r.always_local_first = var.config.async_always_local_first;
  r.ring_backward = var.config.ring_backward;
  r.cp = p;
  r.ulysses_degree = cp::ulysses_degree_of(var.config, p);
  r.seq = o.seq;
  r.load_balance = var.config.load_balance;
  r.step_time_s = median(var.steps);
  r.wire_bytes_per_rank = emulated_link_rate() ? var.wire / p / o.iters : -1;
  cp::AttentionShape shape{o.seq, o.heads, o.kv_heads, o.head_dim, o.batch, 4};
  shape.causal = o.causal;
  for (int64_t i = 0; i < p; ++i) {
    r.comm_bytes_by_rank.push_back(static_cast<int64_t>(all[i][6].item<double>()));
    r.comm_bytes_theory_by_rank.push_back(p > 1 ? cp::step_bytes_per_rank(var.config, p, shape, i)
                                                : 0);
  }
  r.comm_bytes_per_rank =
      *std::max_element(r.comm_bytes_by_rank.begin(), r.comm_bytes_by_rank.end());
  r.comm_bytes_theory =
      *std::max_element(r.comm_bytes_theory_by_rank.begin(), r.comm_bytes_theory_by_rank.end());
  for (int64_t i = 0; i < p; ++i) {
    r.peak_rss_per_rank.push_back(static_cast<int64_t>(all[i][0].item<double>()));
    r.attention_cpu_s_per_rank.push_back(all[i][1].item<double>());
    r.exposed_comm_s += all[i][2].item<double>() / static_cast<double>(p);
    r.step_peak_per_rank.push_back(static_cast<int64_t>(all[i][3].item<double>()));
    r.step_tensor_peak_per_rank.push_back(static_cast<int64_t>(all[i][4].item<double>()));
    r.fresh_host_bytes_per_step =
        std::max(r.fresh_host_bytes_per_step, static_cast<int64_t>(all[i][5].item<double>()));
  }
  const bool measured = std::all_of(r.step_peak_per_rank.begin(), r.step_peak_per_rank.end(),
                                    [](int64_t b) { return b >= 0; });
  r.step_peak_bytes =
      measured ? *std::max_element(r.step_peak_per_rank.begin(), r.step_peak_per_rank.end()) : -1;
  r.step_tensor_peak_bytes =
      *std::max_element(r.step_tensor_peak_per_rank.begin(), r.step_tensor_peak_per_rank.end());
  r.peak_rss_bytes = *std::max_element(r.peak_rss_per_rank.begin(), r.peak_rss_per_rank.end());
  return r;
}

// The median over iterations of a's step / b's step.
double paired_ratio(const Variant& a, const Variant& b) {
  std::vector<double> ratios;
  for (size_t i = 0; i < a.steps.size(); ++i)
    ratios.push_back(a.steps[i] / b.steps[i]);
  return median(ratios);
}

}  // namespace

std::optional<cp::ContextParallelConfig> paired_config(const CPBenchOptions& o,
                                                       const cp::ContextParallelConfig& config,
                                                       int64_t p) {
  if (o.paired_with.empty()) return std::nullopt;
  if (o.paired_with == "contiguous") {
    // The same layer, schedule and shape with contiguous shards: what head-tail balance buys,
    // step against step.
    HP_CHECK(config.load_balance && o.documents == 0,
             "hp-bench cp: --paired-with contiguous pairs a balanced layer with the same layer on "
             "contiguous shards (got --load-balance ",
             config.load_balance ? "on" : "off", ", --documents ", o.documents,
             "); add --load-balance and drop --documents");
    auto c = config;
    c.load_balance = false;
    auto n = cp::normalize(c, p).value_or(cp::ContextParallelConfig{});
    cp::check_sequence(n, p, o.seq);
    return n;
  }
  HP_CHECK(o.paired_with == "all_gather" || o.paired_with == "ulysses" || o.paired_with == "ring",
           "hp-bench cp: --paired-with=", o.paired_with,
           " is not supported; use all_gather, ulysses, ring or contiguous");
  HP_CHECK(config.schedule == cp::CPSchedule::kSync && o.documents == 0,
           "hp-bench cp: --paired-with pairs two sync layers without documents (got --schedule ",
           cp::to_string(config.schedule), ", --documents ", o.documents,
           "); use --schedule sync and no --documents");
  cp::ContextParallelConfig c;
  c.algorithm = cp::parse_algorithm(o.paired_with);
  c.schedule = cp::CPSchedule::kSync;
  // Too few K/V heads for a paired Ulysses layer: repeated as in this layer, or where this layer
  // moves every K/V head whole, as paired_kv_head_policy says.
  if (c.algorithm == cp::CPAlgorithm::kUlysses)
    c.kv_head_policy = o.paired_kv_head_policy.value_or(config.kv_head_policy);
  // Balanced where this layer is and the algorithm can be (as the cost model's candidates).
  c.load_balance = config.load_balance && c.algorithm != cp::CPAlgorithm::kUlysses;
  if (c.algorithm != cp::CPAlgorithm::kAllGather)
    c.load_balance_form = cp::LoadBalanceForm::kDataOrder;
  auto n = cp::normalize(c, p).value_or(cp::ContextParallelConfig{});
  cp::check_sequence(n, p, o.seq);
  cp::check_heads(n, p, o.heads, o.kv_heads);
  return n;
}

std::vector<CPBenchResult> run_cp_bench(const comm::World& world, const CPBenchOptions& o) {
  const int64_t p = world.size();
  HP_CHECK(o.iters >= 1, "hp-bench cp: --iters=", o.iters, " must be >= 1");
  auto config = cp::normalize(o.config, p).value_or(cp::ContextParallelConfig{});
  cp::check_sequence(config, p, o.seq);
  cp::check_heads(config, p, o.heads, o.kv_heads);
  const auto paired = paired_config(o, config, p);
  comm::DeviceMesh mesh(world, {{"cp", p}});
  auto timing = world.new_group(world.group().world_ranks(), "bench_timing");
  // Each schedule (sync first), each followed by the same batch without documents if any.
  std::vector<Variant> variants;
  auto variant = [](const cp::ContextParallelConfig& c, bool documents) {
    Variant v;
    v.config = c;
    v.documents = documents;
    return v;
  };
  auto add = [&](const cp::ContextParallelConfig& c) {
    variants.push_back(variant(c, o.documents > 0));
    if (o.documents > 0) variants.push_back(variant(c, false));
  };
  const bool async = config.schedule == cp::CPSchedule::kAsync;
  if (paired) variants.push_back(variant(*paired, false));
  if (async) {
    auto sync = config;  // the async-only settings do nothing there (and are recorded so)
    sync.schedule = cp::CPSchedule::kSync;
    sync.ulysses_head_groups = 0;
    sync.ulysses_row_parts = 0;
    sync.async_always_local_first = false;
    add(sync);
  }
  add(config);
  std::vector<double> reference;
  time_variants(world, o, variants, mesh.group_ptr({"cp"}), *timing, reference);
  const size_t stride = o.documents > 0 ? 2 : 1;
  std::vector<CPBenchResult> out;
  for (size_t n = 0; n < variants.size(); n += stride) {
    out.push_back(result_of(variants[n], o, p, *timing));
    if (o.documents > 0) {
      out.back().step_time_without_documents_s = median(variants[n + 1].steps);
      out.back().documents_speedup = paired_ratio(variants[n + 1], variants[n]);
    }
  }
  if (!reference.empty()) {
    for (auto& r : out)
      r.reference_step_s = median(reference);
  }
  // The paired layer's result first, then [sync,] this layer's.
  const size_t base = paired ? 1 : 0;
  if (paired) out.back().paired_speedup = paired_ratio(variants[0], variants.back());
  if (async) {
    auto &sync_r = out[base], &async_r = out[base + 1];
    if (sync_r.exposed_comm_s > 0) {
      async_r.overlap_fraction =
          std::max(0.0, 1.0 - async_r.exposed_comm_s / sync_r.exposed_comm_s);
    }
    async_r.async_speedup = paired_ratio(variants[base * stride], variants[base * stride + stride]);
  }
  return out;
}

}  // namespace hp::bench
