// Planner and applier (DESIGN sections 1 and 9), production mode.
//
//   ShardingPlan plan = ShardingPlanner().plan(model_config, world_size, options, overrides);
//       every static check before any collective: mesh sizes multiply to the world size, heads
//       and sequence divisibility, CP config normalisation, Ulysses heads after TP
//   comm::DeviceMesh mesh(world, plan.mesh_dims, plan.mesh_options());
//   ShardingApplier().apply(model, plan, mesh);   installs CP on every attention module (and
//                                                 the linear CP mode on every linear one), then
//                                                 HSDP (plan.fully_shard) when R*Sd > 1; logs
#pragma once

#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "hp/attention/dsa.h"
#include "hp/attention/host.h"
#include "hp/attention/linear_host.h"
#include "hp/attention/mla.h"
#include "hp/comm/device_mesh.h"
#include "hp/cp/apply.h"
#include "hp/cp/config.h"
#include "hp/hsdp/fully_shard.h"
#include "hp/moe/moe.h"
#include "hp/plan/cost_model.h"
#include "hp/plan/layout.h"

namespace hp::plan {

struct ModuleShardingSpec;

// What the planner needs to know of a model (plan/ sits below model/: models implement this).
// The planner knows no model by name: every module, parameter, handoff point and attention slot
// it plans comes from here.

// A module whose attention CP is installed into.
struct AttentionSlotInfo {
  int64_t heads = 0;     // global query heads
  int64_t kv_heads = 0;  // global key/value heads
  int64_t head_dim = 0;  // per-head feature size of Q/K
  int64_t hidden = 0;    // the model width the Q/K/V/O projections map from and to
  attention::AttentionHost* host = nullptr;
  std::string adapter = "sdpa_hf";  // the CP adapter for how the module reaches attention
  // Role ("q", "k", "v") -> the handoff point emitting it (async schedule), e.g. q -> q_handoff.
  std::map<std::string, std::string> handoffs;
  int64_t seq_dim = 2;  // q/k/v layout at the attention call: BNSD by default
  int64_t heads_dim = 1;
};

// A linear-attention module (GDN, KDA) whose CP mode (cp/linear.h) is installed into.
struct LinearSlotInfo {
  attention::LinearLayerShape shape;
  attention::LinearHost* host = nullptr;
};

// An MLA module whose CP strategy (cp/mla.h) is installed into.
struct MLASlotInfo {
  attention::MLAShape shape;
  attention::MLAHost* host = nullptr;
  attention::DSAHost* dsa = nullptr;  // set for sparse (DSA) layers: cp/dsa.h is installed
};

// An MoE MLP module whose expert parallelism (moe/moe.h) is installed into.
struct MoESlotInfo {
  int64_t experts = 0;
  int64_t top_k = 0;
  moe::MoEImpl* host = nullptr;
};

struct ModuleInfo {
  std::string path;  // e.g. "layers.0.self_attn"
  // Every parameter the module holds directly or below it (relative names) -> the dim TP
  // splits it along, -1 when every TP rank holds it whole (tp::tp_shard_dims).
  std::map<std::string, int64_t> tp_shard_dims;
  std::optional<AttentionSlotInfo> attention;  // set for attention modules
  std::optional<LinearSlotInfo> linear;        // set for linear-attention modules
  std::optional<MLASlotInfo> mla;              // set for MLA modules
  std::optional<MoESlotInfo> moe;              // set for MoE MLP modules
};

class Plannable {
 public:
  virtual ~Plannable() = default;
  // Every module the plan covers (its boundaries are checked in validate mode), outer first.
  virtual std::vector<ModuleInfo> plan_modules() = 0;
  // Throws hp::Error when the model cannot be split over tp_size ranks.
  virtual void check_tp(int64_t tp_size) const = 0;
  // Validate mode: check boundaries with `checker` against `specs` (null: production).
  virtual void set_validation(BoundaryChecker* checker,
                              const std::map<std::string, ModuleShardingSpec>* specs) = 0;
  // HSDP: the model's units, root first (its parameters as this rank holds them after TP).
  virtual std::vector<hsdp::UnitSpec> fully_shard_units() = 0;
  // Route the forward through `fs` (null: plain forward). The model does not own it.
  virtual void set_fully_shard(hsdp::FullyShard* fs) = 0;
};

// The attention modules of plan_modules(), in order.
std::vector<ModuleInfo> attention_modules(Plannable& model);
// The linear-attention modules of plan_modules(), in order.
std::vector<ModuleInfo> linear_modules(Plannable& model);
// The MLA modules of plan_modules(), in order.
std::vector<ModuleInfo> mla_modules(Plannable& model);
// The MoE modules of plan_modules(), in order.
std::vector<ModuleInfo> moe_modules(Plannable& model);

// Linear-attention CP (cp/linear.h) for every linear module: mode state_passing | ulysses;
// state_exchange all_gather | p2p | auto (the cost model picks; needs a calibration).
struct LinearPlanOptions {
  std::string mode = "state_passing";
  std::string state_exchange = "all_gather";
};

// MLA CP (cp/mla.h) for every MLA module: latent_all_gather | ulysses | all_gather; the
// schedule and head-tail load balance come from the CP config.
struct MLAPlanOptions {
  std::string strategy = "latent_all_gather";
};

// Whether HSDP runs on a layout: on every layout of more than one rank. Parameters are
// replicated over dp_shard, dp_replicate and cp, and the q/k norms' gradients are per-rank
// partials under TP: without HSDP their gradients would stay each rank's partial sums.
inline bool hsdp_applies(int64_t dp_shard, int64_t dp_replicate, int64_t cp_size, int64_t tp_size) {
  return dp_shard * dp_replicate * cp_size * tp_size > 1;
}

struct PlanOptions {
  int64_t tp_size = 1;
  int64_t cp_size = 1;
  std::optional<cp::ContextParallelConfig> cp_config;  // cp_size > 1 and none: all_gather+sync
  int64_t dp_shard = 1;
  int64_t dp_replicate = 1;
  // Expert parallelism: the MoE experts split over ep ranks that are also dp_shard x cp ranks
  // (ep divides dp_shard x cp; consecutive ranks of that group form one EP group).
  int64_t ep_size = 1;
  int64_t seq_len = 0;  // global sequence length (0: not checked here)
  // HSDP runs on every layout of more than one rank (hsdp_applies), so every gradient is
  // reduced wherever its parameter is replicated: over (dp_shard, cp) by reduce-scatter, over
  // dp_replicate by all-reduce, TP-partial gradients over tp. The shard group is (dp_shard, cp).
  bool comm_fusion = false;
  bool reshard_after_forward = true;
  // kAvg divides the summed gradients by dp_replicate * dp_shard * cp: the gradient of the
  // global mean only when every rank's loss is a mean over the same number of counted tokens.
  // With ignored labels spread unevenly (packed documents, prompts, CP shards of one sequence),
  // divide each rank's loss sum by the global count and use kSum (as hp-train does).
  hsdp::ReduceOp reduce_op = hsdp::ReduceOp::kAvg;
  // --cp-algo auto: the cost model picks (algorithm, ulysses_degree, schedule) for cp_size > 1
  // (cp_config, if set, contributes load_balance only); needs a calibration.
  bool cp_auto = false;
  std::optional<Calibration> calibration;
  int64_t batch = 1;  // sequences per rank (auto's workload)
  LinearPlanOptions linear;
  MLAPlanOptions mla;
};

// What a module gets (DESIGN section 9); CP fields as in cp::CPModuleSpec.
struct ModuleShardingSpec {
  std::string path;
  // Parameter (relative name) -> its placement over tp: "Shard(0)", "Shard(1)", "Replicate".
  std::map<std::string, std::string> param_placements;
  Layout in_layout, out_layout;  // boundary layouts (validate mode checks them)
  cp::CPModuleSpec cp;           // attention modules only
  bool is_attention = false;
  bool is_linear = false;  // linear-attention modules: ShardingPlan::linear applies
  bool is_mla = false;     // MLA modules: ShardingPlan::mla applies
  bool is_dsa = false;     // DSA modules (sparse MLA): the all-gather family
};

struct ShardingPlan {
  std::vector<comm::MeshDim> mesh_dims;                // (dp_replicate, dp_shard, cp, tp)
  std::optional<cp::ContextParallelConfig> cp_config;  // normalised; nullopt when cp_size == 1
  std::map<std::string, ModuleShardingSpec> modules;
  int64_t tp_size = 1, cp_size = 1;
  int64_t dp_shard = 1, dp_replicate = 1;
  int64_t ep_size = 1;
  hsdp::HsdpOptions hsdp_options;  // used when hsdp()
  int64_t seq_len = 0;
  Mode mode = Mode::kProduction;
  LinearPlanOptions linear;      // resolved (no "auto") when the model has linear modules
  MLAPlanOptions mla;            // checked when the model has MLA modules
  std::vector<std::string> log;  // planner decisions (auto's prediction for every candidate)
  std::unique_ptr<BoundaryChecker> checker;       // validate mode, set by the applier
  std::shared_ptr<hsdp::FullyShard> fully_shard;  // HSDP, set by the applier
  // Set by the applier when ep_size > 1: every expert parameter (full name -> this rank's
  // experts, dim 0), which HSDP leaves alone, and the group whose ranks hold the same experts
  // (their gradients are summed over it).
  std::vector<std::pair<std::string, at::Tensor>> expert_params;
  comm::GroupPtr expert_replicas;
  comm::GroupPtr ep_group;  // this rank's EP group (its members hold every expert together)
  bool hsdp() const { return hsdp_applies(dp_shard, dp_replicate, cp_size, tp_size); }
  // The groups the applier needs besides one per dim: HSDP's shard group (dp_shard, cp); with
  // MoE layers the token group (dp_replicate, dp_shard, cp), and with EP the EP groups and the
  // expert replica groups.
  comm::MeshOptions mesh_options() const;
  bool has_moe = false;
  // Whether `fqn` is an expert parameter split by EP (dim 0: rank r holds experts
  // [r E/ep, (r+1) E/ep)).
  bool is_expert_param(const std::string& fqn) const;
  // The layout of activations between modules: sequence sharded over cp, replicated over tp.
  Layout activation_layout() const;
  // The dim TP splits parameter `fqn` (e.g. "layers.0.mlp.down_proj.weight") along, from the
  // placements; nullopt when it is replicated over TP (or tp_size == 1) or not planned.
  std::optional<int64_t> tp_shard_dim(const std::string& fqn) const;
  std::string describe() const;
};

class ShardingPlanner {
 public:
  // `overrides` (per module path) replace the planned spec's CP fields where set.
  ShardingPlan plan(Plannable& model, int64_t world_size, const PlanOptions& options,
                    const std::map<std::string, cp::CPModuleSpec>& overrides = {}) const;
};

class ShardingApplier {
 public:
  // Installs CP into every attention module of `model` (built with the mesh's TP group), then
  // HSDP over (dp_replicate, (dp_shard, cp)) when plan.hsdp() (every layout of more than one
  // rank; a model whose fully_shard_units() is empty runs CP and TP without it and reduces its
  // own gradients, and cannot run data parallelism); the mesh must have been built with
  // plan.mesh_options().
  // Returns the apply log lines (also printed by the caller if it wants).
  std::vector<std::string> apply(Plannable& model, ShardingPlan& plan, const comm::DeviceMesh& mesh,
                                 Mode mode = Mode::kProduction) const;
};

}  // namespace hp::plan
