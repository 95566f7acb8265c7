#include "hp/bench/moe_bench.h"

#include <algorithm>
#include <chrono>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>

#include "hp/bench/attention_bench.h"
#include "hp/comm/collectives.h"
#include "hp/common/check.h"
#include "hp/moe/moe.h"

namespace hp::bench {
namespace {

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

moe::MoEConfig layer_config(const MoEBenchOptions& o) {
  moe::MoEConfig c;
  c.hidden = o.hidden;
  c.expert_ffn = o.expert_ffn;
  c.router.experts = o.experts;
  c.router.top_k = o.top_k;
  return c;
}

// Medians of the slowest rank's fwd+bwd over `iters` timed runs (after a warm-up).
double time_layer(moe::MoEImpl& layer, const at::Tensor& x, const at::Tensor& dy, int iters,
                  comm::Group& timing) {
  std::vector<double> times;
  for (int i = 0; i <= iters; ++i) {
    auto in = x.detach().requires_grad_(true);
    comm::barrier(timing);
    const auto t0 = std::chrono::steady_clock::now();
    auto y = layer.forward(in);
    torch::autograd::backward({y, layer.loss()}, {dy, at::ones_like(layer.loss())});
    const double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    const double slowest =
        comm::all_reduce(timing, at::full({1}, dt, at::kDouble), comm::ReduceOp::kMax)
            .item<double>();
    if (i > 0) times.push_back(slowest);
  }
  return median(times);
}

}  // namespace

void check_moe_bench(const MoEBenchOptions& o, int64_t ranks) {
  HP_CHECK(o.tokens > 0 && o.hidden > 0 && o.expert_ffn > 0, "hp-bench moe: --tokens ", o.tokens,
           ", --hidden ", o.hidden, " and --expert-ffn ", o.expert_ffn, " must be positive");
  HP_CHECK(o.top_k >= 1 && o.top_k <= o.experts, "hp-bench moe: --top-k ", o.top_k,
           " must be between 1 and --experts ", o.experts);
  HP_CHECK(o.experts % ranks == 0, "hp-bench moe: --experts ", o.experts,
           " is not divisible by --ep ", ranks, "; choose an ep dividing the number of experts");
  HP_CHECK(o.iters >= 1, "hp-bench moe: --iters must be >= 1");
}

MoEBenchResult run_moe_bench(const comm::World& world, const MoEBenchOptions& o) {
  const int64_t p = world.size();
  check_moe_bench(o, p);
  auto timing = world.new_group(world.group().world_ranks(), "bench_timing");
  auto ep = world.new_group(world.group().world_ranks(), "ep");
  auto gen = at::make_generator<at::CPUGeneratorImpl>(777 + static_cast<uint64_t>(world.rank()));
  auto x = at::randn({o.tokens, o.hidden}, gen);
  auto dy = at::randn({o.tokens, o.hidden}, gen);

  MoEBenchResult res;
  res.ep = p;
  moe::MoE local(layer_config(o), 0);
  local->set_stats_group(ep);
  res.local_s = time_layer(*local, x, dy, o.iters, *timing);

  moe::MoE sharded(layer_config(o), 0);
  sharded->set_expert_parallel(ep, ep);
  auto& counters = world.context().counters;
  const auto key = std::make_pair(comm::OpKind::kAllToAll, std::string("ep"));
  const auto before = counters.snapshot()[key];
  res.ep_s = time_layer(*sharded, x, dy, o.iters, *timing);
  const auto after = counters.snapshot()[key];
  const int64_t bytes = (after.bytes_sent - before.bytes_sent) / (o.iters + 1);
  const double waited =
      static_cast<double>(after.wait_us - before.wait_us) / 1e6 / static_cast<double>(o.iters + 1);
  res.vs_local_s = res.ep_s - res.local_s;
  const double tokens = static_cast<double>(o.tokens * p);
  res.ep_tokens_per_s = tokens / res.ep_s;
  res.local_tokens_per_s = tokens / res.local_s;

  // The formula from the last step's routing (the same weights and tokens every iteration).
  const auto& per_expert = sharded->stats().per_expert;  // this rank's rows per global expert
  auto all = comm::all_gather(*timing, at::tensor(per_expert, at::kLong).view({1, o.experts}), 0);
  const int64_t local_e = o.experts / p, me = world.rank();
  int64_t to_others = 0, from_others = 0;
  for (int64_t e = 0; e < o.experts; ++e) {
    if (e / local_e != me) to_others += per_expert[static_cast<size_t>(e)];
    if (e / local_e == me) {
      for (int64_t s = 0; s < p; ++s)
        if (s != me) from_others += all[s][e].item<int64_t>();
    }
  }
  const int64_t row = o.hidden * 4;
  const int64_t counts = local_e * (p - 1) * 8;
  const int64_t formula = 2 * (to_others + from_others) * row + counts;
  const int64_t uniform = 4 * o.tokens * o.top_k * (p - 1) / p * row + counts;
  auto mine = at::tensor({static_cast<double>(bytes), static_cast<double>(formula),
                          static_cast<double>(process_peak_rss_bytes()), waited},
                         at::kDouble);
  auto gathered = comm::all_gather(*timing, mine.view({1, 4}), 0);
  for (int64_t r = 0; r < p; ++r) {
    res.a2a_bytes_per_rank.push_back(static_cast<int64_t>(gathered[r][0].item<double>()));
    res.formula_bytes_per_rank.push_back(static_cast<int64_t>(gathered[r][1].item<double>()));
    res.peak_rss_bytes =
        std::max(res.peak_rss_bytes, static_cast<int64_t>(gathered[r][2].item<double>()));
    res.exposed_s = std::max(res.exposed_s, gathered[r][3].item<double>());
  }
  res.uniform_bytes_per_rank = uniform;
  return res;
}

}  // namespace hp::bench
