// The float64 CP tests' module: q/k/v through handoff points into a CoreAttention (the module
// boundary slot, sdpa_qkv), tiles that do not divide the shards, and CP applied over a world.
#pragma once

#include <string>

#include <ATen/ATen.h>

#include "cp_test_util.h"
#include "hp/attention/core_attention.h"
#include "hp/comm/device_mesh.h"
#include "hp/cp/apply.h"
#include "hp/cp/config.h"
#include "hp/cp/topology.h"

namespace hp::cp::testing {

// The float64 tests' shapes: GQA (12 query heads, 6 K/V heads), 48 positions (shards of 16 at
// P = 3), and a value head dim of its own (Dqk 8, Dv 6, as MLA's 192 / 128).
constexpr int64_t kNq = 12, kNkv = 6, kS = 48, kDqk = 8, kDv = 6;

inline at::Tensor f64(uint64_t seed, at::IntArrayRef shape) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(shape, gen, at::kDouble);
}

// q/k/v through handoff points into a CoreAttention, so the async schedule has its launch
// sites (the module boundary slot: sdpa_qkv).
struct Direct {
  // primitive: the one the module's attention runs ("blockwise" offers backward_from_stats,
  // "math" does not). bshd: q/k/v are [B, S, N, D] (the module's default: [B, N, S, D]).
  explicit Direct(bool causal, const at::Tensor& doc_ids = {},
                  const std::string& primitive = "blockwise", bool bshd = false)
      : core(options(causal, doc_ids, primitive, bshd)), bshd(bshd) {
    for (auto* h : {&hq, &hk, &hv})
      core.host().add_handoff(h);
  }
  at::Tensor forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
    return core.forward(hq(q), hk(k), hv(v));
  }
  // doc_ids: packed documents of the whole (global) sequence, when given.
  static attention::CoreAttentionOptions options(bool causal, const at::Tensor& doc_ids = {},
                                                 const std::string& primitive = "blockwise",
                                                 bool bshd = false) {
    attention::CoreAttentionOptions o;
    if (bshd) {
      o.seq_dim = 1;
      o.heads_dim = 2;
    }
    o.primitive = primitive;
    o.attention.causal = causal;
    if (doc_ids.defined()) o.attention.documents = attention::Documents{doc_ids};
    o.attention.block_q = 5;  // tiles that do not divide the shards
    o.attention.block_kv = 7;
    return o;
  }
  attention::CoreAttention core;
  bool bshd = false;
  attention::HandoffPoint hq{"hq"}, hk{"hk"}, hv{"hv"};
};

// CP on `m` over every rank of `w`: module "attn" through sdpa_qkv, with the q/k/v handoffs as
// the async schedule's launch sites unless `handoffs` is false. Returns the resolved schedule.
inline std::string apply_cp(Direct& m, comm::World& w, const ContextParallelConfig& cfg,
                            bool handoffs = true, const CPApplyOptions& o = quiet()) {
  comm::DeviceMesh mesh(w, {{"cp", w.size()}});
  auto topo = CPTopology::build(w, mesh.group_ptr({"cp"}), cfg);
  CPModuleSpec spec;
  spec.module_path = "attn";
  spec.inner_wrapper = "sdpa_qkv";
  if (m.bshd) {
    spec.cp_seq_dim = 1;
    spec.cp_head_dim = 2;
  }
  if (handoffs) spec.cp_handoff_targets = {{"q", "hq"}, {"k", "hk"}, {"v", "hv"}};
  apply_context_parallel(m.core.host(), spec, cfg, topo, o);
  return spec.resolved_schedule;
}

}  // namespace hp::cp::testing
