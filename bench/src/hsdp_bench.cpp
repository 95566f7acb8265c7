#include "hp/bench/hsdp_bench.h"

#include <algorithm>
#include <chrono>

#include <ATen/ATen.h>

#include "hp/bench/link.h"
#include "hp/comm/collectives.h"
#include "hp/comm/device_mesh.h"
#include "hp/common/check.h"
#include "hp/model/qwen3.h"
#include "hp/plan/plan.h"

namespace hp::bench {
namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// Median over iterations of the slowest rank.
double median_max(const comm::World& world, std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const double med = v[v.size() / 2];
  return comm::all_reduce(world.group(), at::full({1}, med, at::kDouble), comm::ReduceOp::kMax)
      .item<double>();
}

HsdpBenchResult run_mode(const comm::World& world, const HsdpBenchOptions& o, bool pipelined) {
  model::Qwen3Config mc;
  mc.vocab = o.vocab;
  mc.layers = o.layers;
  mc.hidden = o.hidden;
  mc.heads = o.heads;
  mc.kv_heads = o.kv_heads;
  mc.head_dim = o.head_dim;
  mc.ffn = o.ffn;
  plan::PlanOptions po;
  po.dp_shard = o.dp_shard;
  po.dp_replicate = o.dp_replicate;
  po.comm_fusion = o.comm_fusion;
  model::Qwen3 model(mc);
  auto plan = plan::ShardingPlanner().plan(*model, world.size(), po);
  plan.hsdp_options.pipeline = pipelined;
  comm::DeviceMesh mesh(world, plan.mesh_dims, plan.mesh_options());
  plan::ShardingApplier().apply(*model, plan, mesh);
  HP_CHECK(plan.fully_shard, "hp-bench hsdp: --dp-shard x --dp-replicate must be > 1");
  auto& fs = *plan.fully_shard;
  auto gen = at::make_generator<at::CPUGeneratorImpl>(1000 + world.rank());
  auto ids = at::randint(0, o.vocab, {o.batch, o.seq}, gen, at::kLong);
  auto pos = at::arange(o.seq).expand({o.batch, o.seq});
  auto& counters = world.context().counters;
  HsdpBenchResult r;
  r.mode = pipelined ? "pipelined" : "baseline";
  std::vector<double> fwd, bwd, exposed, drain;
  for (int it = -1; it < o.iters; ++it) {  // one warm-up
    comm::barrier(world.group());
    const bool wire = it == 0 && emulated_link_rate().has_value();
    const int64_t wire_before = wire ? loopback_tx_bytes() : 0;
    counters.reset();
    auto t0 = std::chrono::steady_clock::now();
    auto loss = model->forward(ids, pos).pow(2).mean();
    const double f = seconds_since(t0);
    const auto mid = fs.stats();
    t0 = std::chrono::steady_clock::now();
    loss.backward();
    const double b = seconds_since(t0);
    const auto after = fs.stats();
    if (wire) {
      comm::barrier(world.group());  // every collective of the step delivered (and counted)
      r.wire_bytes_per_rank = (loopback_tx_bytes() - wire_before) / world.size();
    }
    for (auto& [name, shard] : fs.sharded_parameters())
      shard.mutable_grad() = at::Tensor();
    if (it < 0) {
      continue;
    }
    fwd.push_back(f);
    bwd.push_back(b);
    exposed.push_back(after.exposed_s - mid.exposed_s);
    drain.push_back(after.drain_s - mid.drain_s);
    if (it == 0) {
      r.bytes_all_gather = counters.bytes(comm::OpKind::kAllGather);
      r.bytes_reduce_scatter = counters.bytes(comm::OpKind::kReduceScatter);
      r.bytes_all_reduce = counters.bytes(comm::OpKind::kAllReduce);
    }
  }
  r.forward_s = median_max(world, fwd);
  r.backward_s = median_max(world, bwd);
  r.exposed_comm_s = median_max(world, exposed);
  r.drain_s = median_max(world, drain);
  const auto f = fs.bytes_per_step();
  r.formula_all_gather = f.all_gather;
  r.formula_reduce_scatter = f.reduce_scatter;
  r.formula_all_reduce = f.all_reduce;
  r.param_bytes_per_rank = fs.stats().shard_numel * 4;
  r.full_param_bytes = fs.stats().full_numel * 4;
  return r;
}

}  // namespace

std::vector<HsdpBenchResult> run_hsdp_bench(const comm::World& world,
                                            const HsdpBenchOptions& options) {
  HP_CHECK(options.dp_shard * options.dp_replicate == world.size(), "hp-bench hsdp: --dp-shard ",
           options.dp_shard, " x --dp-replicate ", options.dp_replicate, " = ",
           options.dp_shard * options.dp_replicate, " but there are ", world.size(),
           " ranks; make the product equal --nproc");
  HP_CHECK(options.iters >= 1, "hp-bench hsdp: --iters must be >= 1");
  // Baseline first, then the pipeline: same model, data and ranks.
  return {run_mode(world, options, false), run_mode(world, options, true)};
}

}  // namespace hp::bench
