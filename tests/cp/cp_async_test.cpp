// Async schedule: every strategy x {sdpa_qkv, sdpa_hf}, causal, P in {2, 4}: output, input and
// parameter gradients equal the sync schedule and the single-process reference; two
// micro-batches in flight; recompute of the whole block; fallbacks and error paths. The
// overlap seen in the trace: cp_async_overlap_test.cpp.
#include <algorithm>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "cp_async_block.h"
#include "cp_test_util.h"
#include "hp/attention/core_attention.h"
#include "hp/comm/collectives.h"
#include "hp/comm/device_mesh.h"
#include "hp/common/check.h"
#include "hp/common/recompute.h"
#include "hp/cp/config.h"
#include "hp/cp/runtime.h"
#include "hp/cp/sequence.h"
#include "rank_harness.h"

namespace hp::cp {
namespace {

using namespace hp::cp::async_testing;  // NOLINT: the block, its shapes and configs
using hp::cp::testing::quiet;
using hp::cp::testing::seeded;
using hp::cp::testing::shard;
using hp::testing::expect_close;
using hp::testing::run_ranks;

struct Grads {
  at::Tensor y, dx;
  std::vector<at::Tensor> dparams;
};

// The single-process reference on the full sequence.
Grads reference(bool qkv_style, const at::Tensor& x, const at::Tensor& dy) {
  BlockWithHandoffs m(qkv_style);
  m.host().set_primitive("math");
  auto xx = x.clone().requires_grad_(true);
  auto y = m.forward(xx);
  y.backward(dy);
  Grads g{y.detach(), xx.grad(), {}};
  for (auto& p : m.params())
    g.dparams.push_back(p.grad());
  return g;
}

// This rank's run; parameter gradients summed over the CP ranks.
Grads distributed(comm::World& w, const ContextParallelConfig& cfg, const std::string& adapter,
                  const at::Tensor& x_full, const at::Tensor& dy_full) {
  const int64_t p = w.size();
  comm::DeviceMesh mesh(w, {{"cp", p}});
  auto topo = CPTopology::build(w, mesh.group_ptr({"cp"}), cfg);
  BlockWithHandoffs m(adapter == "sdpa_qkv");
  auto spec = spec_for(adapter);
  apply_context_parallel(m.host(), spec, cfg, topo, quiet());
  EXPECT_EQ(spec.resolved_schedule, to_string(cfg.schedule));
  auto x = shard(x_full, 1, w.rank(), p).requires_grad_(true);
  auto y = m.forward(x);
  y.backward(shard(dy_full, 1, w.rank(), p));
  Grads g{y.detach(), x.grad(), {}};
  for (auto& par : m.params())
    g.dparams.push_back(comm::all_reduce(*topo->cp, par.grad()));
  return g;
}

// This rank's y and dx (contiguous shard r of p) and m's parameter gradients summed over `cp`
// equal the reference's.
void expect_reference(const Grads& ref, const at::Tensor& y, const at::Tensor& dx,
                      const BlockWithHandoffs& m, comm::Group& cp, int64_t r, int64_t p,
                      const std::string& what) {
  expect_close(y, shard(ref.y, 1, r, p), what + " y");
  expect_close(dx, shard(ref.dx, 1, r, p), what + " dx");
  for (size_t i = 0; i < ref.dparams.size(); ++i) {
    expect_close(comm::all_reduce(cp, m.params()[i].grad()), ref.dparams[i], what + " dparam", 1e-5,
                 2e-5);
  }
}

void run_async_vs_sync(const std::string& algo, int p) {
  auto x = seeded(11, {1, kS, kHidden}), dy = seeded(12, {1, kS, kHidden});
  for (const std::string adapter : {"sdpa_qkv", "sdpa_hf"}) {
    auto ref = reference(adapter == "sdpa_qkv", x, dy);
    run_ranks(p, [&](comm::World& w) {
      auto a = distributed(w, make(algo, p, CPSchedule::kAsync), adapter, x, dy);
      auto s = distributed(w, make(algo, p, CPSchedule::kSync), adapter, x, dy);
      const std::string what = algo + "/" + adapter + " rank " + std::to_string(w.rank());
      const int64_t r = w.rank();
      expect_close(a.y, shard(ref.y, 1, r, p), what + " y vs reference");
      expect_close(a.dx, shard(ref.dx, 1, r, p), what + " dx vs reference");
      // Async all_gather and ulysses compute attention in pieces merged by their lse
      // (overlap.cpp): the same numbers up to fp32 summation order.
      const double tol = algo == "hybrid" ? 1e-6 : 1e-5;
      for (size_t i = 0; i < a.dparams.size(); ++i) {
        expect_close(a.dparams[i], ref.dparams[i], what + " dparam vs reference", 1e-5, 2e-5);
        expect_close(a.dparams[i], s.dparams[i], what + " dparam vs sync", tol, 2 * tol);
      }
      expect_close(a.y, s.y, what + " y vs sync", tol, tol);
      expect_close(a.dx, s.dx, what + " dx vs sync", tol, tol);
    });
  }
}

// Async all_gather with data-order head-tail shards: the overlapped call splits each query
// part into local and remote key ranges; output and gradients equal the reference.
void run_async_load_balanced(int p) {
  auto x = seeded(21, {1, kS, kHidden}), dy = seeded(22, {1, kS, kHidden});
  auto ref = reference(false, x, dy);
  run_ranks(p, [&](comm::World& w) {
    auto cfg = make("all_gather", p, CPSchedule::kAsync);
    cfg.load_balance = true;
    comm::DeviceMesh mesh(w, {{"cp", p}});
    auto topo = CPTopology::build(w, mesh.group_ptr({"cp"}), cfg);
    BlockWithHandoffs m(false);
    auto spec = spec_for("sdpa_hf");
    apply_context_parallel(m.host(), spec, cfg, topo, quiet());
    const int r = w.rank();
    auto xs = shard_sequence(x, 1, r, p, true).requires_grad_(true);
    auto y = m.forward(xs);
    y.backward(shard_sequence(dy, 1, r, p, true));
    auto ys = comm::all_gather(*topo->cp, y.detach().contiguous(), 0);
    auto dxs = comm::all_gather(*topo->cp, xs.grad().contiguous(), 0);
    std::vector<at::Tensor> yl, dl;
    for (int64_t i = 0; i < p; ++i) {
      yl.push_back(ys.narrow(0, i, 1));
      dl.push_back(dxs.narrow(0, i, 1));
    }
    const std::string what = "all_gather async load-balanced P=" + std::to_string(p);
    expect_close(unshard_sequence(yl, 1, true), ref.y, what + " y");
    expect_close(unshard_sequence(dl, 1, true), ref.dx, what + " dx");
    for (size_t i = 0; i < ref.dparams.size(); ++i) {
      expect_close(comm::all_reduce(*topo->cp, m.params()[i].grad()), ref.dparams[i],
                   what + " dparam", 1e-5, 2e-5);
    }
  });
}

TEST(CPAsync, AllGatherLoadBalancedOverlapP2) {
  run_async_load_balanced(2);
}
TEST(CPAsync, AllGatherLoadBalancedOverlapP4) {
  run_async_load_balanced(4);
}

TEST(CPAsync, AllGatherP2) {
  run_async_vs_sync("all_gather", 2);
}
TEST(CPAsync, AllGatherP4) {
  run_async_vs_sync("all_gather", 4);
}
TEST(CPAsync, UlyssesP2) {
  run_async_vs_sync("ulysses", 2);
}
TEST(CPAsync, UlyssesP4) {
  run_async_vs_sync("ulysses", 4);
}
TEST(CPAsync, HybridP4) {
  run_async_vs_sync("hybrid", 4);
}

TEST(CPAsync, TwoMicroBatchesInFlightAndRecompute) {
  const int p = 2;
  auto x1 = seeded(21, {1, kS, kHidden}), x2 = seeded(22, {1, kS, kHidden});
  auto d1 = seeded(23, {1, kS, kHidden}), d2 = seeded(24, {1, kS, kHidden});
  for (const std::string algo : {"all_gather", "ulysses"}) {
    auto r1 = reference(false, x1, d1), r2 = reference(false, x2, d2);
    run_ranks(p, [&](comm::World& w) {
      comm::DeviceMesh mesh(w, {{"cp", p}});
      auto cfg = make(algo, p, CPSchedule::kAsync);
      auto topo = CPTopology::build(w, mesh.group_ptr({"cp"}), cfg);
      BlockWithHandoffs m(false);
      auto spec = spec_for("sdpa_hf");
      apply_context_parallel(m.host(), spec, cfg, topo, quiet());
      const int64_t r = w.rank();
      // Two forwards, then two backwards (second first).
      auto a = shard(x1, 1, r, p).requires_grad_(true);
      auto b = shard(x2, 1, r, p).requires_grad_(true);
      auto ya = m.forward(a);
      auto yb = m.forward(b);
      yb.backward(shard(d2, 1, r, p));
      ya.backward(shard(d1, 1, r, p));
      expect_close(ya, shard(r1.y, 1, r, p), algo + " micro-batch 1 y");
      expect_close(a.grad(), shard(r1.dx, 1, r, p), algo + " micro-batch 1 dx");
      expect_close(b.grad(), shard(r2.dx, 1, r, p), algo + " micro-batch 2 dx");
      for (size_t i = 0; i < 4; ++i) {
        expect_close(comm::all_reduce(*topo->cp, m.params()[i].grad()),
                     r1.dparams[i] + r2.dparams[i], algo + " micro-batch dparam", 1e-5, 2e-5);
      }
      // Recompute of the whole block: the forward keeps nothing, the backward re-runs it and
      // launches its own slots.
      m.zero_grad();
      auto c = shard(x1, 1, r, p).requires_grad_(true);
      auto yc = common::checkpoint(
          [&](const std::vector<at::Tensor>& in) {
            return std::vector<at::Tensor>{m.forward(in[0])};
          },
          {c})[0];
      yc.backward(shard(d1, 1, r, p));
      expect_reference(r1, yc, c.grad(), m, *topo->cp, r, p, algo + " recompute");
    });
  }
}

// A forward that throws between its handoffs and its attention (on every rank) leaves launched
// collectives and held pieces behind; the next forward's scope drops them, and that forward and
// its backward equal the reference. Head groups hold pieces back; the failure comes after K's
// handoff (before V's) or after all three.
TEST(CPAsync, AFailedForwardLeavesNothingBehind) {
  const int p = 2;
  auto x = seeded(51, {1, kS, kHidden}), dy = seeded(52, {1, kS, kHidden});
  for (const std::string adapter : {"sdpa_qkv", "sdpa_hf"}) {
    auto ref = reference(adapter == "sdpa_qkv", x, dy);
    for (const std::string algo : {"all_gather", "ulysses"}) {
      for (auto fail :
           {BlockWithHandoffs::Fail::kAfterK, BlockWithHandoffs::Fail::kBeforeAttention}) {
        run_ranks(p, [&](comm::World& w) {
          comm::DeviceMesh mesh(w, {{"cp", p}});
          auto cfg = make(algo, p, CPSchedule::kAsync);
          cfg.ulysses_head_groups = 2;
          cfg = *normalize(cfg, p);
          auto topo = CPTopology::build(w, mesh.group_ptr({"cp"}), cfg);
          BlockWithHandoffs m(adapter == "sdpa_qkv");
          auto spec = spec_for(adapter);
          apply_context_parallel(m.host(), spec, cfg, topo, quiet());
          const int64_t r = w.rank();
          const std::string what =
              algo + "/" + adapter + (fail == BlockWithHandoffs::Fail::kAfterK ? " after k" : "");
          m.fail_ = fail;
          auto xs = shard(x, 1, r, p).requires_grad_(true);
          EXPECT_NE(hp::testing::error_of([&] { m.forward(xs); }).find("injected failure"),
                    std::string::npos)
              << what;
          auto* runtime = dynamic_cast<CPRuntime*>(m.host().installed(
              adapter == "sdpa_qkv" ? attention::AttentionHost::Slot::kModuleBoundary
                                    : attention::AttentionHost::Slot::kPrimitiveCall));
          ASSERT_NE(runtime, nullptr);
          // K (all_gather moves K and V), or Q and K (Ulysses), or all that the strategy moves.
          const size_t moved = algo == "ulysses" ? 3 : 2;
          EXPECT_EQ(runtime->state().pending(),
                    fail == BlockWithHandoffs::Fail::kAfterK ? moved - 1 : moved)
              << what << ": the failed forward's slots";
          m.fail_ = BlockWithHandoffs::Fail::kNone;
          auto y = m.forward(xs);
          y.backward(shard(dy, 1, r, p));
          expect_reference(ref, y, xs.grad(), m, *topo->cp, r, p, what + " after the failure");
        });
      }
    }
  }
}

// A forward that announced documents hiding every other rank's keys (so its handoffs skipped
// the K/V gathers) and then threw: the next forward's scope forgets that announcement, so the
// next forward, announcing nothing, gathers as usual and equals the reference. Before, the
// stale announcement skipped its gathers too, and its call was refused for breaking it.
TEST(CPAsync, AFailedForwardsAnnouncementIsForgotten) {
  const int p = 2;
  auto x = seeded(61, {1, kS, kHidden}), dy = seeded(62, {1, kS, kHidden});
  auto ref = reference(false, x, dy);
  run_ranks(p, [&](comm::World& w) {
    comm::DeviceMesh mesh(w, {{"cp", p}});
    auto cfg = make("all_gather", p, CPSchedule::kAsync);
    auto topo = CPTopology::build(w, mesh.group_ptr({"cp"}), cfg);
    BlockWithHandoffs m(false);
    auto spec = spec_for("sdpa_hf");
    apply_context_parallel(m.host(), spec, cfg, topo, quiet());
    attention::AttentionOptions hidden;
    hidden.causal = true;
    hidden.documents =
        attention::Documents{attention::document_ids_from_cu_seqlens({0, kS / 2, kS}, kS)};
    m.announce_ = hidden;
    m.fail_ = BlockWithHandoffs::Fail::kBeforeAttention;
    const int64_t r = w.rank();
    auto xs = shard(x, 1, r, p).requires_grad_(true);
    EXPECT_NE(hp::testing::error_of([&] { m.forward(xs); }).find("injected failure"),
              std::string::npos);
    m.announce_.reset();
    m.fail_ = BlockWithHandoffs::Fail::kNone;
    auto y = m.forward(xs);
    y.backward(shard(dy, 1, r, p));
    expect_reference(ref, y, xs.grad(), m, *topo->cp, r, p, "after the failed announced forward");
  });
}

TEST(CPAsync, FallbackAndErrorPaths) {
  run_ranks(2, [](comm::World& w) {
    comm::DeviceMesh mesh(w, {{"cp", 2}});
    auto cfg = make("ulysses", 2, CPSchedule::kAsync);
    auto topo = CPTopology::build(w, mesh.group_ptr({"cp"}), cfg);
    // Missing handoff for v with fallback = error: refused at apply.
    {
      BlockWithHandoffs m(false);
      auto spec = spec_for("sdpa_hf");
      spec.cp_handoff_targets.erase("v");
      spec.cp_handoff_targets["k"] = "k_norm";
      auto msg = hp::testing::error_of(
          [&] { apply_context_parallel(m.host(), spec, cfg, topo, quiet()); });
      EXPECT_NE(msg.find("missing: k ('k_norm' is not a handoff point here), v (no "
                         "cp_handoff_targets entry). Handoff points on this module: q_handoff, "
                         "k_handoff, v_handoff"),
                std::string::npos)
          << msg;
    }
    // fallback = sync: warns, runs sync, and says so.
    {
      BlockWithHandoffs m(false);
      auto spec = spec_for("sdpa_hf");
      spec.cp_handoff_targets.erase("v");
      auto fb = cfg;
      fb.async_fallback = AsyncFallback::kSync;
      std::vector<std::string> lines;
      CPApplyOptions o;
      o.log = [&](const std::string& l) { lines.push_back(l); };
      apply_context_parallel(m.host(), spec, fb, topo, o);
      EXPECT_EQ(spec.resolved_schedule, "sync");
      ASSERT_EQ(lines.size(), 2u);
      EXPECT_NE(lines[0].find("warning: module 'block.attn': schedule=async falls back to sync"),
                std::string::npos);
      EXPECT_NE(lines[1].find("schedule=sync"), std::string::npos) << lines[1];
      EXPECT_NE(lines[1].find("fallback=sync(missing handoff: v (no cp_handoff_targets entry))"),
                std::string::npos)
          << lines[1];
      EXPECT_FALSE(m.v_handoff.hooked());
      EXPECT_FALSE(m.q_handoff.hooked()) << "a fallback installs no hooks at all";
      auto y = m.forward(shard(seeded(31, {1, kS, kHidden}), 1, w.rank(), 2));
      EXPECT_EQ(y.size(1), kS / 2);
    }
    // A forward that runs the handoffs but never reaches attention: leftover slots.
    {
      BlockWithHandoffs m(false);
      auto spec = spec_for("sdpa_hf");
      apply_context_parallel(m.host(), spec, cfg, topo, quiet());
      m.skip_attention_ = true;
      auto x = shard(seeded(32, {1, kS, kHidden}), 1, w.rank(), 2);
      auto msg = hp::testing::error_of([&] { m.forward(x); });
      EXPECT_NE(msg.find("the module's forward finished without reaching the attention primitive"),
                std::string::npos)
          << msg;
      // The next forward's scope drops the leftover slots: it runs, and equals a fresh module.
      m.skip_attention_ = false;
      auto y = m.forward(x);
      BlockWithHandoffs fresh(false);
      auto fresh_spec = spec_for("sdpa_hf");
      apply_context_parallel(fresh.host(), fresh_spec, cfg, topo, quiet());
      expect_close(y, fresh.forward(x), "the forward after a misfire");
    }
    // The same misfire through the module boundary (sdpa_qkv) names the module and the other
    // adapter.
    {
      BlockWithHandoffs m(true);
      auto spec = spec_for("sdpa_qkv");
      apply_context_parallel(m.host(), spec, cfg, topo, quiet());
      m.skip_attention_ = true;
      auto msg = hp::testing::error_of([&] {
        m.forward(shard(seeded(32, {1, kS, kHidden}), 1, w.rank(), 2));
      });
      EXPECT_NE(msg.find("the module's forward finished without reaching the attention module"),
                std::string::npos)
          << msg;
      EXPECT_NE(msg.find("use the sdpa_hf adapter"), std::string::npos) << msg;
    }
    // Without a scope nothing tells the runtime a new forward began: the leftover slot is an
    // error that names the scope.
    {
      BlockWithHandoffs m(true);
      m.scoped_ = false;
      auto spec = spec_for("sdpa_qkv");
      apply_context_parallel(m.host(), spec, cfg, topo, quiet());
      m.fail_ = BlockWithHandoffs::Fail::kBeforeAttention;
      auto x = shard(seeded(32, {1, kS, kHidden}), 1, w.rank(), 2);
      EXPECT_NE(hp::testing::error_of([&] { m.forward(x); }).find("injected failure"),
                std::string::npos);
      m.fail_ = BlockWithHandoffs::Fail::kNone;
      auto msg = hp::testing::error_of([&] { m.forward(x); });
      EXPECT_NE(msg.find("the slot of handoff 'q_handoff' (q, invocation 0) was never consumed"),
                std::string::npos)
          << msg;
      EXPECT_NE(msg.find("AttentionHost::forward_scope()"), std::string::npos) << msg;
    }
    // Something transforms K after its handoff: the consumer sees another tensor.
    {
      BlockWithHandoffs m(true);
      auto spec = spec_for("sdpa_qkv");
      apply_context_parallel(m.host(), spec, cfg, topo, quiet());
      m.transform_after_handoff_ = true;
      auto msg = hp::testing::error_of([&] {
        m.forward(shard(seeded(33, {1, kS, kHidden}), 1, w.rank(), 2));
      });
      EXPECT_NE(msg.find("the k reaching attention is not the tensor handoff 'k_handoff' emitted "
                         "(invocation 0)"),
                std::string::npos)
          << msg;
    }
  });
}

}  // namespace
}  // namespace hp::cp
