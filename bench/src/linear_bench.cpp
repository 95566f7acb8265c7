#include "hp/bench/linear_bench.h"

#include <sys/resource.h>

#include <algorithm>
#include <chrono>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>

#include "hp/attention/delta_rule.h"
#include "hp/bench/attention_bench.h"
#include "hp/comm/collectives.h"
#include "hp/comm/device_mesh.h"
#include "hp/common/check.h"
#include "hp/cp/linear_mixer.h"
#include "hp/cp/topology.h"

namespace hp::bench {
namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

int64_t value_heads_of(const LinearBenchOptions& o) {
  return o.value_heads > 0 ? o.value_heads : o.heads;
}
int64_t value_dim_of(const LinearBenchOptions& o) {
  return o.value_dim > 0 ? o.value_dim : o.head_dim;
}
attention::GateKind gate_of(const LinearBenchOptions& o) {
  return o.mixer == "kda" ? attention::GateKind::kPerChannel : attention::GateKind::kPerHead;
}

cp::LinearMixerCPOptions cp_options(const LinearBenchOptions& o) {
  cp::LinearMixerCPOptions c;
  c.mode = o.mode;
  c.state_exchange = o.state_exchange;
  c.kernel = o.kernel;
  return c;
}

// This rank's shard, float32: q, k L2-normalised, log-gates in about [-0.7, 0], beta in (0, 1).
attention::MixerInputs make_shard(const LinearBenchOptions& o, int64_t len, uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  const int64_t hv = value_heads_of(o);
  auto normed = [](const at::Tensor& t) { return t / t.norm(2, -1, true); };
  attention::MixerInputs in;
  in.q = normed(at::randn({o.batch, len, o.heads, o.head_dim}, gen));
  in.k = normed(at::randn({o.batch, len, o.heads, o.head_dim}, gen));
  in.v = at::randn({o.batch, len, hv, value_dim_of(o)}, gen);
  std::vector<int64_t> gshape{o.batch, len, hv};
  if (o.mixer == "kda") gshape.push_back(o.head_dim);
  in.g = at::log_sigmoid(at::randn(gshape, gen) + 3.0);
  in.beta = at::sigmoid(at::randn({o.batch, len, hv}, gen));
  return in;
}

}  // namespace

void check_linear_bench(const LinearBenchOptions& o, int64_t cp_size) {
  const std::string who = "hp-bench linear";
  HP_CHECK(o.mixer == "gdn" || o.mixer == "kda", who, ": --mixer '", o.mixer,
           "' is not valid; valid: gdn, kda");
  HP_CHECK(o.kernel == "chunked" || o.kernel == "recurrent", who, ": --kernel '", o.kernel,
           "' is not valid; valid: chunked, recurrent");
  HP_CHECK(o.seq >= 1 && o.heads >= 1 && o.head_dim >= 1 && o.batch >= 1 && o.value_heads >= 0 &&
               o.value_dim >= 0 && o.chunk_size >= 1,
           who, ": sizes must be >= 1");
  HP_CHECK(value_heads_of(o) % o.heads == 0, who, ": --value-heads ", value_heads_of(o),
           " must be a multiple of --heads ", o.heads);
  HP_CHECK(o.iters >= 1, who, ": --iters=", o.iters, " must be >= 1");
  HP_CHECK(o.seq % cp_size == 0, who, ": --seq ", o.seq, " is not divisible by --cp ", cp_size,
           "; use a --seq that --cp divides");
  cp::check_linear_cp_mode(who, o.mode, o.state_exchange, o.heads, value_heads_of(o), cp_size);
}

double linear_chunked_fwd_flops(const LinearBenchOptions& o) {
  const double c = static_cast<double>(o.chunk_size), k = static_cast<double>(o.head_dim);
  const double v = static_cast<double>(value_dim_of(o));
  const int64_t chunks = (o.seq + o.chunk_size - 1) / o.chunk_size;  // ceil
  const double n = static_cast<double>(chunks);
  const double per_chunk = 6 * c * c * k + 4 * c * c * v + c * c * c + 6 * c * k * v;
  return static_cast<double>(o.batch * value_heads_of(o)) * n * per_chunk;
}

