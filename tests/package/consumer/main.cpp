// A 2-rank context-parallel attention layer (all_gather, causal; two threads as ranks over one
// in-process HashStore) built against the installed package, checked against single-process
// attention: output and input gradients. Exits 1 on a mismatch.
#include <cstdio>
#include <exception>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/distributed/c10d/HashStore.hpp>

#include "hp/attention/core_attention.h"
#include "hp/comm/device_mesh.h"
#include "hp/comm/world.h"
#include "hp/cp/apply.h"
#include "hp/cp/config.h"
#include "hp/cp/topology.h"

namespace {

constexpr int kRanks = 2;
constexpr int64_t kB = 1, kHeads = 4, kSeq = 64, kDim = 16;

at::Tensor seeded(uint64_t seed) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn({kB, kHeads, kSeq, kDim}, gen, at::kFloat);
}

hp::attention::CoreAttentionOptions attention_options() {
  hp::attention::CoreAttentionOptions o;
  o.attention.causal = true;
  o.attention.block_q = 16;
  o.attention.block_kv = 16;
  return o;
}

struct Result {
  at::Tensor out, dq, dk, dv;
};

// Forward + backward of one attention layer on (q, k, v); dout = seeded(4) (sharded like q).
Result run_layer(hp::attention::CoreAttention& layer, at::Tensor q, at::Tensor k, at::Tensor v,
                 const at::Tensor& dout) {
  q.requires_grad_(true);
  k.requires_grad_(true);
  v.requires_grad_(true);
  auto out = layer.forward(q, k, v);
  (out * dout).sum().backward();
  return {out.detach(), q.grad(), k.grad(), v.grad()};
}

at::Tensor shard(const at::Tensor& full, int rank) {
  return full.chunk(kRanks, /*dim=*/2)[rank].contiguous();
}

}  // namespace

int main() {
  at::set_num_threads(1);  // the rank threads share the cores
  const auto q = seeded(1), k = seeded(2), v = seeded(3), dout = seeded(4);

  hp::attention::CoreAttention single(attention_options());
  const Result ref = run_layer(single, q.clone(), k.clone(), v.clone(), dout);

  hp::cp::ContextParallelConfig requested;
  requested.algorithm = hp::cp::CPAlgorithm::kAllGather;
  const auto config = *hp::cp::normalize(requested, kRanks);

  auto store = c10::make_intrusive<c10d::HashStore>();
  std::vector<Result> results(kRanks);
  std::vector<std::string> errors(kRanks);
  std::vector<std::thread> threads;
  for (int r = 0; r < kRanks; ++r) {
    threads.emplace_back([&, r] {
      try {
        auto world = hp::comm::World::in_process(r, kRanks, store);
        hp::comm::DeviceMesh mesh(world, {{"cp", kRanks}});
        auto topology = hp::cp::CPTopology::build(world, mesh.group_ptr({"cp"}), config);
        hp::attention::CoreAttention layer(attention_options());
        hp::cp::CPModuleSpec spec;
        spec.module_path = "attn";
        spec.inner_wrapper = "sdpa_qkv";
        hp::cp::CPApplyOptions apply_options;
        apply_options.log = [](const std::string&) {};
        hp::cp::apply_context_parallel(layer.host(), spec, config, topology, apply_options);
        results[r] = run_layer(layer, shard(q, r), shard(k, r), shard(v, r), shard(dout, r));
      } catch (const std::exception& e) {
        errors[r] = e.what();
      }
    });
  }
  for (auto& t : threads)
    t.join();

  int failures = 0;
  for (int r = 0; r < kRanks; ++r) {
    if (!errors[r].empty()) {
      std::fprintf(stderr, "rank %d failed: %s\n", r, errors[r].c_str());
      ++failures;
      continue;
    }
    const std::pair<const char*, std::pair<at::Tensor, at::Tensor>> checks[] = {
        {"out", {results[r].out, shard(ref.out, r)}},
        {"dq", {results[r].dq, shard(ref.dq, r)}},
        {"dk", {results[r].dk, shard(ref.dk, r)}},
        {"dv", {results[r].dv, shard(ref.dv, r)}},
    };
    for (const auto& [name, pair] : checks) {
      const double diff = (pair.first - pair.second).abs().max().item<double>();
      const bool ok = at::allclose(pair.first, pair.second, /*rtol=*/1e-5, /*atol=*/1e-5);
      std::printf("rank %d %s: max abs diff %.3g %s\n", r, name, diff, ok ? "ok" : "MISMATCH");
      failures += ok ? 0 : 1;
    }
  }
  std::printf(failures == 0 ? "consumer: CP attention matches single-process attention\n"
                            : "consumer: FAILED\n");
  return failures == 0 ? 0 : 1;
}
