// The planner's memory estimate: the model's footprint counts exactly the parameters the built
// model has; the layout divides what it should (TP, HSDP, CP, recompute); the check refuses
// with the numbers and the option to change.
#include <string>

#include <gtest/gtest.h>

#include "hp/common/check.h"
#include "hp/model/qwen3.h"
#include "hp/plan/memory.h"
#include "rank_harness.h"

namespace hp::plan {
namespace {

model::Qwen3Config config() {
  model::Qwen3Config c;
  c.vocab = 96;
  c.layers = 3;
  c.hidden = 64;
  c.heads = 4;
  c.kv_heads = 2;
  c.head_dim = 16;
  c.ffn = 160;
  return c;
}

TEST(MemoryEstimate, FootprintCountsTheBuiltModelsParameters) {
  for (bool tied : {false, true}) {
    auto c = config();
    c.tie_embeddings = tied;
    model::Qwen3 built(c);
    int64_t numel = 0, largest = 0;
    for (const auto& p : built->parameters()) {
      numel += p.numel();
      largest = std::max(largest, p.numel());
    }
    const auto f = model::footprint(c);
    int64_t counted = 0;
    for (const auto& u : f.units)
      counted += u.tp_sharded + u.replicated;
    // Tied: embed_tokens and lm_head are one tensor (parameters() lists it once).
    EXPECT_EQ(counted, numel) << "tied=" << tied;
    EXPECT_EQ(f.largest_param, largest);
    EXPECT_EQ(f.units.size(), static_cast<size_t>(1 + c.layers));  // root, then one per layer
  }
}

// Every family's footprint counts its built model's parameters (mixed layer patterns, gated
// attention, MoE with a shared expert), and EP splits exactly the experts.
TEST(MemoryEstimate, FamiliesCountTheirParametersAndEpSplitsTheExperts) {
  auto c = config();
  c.layers = 4;
  c.experts = 4;
  c.moe_ffn = 48;
  c.shared_expert_ffn = 32;
  for (const std::string pattern : {"", "LLLG", "LLLM", "AG"}) {
    c.layer_pattern = pattern;
    model::Qwen3 built(c);
    int64_t numel = 0;
    for (const auto& p : built->parameters())
      numel += p.numel();
    int64_t counted = 0, experts = 0;
    for (const auto& u : model::footprint(c).units) {
      counted += u.tp_sharded + u.replicated + u.expert;
      experts += u.expert;
    }
    EXPECT_EQ(counted, numel) << "pattern " << pattern;
    EXPECT_EQ(experts, c.layers * 3 * c.experts * c.moe_ffn * c.hidden);
    // EP splits the experts outside HSDP, which shards the rest over the 4 CP ranks.
    PlanOptions o;
    o.cp_size = 4;
    o.seq_len = 256;
    o.ep_size = 2;
    const auto two = estimate_memory(model::footprint(c), o);
    o.ep_size = 4;
    const auto four = estimate_memory(model::footprint(c), o);
    EXPECT_EQ(two.parameters - four.parameters, (experts / 2 - experts / 4) * 4)
        << "pattern " << pattern;
  }
}

TEST(MemoryEstimate, TheLayoutDividesWhatItShards) {
  const auto f = model::footprint(config());
  PlanOptions base;
  base.seq_len = 256;
  base.batch = 2;
  const auto one = estimate_memory(f, base);
  EXPECT_EQ(one.optimizer, 2 * one.parameters);  // AdamW: two moments
  EXPECT_EQ(one.gradients, one.parameters);
  EXPECT_EQ(one.runtime, kRuntimeBytes);
  EXPECT_EQ(one.total(), one.parameters + one.gradients + one.optimizer + one.activations +
                             one.transient + one.runtime);

  auto tp = base;
  tp.tp_size = 2;
  const auto t = estimate_memory(f, tp);
  EXPECT_LT(t.parameters, one.parameters);  // Q/K/V/O and the MLP split; embeddings do not
  EXPECT_GT(t.parameters, one.parameters / 2);
  EXPECT_LT(t.activations, one.activations);

  auto hsdp = base;
  hsdp.dp_shard = 4;
  const auto h = estimate_memory(f, hsdp);
  EXPECT_NEAR(static_cast<double>(h.parameters), one.parameters / 4.0, 16.0);
  EXPECT_GT(h.transient, 0) << "gathered units";

  auto cp = base;
  cp.cp_size = 2;
  const auto c = estimate_memory(f, cp);
  EXPECT_LT(c.activations, one.activations);  // half the tokens, plus the gathered K/V
  EXPECT_GT(c.activations, one.activations / 2);
  // CP ranks join HSDP's shard group: parameters are replicated over them otherwise.
  EXPECT_NEAR(static_cast<double>(c.parameters), one.parameters / 2.0, 16.0);

  auto rc = config();
  rc.recompute = true;
  EXPECT_LT(estimate_memory(model::footprint(rc), base).activations, one.activations);
}

TEST(MemoryEstimate, TheCheckRefusesWithTheNumbersAndWhatToChange) {
  auto c = config();
  c.hidden = 1 << 20;
  PlanOptions o;
  o.seq_len = 64;
  const auto big = estimate_memory(model::footprint(c), o);
  const MachineMemory machine{int64_t{8} << 30, "test"};
  HP_EXPECT_ERROR(check_memory(big, 2, machine, "tool"),
                  "tool: not enough memory: this layout "
                  "needs about");
  HP_EXPECT_ERROR(check_memory(big, 2, machine, "tool"), "x 2 ranks on this machine");
  HP_EXPECT_ERROR(check_memory(big, 2, machine, "tool"), "8.0 GiB is available (test)");
  HP_EXPECT_ERROR(check_memory(big, 2, machine, "tool"), "--hidden");
  const auto small = estimate_memory(model::footprint(config()), o);
  EXPECT_NO_THROW(check_memory(small, 2, machine, "tool"));
  EXPECT_NO_THROW(check_memory(big, 2, MachineMemory{}, "tool")) << "unknown memory: no check";
  EXPECT_EQ(format_bytes(int64_t{3} << 29), "1.5 GiB");
  EXPECT_EQ(format_bytes(int64_t{512} << 20), "512 MiB");
  EXPECT_EQ(format_bytes(12 << 10), "12 KiB");
}

TEST(MemoryEstimate, TheMachineReportsItsMemory) {
  const auto m = machine_memory();
  EXPECT_GT(m.bytes, int64_t{64} << 20);
  EXPECT_FALSE(m.source.empty());
}

}  // namespace
}  // namespace hp::plan
