// Every strategy x every adapter against the single-process full-sequence reference: out and
// dq/dk/dv (core-attention adapters), out, dx and projection-weight gradients (module
// adapters); causal and not, MHA and GQA 8/2, BNSD and BSHD.
#include <ATen/ATen.h>
#include <gtest/gtest.h>
#include <torch/csrc/autograd/autograd.h>

#include "cp_test_util.h"
#include "hp/attention/core_attention.h"
#include "hp/comm/collectives.h"
#include "hp/comm/device_mesh.h"
#include "hp/common/check.h"
#include "hp/cp/config.h"
#include "rank_harness.h"

namespace hp::cp {
namespace {

using hp::cp::testing::ProjAttention;
using hp::cp::testing::quiet;
using hp::cp::testing::seeded;
using hp::cp::testing::shard;
using hp::testing::expect_close;
using hp::testing::run_ranks;

constexpr int64_t kB = 1, kD = 16;

struct Variant {
  std::string adapter;
  bool causal;
  int64_t nq, nkv;
  bool bshd;
  int64_t seq;  // global tokens: a multiple of P (every rank holds an equal shard)
  std::string name() const {
    return adapter + (causal ? "/causal" : "/dense") + "/" + std::to_string(nq) + "x" +
           std::to_string(nkv) + (bshd ? "/bshd" : "/bnsd");
  }
};

std::vector<Variant> variants(int64_t seq) {
  std::vector<Variant> out;
  for (const std::string a : {"sdpa_qkv", "flex_qkv", "sdpa_hf", "flex_hf"}) {
    for (bool causal : {false, true}) {
      for (auto heads : {std::pair<int64_t, int64_t>{8, 8}, {8, 2}}) {
        for (bool bshd : {false, true}) {
          if (bshd && a.find("_hf") != std::string::npos) continue;  // primitives are BNSD
          out.push_back({a, causal, heads.first, heads.second, bshd, seq});
        }
      }
    }
  }
  return out;
}

attention::AttentionOptions options_for(const Variant& v) {
  attention::AttentionOptions o;
  o.causal = v.causal;
  o.block_q = 8;
  o.block_kv = 8;
  if (v.adapter.rfind("flex", 0) == 0) {
    // A mask written for global positions and heads: exercises the re-basing.
    attention::MaskFunction m;
    m.per_head = true;
    m.fn = [](const at::Tensor&, const at::Tensor& h, const at::Tensor& q, const at::Tensor& kv) {
      return at::logical_or(kv.gt(q - 9 - h), kv.eq(0));  // window 9+h, plus a sink token
    };
    o.mask_fn = m;
  }
  return o;
}

struct Reference {
  at::Tensor out, dq, dk, dv;  // core-attention form (BNSD)
  at::Tensor y, dx;            // module form
  std::vector<at::Tensor> dparams;
};

Reference reference(const Variant& v) {
  Reference r;
  const auto& math = attention::AttentionRegistry::builtin().get("math");
  auto o = options_for(v);
  if (v.adapter.find("_qkv") != std::string::npos) {
    auto q = seeded(1, {kB, v.nq, v.seq, kD}).requires_grad_(true);
    auto k = seeded(2, {kB, v.nkv, v.seq, kD}).requires_grad_(true);
    auto vv = seeded(3, {kB, v.nkv, v.seq, kD}).requires_grad_(true);
    r.out = math.forward(q, k, vv, o).out;
    (r.out * seeded(4, r.out.sizes())).sum().backward();
    r.out = r.out.detach();
    r.dq = q.grad();
    r.dk = k.grad();
    r.dv = vv.grad();
  } else {
    ProjAttention m(32, v.nq, v.nkv, kD, o);
    m.host().set_primitive("math");
    auto x = seeded(5, {kB, v.seq, 32}).requires_grad_(true);
    r.y = m.forward(x);
    (r.y * seeded(6, r.y.sizes())).sum().backward();
    r.y = r.y.detach();
    r.dx = x.grad();
    for (auto& p : m.params())
      r.dparams.push_back(p.grad());
  }
  return r;
}

// Runs one variant on this rank and compares with the reference.
void check_variant(comm::World& /*w*/, const std::shared_ptr<const CPTopology>& topo,
                   const ContextParallelConfig& cfg, const Variant& v, const Reference& ref) {
  const int64_t p = topo->cp_size, r = topo->cp_rank;
  CPModuleSpec spec;
  spec.module_path = "attn";
  spec.inner_wrapper = v.adapter;
  const std::string what =
      std::string(to_string(cfg.algorithm)) + " " + v.name() + " rank " + std::to_string(r);
  if (v.adapter.find("_qkv") != std::string::npos) {
    attention::CoreAttentionOptions co;
    co.attention = options_for(v);
    if (v.bshd) {
      co.seq_dim = 1;
      co.heads_dim = 2;
      spec.cp_seq_dim = 1;
      spec.cp_head_dim = 2;
    }
    attention::CoreAttention core(co);
    apply_context_parallel(core.host(), spec, cfg, topo, quiet());
    auto lay = [&](const at::Tensor& bnsd) { return v.bshd ? bnsd.transpose(1, 2) : bnsd; };
    const int64_t seq = v.bshd ? 1 : 2;
    auto q = shard(lay(seeded(1, {kB, v.nq, v.seq, kD})), seq, r, p).requires_grad_(true);
    auto k = shard(lay(seeded(2, {kB, v.nkv, v.seq, kD})), seq, r, p).requires_grad_(true);
    auto vv = shard(lay(seeded(3, {kB, v.nkv, v.seq, kD})), seq, r, p).requires_grad_(true);
    auto out = core.forward(q, k, vv);
    (out * shard(lay(seeded(4, {kB, v.nq, v.seq, kD})), seq, r, p)).sum().backward();
    expect_close(out, shard(lay(ref.out), seq, r, p), what + " out");
    expect_close(q.grad(), shard(lay(ref.dq), seq, r, p), what + " dq");
    expect_close(k.grad(), shard(lay(ref.dk), seq, r, p), what + " dk");
    expect_close(vv.grad(), shard(lay(ref.dv), seq, r, p), what + " dv");
  } else {
    ProjAttention m(32, v.nq, v.nkv, kD, options_for(v));
    apply_context_parallel(m.host(), spec, cfg, topo, quiet());
    auto x = shard(seeded(5, {kB, v.seq, 32}), 1, r, p).requires_grad_(true);
    auto y = m.forward(x);
    (y * shard(seeded(6, {kB, v.seq, 32}), 1, r, p)).sum().backward();
    expect_close(y, shard(ref.y, 1, r, p), what + " y");
    expect_close(x.grad(), shard(ref.dx, 1, r, p), what + " dx");
    // Parameters are replicated over CP: their gradient is the sum over CP ranks.
    auto params = m.params();
    for (size_t i = 0; i < params.size(); ++i) {
      auto g = comm::all_reduce(*topo->cp, params[i].grad());
      expect_close(g, ref.dparams[i], what + " dparam " + std::to_string(i), 1e-5, 2e-5);
    }
  }
}

void run_grid(const std::string& algorithm, int p, std::optional<int64_t> degree) {
  ContextParallelConfig c;
  c.algorithm = parse_algorithm(algorithm);
  c.ulysses_degree = degree;
  auto cfg = *normalize(c, p);
  // 32 tokens, 48 where P = 3: the shards stay equal.
  const auto all = variants(p == 3 ? 48 : 32);
  std::vector<Reference> refs;
  for (const auto& v : all)
    refs.push_back(reference(v));
  run_ranks(p, [&](comm::World& w) {
    comm::DeviceMesh mesh(w, {{"cp", p}});
    auto topo = CPTopology::build(w, mesh.group_ptr({"cp"}), cfg);
    const int64_t u = ulysses_degree_of(cfg, p);
    for (size_t i = 0; i < all.size(); ++i) {
      const auto& v = all[i];
      if (v.nkv % u != 0) {
        // GQA with fewer KV heads than the Ulysses degree: refused before any collective.
        const auto before = w.context().recorder->records().size();
        try {
          check_variant(w, topo, cfg, v, refs[i]);
          ADD_FAILURE() << v.name() << ": expected a head-divisibility error";
        } catch (const hp::Error& e) {
          EXPECT_NE(std::string(e.what()).find("key/value heads = 2 are not divisible by the "
                                               "Ulysses degree " +
                                               std::to_string(u)),
                    std::string::npos)
              << e.what();
        }
        EXPECT_EQ(w.context().recorder->records().size(), before);
        continue;
      }
      check_variant(w, topo, cfg, v, refs[i]);
    }
  });
}

TEST(CPNumerics, AllGatherP2) {
  run_grid("all_gather", 2, std::nullopt);
}
TEST(CPNumerics, AllGatherP4) {
  run_grid("all_gather", 4, std::nullopt);
}
TEST(CPNumerics, UlyssesP2) {
  run_grid("ulysses", 2, std::nullopt);
}
TEST(CPNumerics, UlyssesP4) {
  run_grid("ulysses", 4, std::nullopt);
}
TEST(CPNumerics, HybridP4U2) {
  run_grid("hybrid", 4, 2);
}
// The ring's backward from the merged statistics through every adapter: BSHD modules (their
// statistics transposed by CoreAttention), mask functions re-based by the flex adapters, and
// the primitive-call slot (sdpa_hf, flex_hf).
TEST(CPNumerics, RingP3) {
  run_grid("ring", 3, std::nullopt);
}

}  // namespace
}  // namespace hp::cp
