// The MoE MLP (Qwen3-MoE style): router -> top-k -> SwiGLU experts, plus an optional shared
// expert every token passes through, with expert parallelism (dispatch.h) when given an EP
// group.
//
//   x [.., H] -> rows [T, H] -> route (router.h) -> assignments kept by the capacity, sorted by
//   expert (stable: token, then slot order) -> experts (local, or dispatch -> local experts ->
//   combine) -> weighted sum back into each token (index_add) [+ shared expert] -> [.., H]
//
// Weights: the router [E, H], the experts stacked per kind (gate_proj, up_proj [E_l, F, H],
// down_proj [E_l, H, F]) where E_l = E / ep are this rank's experts, and the shared expert's
// three matrices. Every expert's weights come from its own seed (model seed, layer, expert), so
// an EP rank's slice equals the same experts of the single-process layer.
#pragma once

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>
#include <torch/nn/pimpl.h>

#include "hp/comm/group.h"
#include "hp/moe/router.h"

namespace hp::moe {

struct MoEConfig {
  int64_t hidden = 64;
  int64_t expert_ffn = 32;  // each expert's SwiGLU width
  int64_t shared_ffn = 0;   // the shared expert's width; 0: none
  RouterOptions router;     // experts, top_k, renormalize, capacity_factor
  double aux_loss_coef = 0.01;
  double z_loss_coef = 0;
  uint64_t seed = 1234;
};

// Positive sizes and a valid router; names the field and the fix.
void validate(const MoEConfig& c);
// Parameters of one layer with every expert (router, experts, shared expert).
int64_t parameter_count(const MoEConfig& c);

// What the last forward routed (this rank's tokens).
struct MoEStats {
  int64_t tokens = 0;
  int64_t dropped = 0;              // assignments dropped by the capacity
  std::vector<int64_t> per_expert;  // assignments per expert (before dropping), [E]
  double aux_loss = 0;              // this rank's share (the shares sum to the global value)
  double z_loss = 0;                // likewise
};

class MoEImpl : public torch::nn::Module {
 public:
  MoEImpl(const MoEConfig& c, int64_t layer);

  // Expert parallelism: keeps only this EP rank's E / ep experts (the others' weights are
  // freed) and dispatches over `ep`. `stats` spans every rank holding different tokens of one
  // step (the aux loss's load is counted over it; null: this rank alone). Call before the
  // optimizer is built; once.
  void set_expert_parallel(comm::GroupPtr ep, comm::GroupPtr stats);
  // Only the load group (no EP): the aux loss over every rank's tokens.
  void set_stats_group(comm::GroupPtr stats) { stats_ = std::move(stats); }

  at::Tensor forward(const at::Tensor& x);

  // aux_loss_coef * aux share + z_loss_coef * z share of the last forward: a scalar in the graph,
  // already normalised (add it to the objective as is; the shares of all ranks sum to the
  // loss over the global batch).
  const at::Tensor& loss() const { return loss_; }
  const MoEStats& stats() const { return stats_last_; }
  const MoEConfig& config() const { return config_; }
  int64_t first_expert() const { return first_expert_; }
  int64_t local_experts() const { return gate_proj.size(0); }
  int64_t ep_size() const { return ep_ ? ep_->size() : 1; }
  // The parameters that hold experts (dim 0 = this rank's experts), by their names in this
  // module: what EP splits.
  std::vector<std::pair<std::string, at::Tensor>> named_expert_parameters() const {
    return {{"gate_proj", gate_proj}, {"up_proj", up_proj}, {"down_proj", down_proj}};
  }

  at::Tensor router;                               // [E, H]
  at::Tensor gate_proj, up_proj, down_proj;        // [E_l, F, H], [E_l, F, H], [E_l, H, F]
  at::Tensor shared_gate, shared_up, shared_down;  // [Fs, H], [Fs, H], [H, Fs]; undefined: none

 private:
  // Expert-major rows [N, H] with `rows` rows per local expert -> their outputs [N, H].
  at::Tensor run_experts(const at::Tensor& x, const std::vector<int64_t>& rows) const;

  MoEConfig config_;
  comm::GroupPtr ep_, stats_;
  int64_t first_expert_ = 0;
  at::Tensor loss_;
  MoEStats stats_last_;
};
TORCH_MODULE(MoE);

}  // namespace hp::moe