double measure_chunk_matmul_gflops() {
  auto a = at::randn({512, 64, 128});
  auto b = at::randn({128, 128});
  at::matmul(a, b);  // warm-up
  std::vector<double> t;
  for (int i = 0; i < 5; ++i) {
    auto t0 = std::chrono::steady_clock::now();
    auto c = at::matmul(a, b);
    t.push_back(seconds_since(t0));
  }
  return 2.0 * 512 * 64 * 128 * 128 / median(t) / 1e9;
}

LinearBenchResult run_linear_bench(const comm::World& world, const LinearBenchOptions& o) {
  const int64_t p = world.size(), r = world.rank();
  check_linear_bench(o, p);
  comm::DeviceMesh mesh(world, {{"cp", p}});
  auto topo =
      cp::CPTopology::build(world, mesh.group_ptr({"cp"}),
                            cp::normalize(std::nullopt, p).value_or(cp::ContextParallelConfig{}));
  auto timing = world.new_group(world.group().world_ranks(), "bench_timing");
  const int64_t len = o.seq / p;
  const auto gate = gate_of(o);
  const auto cpo = cp_options(o);
  attention::MixerOptions mo;
  mo.chunk_size = o.chunk_size;
  auto shard = make_shard(o, len, 4321 + static_cast<uint64_t>(r));
  auto dout = at::randn_like(shard.v);
  auto slowest = [&](double dt) {
    return comm::all_reduce(*timing, at::full({1}, dt, at::kDouble), comm::ReduceOp::kMax)
        .item<double>();
  };

  comm::barrier(*timing);
  const double matmul = measure_chunk_matmul_gflops();  // every rank at once: the shared cores

  std::vector<double> fwd, fwd_bwd;
  for (int i = 0; i <= o.iters; ++i) {  // the first is a warm-up
    at::NoGradGuard no_grad;
    comm::barrier(*timing);
    auto t0 = std::chrono::steady_clock::now();
    auto res = cp::linear_mixer_cp(shard, mo, gate, cpo, *topo);
    const double dt = slowest(seconds_since(t0));
    if (i > 0) fwd.push_back(dt);
  }
  auto& counters = world.context().counters;
  int64_t bytes = 0;
  for (int i = 0; i <= o.iters; ++i) {
    auto in = shard;
    for (auto* t : {&in.q, &in.k, &in.v, &in.g, &in.beta})
      *t = t->detach().requires_grad_(true);
    comm::barrier(*timing);
    const int64_t before = counters.total_bytes();
    auto t0 = std::chrono::steady_clock::now();
    auto res = cp::linear_mixer_cp(in, mo, gate, cpo, *topo);
    torch::autograd::backward({res.out}, {dout});
    const double elapsed = seconds_since(t0);
    bytes = counters.total_bytes() - before;
    const double dt = slowest(elapsed);
    if (i > 0) fwd_bwd.push_back(dt);
  }

  auto mine = at::tensor(
      {static_cast<double>(process_peak_rss_bytes()), static_cast<double>(bytes), matmul},
      at::kDouble);
  auto all = comm::all_gather(*timing, mine.view({1, 3}), 0);
  LinearBenchResult res;
  res.cp = p;
  res.fwd_s = median(fwd);
  res.fwd_bwd_s = median(fwd_bwd);
  res.flops_fwd = linear_chunked_fwd_flops(o);
  res.fwd_gflops = res.flops_fwd / static_cast<double>(p) / res.fwd_s / 1e9;
  res.fwd_bwd_gflops = 3 * res.flops_fwd / static_cast<double>(p) / res.fwd_bwd_s / 1e9;
  for (int64_t i = 0; i < p; ++i) {
    res.peak_rss_per_rank.push_back(static_cast<int64_t>(all[i][0].item<double>()));
    res.comm_bytes_per_rank.push_back(static_cast<int64_t>(all[i][1].item<double>()));
    res.matmul_gflops += all[i][2].item<double>() / static_cast<double>(p);
  }
  res.peak_rss_bytes =
      *std::max_element(res.peak_rss_per_rank.begin(), res.peak_rss_per_rank.end());
  attention::MixerShape global{o.batch,           o.seq,      o.heads,
                               value_heads_of(o), o.head_dim, value_dim_of(o)};
  res.comm_bytes_theory =
      2 * cp::linear_mixer_forward_bytes_per_rank(global, gate, cpo, p,
                                                  cp::LinearMixerElementSizes::of(shard), false);
  return res;
}

}  // namespace hp::bench
