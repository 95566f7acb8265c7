// One CP attention layer on this rank, with any adapter and strategy, for hp-cp-run and
// hp-bench cp: q, k, v shards in; output and q/k/v gradients out.
#pragma once

#include <memory>
#include <string>

#include <ATen/core/Tensor.h>

#include "hp/attention/core_attention.h"
#include "hp/comm/world.h"
#include "hp/cp/apply.h"
#include "hp/cp/config.h"

namespace hp::bench {

struct CPLayerOptions {
  cp::ContextParallelConfig config;  // normalised
  std::string adapter = "sdpa_qkv";  // sdpa_qkv | sdpa_hf | flex_qkv | flex_hf
  bool causal = false;
  bool bshd = false;  // layout of q/k/v: BSHD [B, S, N, D], else BNSD
  std::string primitive = "blockwise";
  // Packed documents: the ids of the whole global sequence [B|1, S] (attention::Documents), or
  // undefined.
  at::Tensor doc_ids;
  // run_block: a layer with Q/K/V/O projections around attention (what the async schedule
  // overlaps its collectives with). Sizes of the projections:
  bool projections = false;
  int64_t heads = 0, kv_heads = 0, head_dim = 0;
};

struct CPLayerResult {
  at::Tensor out, dq, dk, dv;  // this rank's shards, in the input layout
};

class CPAttentionLayer {
 public:
  // Collective over the world (builds the CP sub-groups).
  CPAttentionLayer(const comm::World& world, const comm::GroupPtr& cp_group,
                   const CPLayerOptions& options);
  ~CPAttentionLayer();

  // Forward, then backward with `dout` as the output gradient.
  CPLayerResult run(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                    const at::Tensor& dout);
  // Projections layer (options.projections): x [B, S_local, heads*head_dim]; returns dx.
  at::Tensor run_block(const at::Tensor& x, const at::Tensor& dy);
  const std::string& apply_log() const { return log_; }
  const cp::CPModuleSpec& spec() const { return spec_; }

 private:
  class Module;
  std::unique_ptr<Module> module_;
  cp::CPModuleSpec spec_;
  std::string log_;
};

}  // namespace hp::bench
