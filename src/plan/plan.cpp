#include "hp/plan/plan.h"

#include <algorithm>
#include <cstdio>

#include "hp/attention/host.h"
#include "hp/common/check.h"
#include "hp/cp/dsa.h"
#include "hp/cp/linear.h"
#include "hp/cp/mla.h"
#include "hp/cp/topology.h"

namespace hp::plan {

Layout ShardingPlan::activation_layout() const {
  return Layout{{{"cp", cp_size > 1 ? Placement::shard(1) : Placement::replicate()},
                 {"tp", Placement::replicate()}}};
}

std::string ShardingPlan::describe() const {
  std::string out = "mesh (";
  for (size_t i = 0; i < mesh_dims.size(); ++i) {
    out += common::str_cat(i ? ", " : "", mesh_dims[i].name, "=", mesh_dims[i].size);
  }
  out += ")";
  const bool has_attention = std::any_of(modules.begin(), modules.end(),
                                         [](const auto& m) { return m.second.is_attention; });
  const bool has_linear =
      std::any_of(modules.begin(), modules.end(), [](const auto& m) { return m.second.is_linear; });
  if (cp_config && has_attention) out += " cp: " + cp::describe(*cp_config, cp_size);
  if (has_linear && cp_size > 1) {
    out += " linear: mode=" + linear.mode;
    if (linear.mode == "state_passing") out += " state_exchange=" + linear.state_exchange;
  }
  const bool has_mla = std::any_of(modules.begin(), modules.end(), [](const auto& m) {
    return m.second.is_mla && !m.second.is_dsa;
  });
  const bool has_dsa =
      std::any_of(modules.begin(), modules.end(), [](const auto& m) { return m.second.is_dsa; });
  if ((has_mla || has_dsa) && cp_config) {
    if (has_mla) out += " mla: strategy=" + mla.strategy;
    if (has_dsa) out += " dsa: strategy=all_gather";
    out += common::str_cat(" schedule=", cp::to_string(cp_config->schedule));
    if (cp_config->load_balance) out += " load_balance";
  }
  if (hsdp()) {
    out += common::str_cat(" hsdp: R=", dp_replicate, " x Sd=", dp_shard * cp_size,
                           " (dp_shard=", dp_shard, " x cp=", cp_size,
                           "), comm_fusion=", hsdp_options.comm_fusion ? "on" : "off");
  }
  if (ep_size > 1) out += common::str_cat(" ep=", ep_size);
  out += common::str_cat(" modules=", modules.size());
  return out;
}

std::optional<int64_t> ShardingPlan::tp_shard_dim(const std::string& fqn) const {
  for (const auto& [path, spec] : modules) {
    if (fqn.size() <= path.size() || fqn.compare(0, path.size(), path) != 0 ||
        fqn[path.size()] != '.') {
      continue;
    }
    auto it = spec.param_placements.find(fqn.substr(path.size() + 1));
    if (it == spec.param_placements.end()) continue;
    int64_t dim = -1;
    if (std::sscanf(it->second.c_str(), "Shard(%ld)", &dim) == 1) return dim;
    return std::nullopt;
  }
  return std::nullopt;
}

std::vector<ModuleInfo> attention_modules(Plannable& model) {
  std::vector<ModuleInfo> out;
  for (auto& m : model.plan_modules()) {
    if (m.attention) out.push_back(std::move(m));
  }
  return out;
}

std::vector<ModuleInfo> linear_modules(Plannable& model) {
  std::vector<ModuleInfo> out;
  for (auto& m : model.plan_modules()) {
    if (m.linear) out.push_back(std::move(m));
  }
  return out;
}

std::vector<ModuleInfo> mla_modules(Plannable& model) {
  std::vector<ModuleInfo> out;
  for (auto& m : model.plan_modules()) {
    if (m.mla) out.push_back(std::move(m));
  }
  return out;
}

std::vector<ModuleInfo> moe_modules(Plannable& model) {
  std::vector<ModuleInfo> out;
  for (auto& m : model.plan_modules()) {
    if (m.moe) out.push_back(std::move(m));
  }
  return out;
}

bool ShardingPlan::is_expert_param(const std::string& fqn) const {
  return std::any_of(expert_params.begin(), expert_params.end(),
                     [&](const auto& p) { return p.first == fqn; });
}

namespace {

// Expert parallelism for these MoE modules, checked before any collective.
void check_moe_plan(const std::vector<ModuleInfo>& moes, const PlanOptions& o) {
  HP_CHECK(o.ep_size >= 1, "plan: ep=", o.ep_size, " must be >= 1");
  if (o.ep_size == 1) return;
  HP_CHECK(!moes.empty(), "plan: ep=", o.ep_size,
           " but the model has no MoE layers; give it experts (--experts N, or --arch "
           "qwen3-moe) or drop --ep");
  const int64_t sc = o.dp_shard * o.cp_size;
  HP_CHECK(sc % o.ep_size == 0, "plan: ep=", o.ep_size, " must divide dp_shard x cp = ", o.dp_shard,
           " x ", o.cp_size, " = ", sc,
           " (expert parallelism borrows the data and context parallel ranks); choose an ep "
           "dividing ",
           sc, " or raise --dp-shard / --cp");
  for (const auto& info : moes) {
    const auto& m = *info.moe;
    HP_CHECK(m.top_k >= 1 && m.top_k <= m.experts, "plan: module '", info.path,
             "': top_k=", m.top_k, " must be between 1 and experts=", m.experts);
    HP_CHECK(m.experts % o.ep_size == 0, "plan: module '", info.path, "' has ", m.experts,
             " experts, not divisible by ep=", o.ep_size,
             "; choose an ep dividing the number of experts");
  }
}

// MLA CP for these modules on cp_size ranks, checked before any collective.
void check_mla_plan(const std::vector<ModuleInfo>& mlas, const PlanOptions& o,
                    const std::optional<cp::ContextParallelConfig>& config) {
  if (mlas.empty() || !config) return;
  HP_CHECK(!config->load_balance || config->load_balance_form == cp::LoadBalanceForm::kDataOrder,
           "plan: MLA CP balances head-tail shards in data order; set load_balance_form="
           "data_order (the default) or drop load_balance");
  for (const auto& info : mlas) {
    if (info.mla->dsa != nullptr) {
      HP_CHECK(o.mla.strategy == MLAPlanOptions{}.strategy, "plan: module '", info.path,
               "' is a DSA layer: its CP is the all-gather family (the index keys and the latent "
               "gathered); the MLA strategy '",
               o.mla.strategy, "' does not apply; drop it");
      const int64_t local = o.seq_len > 0 ? o.seq_len / o.cp_size : 2;
      HP_CHECK(!config->load_balance || local % 2 == 0, "plan: module '", info.path,
               "': head-tail load balance needs an even local sequence length, got ", local,
               "; pad the sequence to a multiple of 2 * cp = ", 2 * o.cp_size);
      continue;
    }
    cp::MLACPOptions m;
    m.strategy = o.mla.strategy;
    m.load_balance = config->load_balance;
    const int64_t local = o.seq_len > 0 ? o.seq_len / o.cp_size : 2;
    cp::check_mla_cp("MLA module '" + info.path + "'", m, info.mla->shape, local, o.cp_size);
  }
}

// The linear-attention CP options for these modules on cp_size ranks, checked (names the
// option, the value and the fix), with state_exchange=auto resolved by the cost model.
LinearPlanOptions plan_linear(const std::vector<ModuleInfo>& lins, const PlanOptions& o,
                              std::vector<std::string>& log) {
  LinearPlanOptions out = o.linear;
  // Names are checked at every size (a misspelt mode is a mistake at cp 1 too).
  HP_CHECK(out.mode == "state_passing" || out.mode == "ulysses", "plan: linear CP mode '", out.mode,
           "' is not valid; valid: state_passing, ulysses");
  HP_CHECK(out.state_exchange == "all_gather" || out.state_exchange == "p2p" ||
               out.state_exchange == "auto",
           "plan: state_exchange '", out.state_exchange,
           "' is not valid; valid: all_gather, p2p, auto");
  if (lins.empty() || o.cp_size == 1) return out;
  HP_CHECK(out.mode == "state_passing" || out.state_exchange == "all_gather",
           "plan: state_exchange '", out.state_exchange,
           "' chooses how linear CP mode state_passing folds its states; mode ulysses exchanges "
           "none, so drop it (or use mode state_passing)");
  for (const auto& info : lins) {
    const auto& s = info.linear->shape;
    if (out.mode == "ulysses") {
      HP_CHECK(s.heads % o.cp_size == 0 && s.value_heads % o.cp_size == 0, "plan: module '",
               info.path, "': linear CP mode ulysses needs its q/k heads (", s.heads,
               ") and value heads (", s.value_heads, ") divisible by cp=", o.cp_size,
               "; use mode state_passing or a cp size that divides ", s.heads);
    } else if (o.seq_len > 0) {
      const int64_t local = o.seq_len / o.cp_size;
      HP_CHECK(local >= s.conv_width - 1, "plan: module '", info.path, "': each rank's ", local,
               " tokens (seq_len ", o.seq_len, " / cp ", o.cp_size,
               ") are fewer than the conv halo of ", s.conv_width - 1,
               " rows state passing takes from the previous rank; use a longer sequence or a "
               "smaller cp");
    }
  }
  if (out.mode == "state_passing" && out.state_exchange == "auto") {
    HP_CHECK(o.calibration.has_value(),
             "plan: state_exchange auto needs a calibration of this machine and link; run "
             "`hp-bench calibrate [--link-rate RATE]` first, or choose all_gather or p2p");
    const auto& s = lins.front().linear->shape;
    StateExchangeWorkload w;
    w.batch = o.batch;
    w.value_heads = s.value_heads;
    w.key_dim = s.key_dim;
    w.value_dim = s.value_dim;
    w.layers = static_cast<int64_t>(lins.size());
    auto ranked = rank_state_exchanges(*o.calibration, o.cp_size, w);
    for (const auto& r : ranked)
      log.push_back("  " + describe(r));
    log.push_back("linear CP auto: chose state_exchange=" + ranked.front().name);
    out.state_exchange = ranked.front().name;
  }
  return out;
}

}  // namespace

comm::MeshOptions ShardingPlan::mesh_options() const {
  comm::MeshOptions o;
  if (hsdp()) o.flattened.push_back({"dp_shard", "cp"});
  if (has_moe) o.flattened.push_back({"dp_replicate", "dp_shard", "cp"});
  if (ep_size > 1) {
    // Coordinates (dp_replicate, dp_shard, cp, tp); sc = the rank's place in (dp_shard, cp).
    const int64_t cp = cp_size, tp = tp_size, ep = ep_size, blocks = dp_shard * cp_size / ep_size;
    o.partitions.push_back({"ep", [=](const std::vector<int64_t>& c) {
                              const int64_t sc = c[1] * cp + c[2];
                              return ((c[0] * blocks + sc / ep) * tp) + c[3];
                            }});
    o.partitions.push_back({"ep_replicas", [=](const std::vector<int64_t>& c) {
                              return ((c[1] * cp + c[2]) % ep) * tp + c[3];
                            }});
  }
  return o;
}

ShardingPlan ShardingPlanner::plan(Plannable& m, int64_t world_size, const PlanOptions& o,
                                   const std::map<std::string, cp::CPModuleSpec>& overrides) const {
  for (auto [name, v] : {std::pair<const char*, int64_t>{"tp_size", o.tp_size},
                         {"cp_size", o.cp_size},
                         {"dp_shard", o.dp_shard},
                         {"dp_replicate", o.dp_replicate}}) {
    HP_CHECK(v >= 1, "plan: ", name, "=", v, " must be >= 1");
  }
  const int64_t product = o.dp_replicate * o.dp_shard * o.cp_size * o.tp_size;
  HP_CHECK(product == world_size, "plan: dp_replicate=", o.dp_replicate, " x dp_shard=", o.dp_shard,
           " x cp=", o.cp_size, " x tp=", o.tp_size, " = ", product, " but the world has ",
           world_size, " ranks; choose sizes whose product is ", world_size);
  m.check_tp(o.tp_size);
  const auto infos = m.plan_modules();
  const auto attns = attention_modules(m);
  const auto lins = linear_modules(m);
  ShardingPlan p;
  p.tp_size = o.tp_size;
  p.cp_size = o.cp_size;
  p.dp_shard = o.dp_shard;
  p.dp_replicate = o.dp_replicate;
  p.ep_size = o.ep_size;
  p.hsdp_options.comm_fusion = o.comm_fusion;
  p.hsdp_options.reshard_after_forward = o.reshard_after_forward;
  p.hsdp_options.reduce_op = o.reduce_op;
  p.mesh_dims = {{"dp_replicate", o.dp_replicate},
                 {"dp_shard", o.dp_shard},
                 {"cp", o.cp_size},
                 {"tp", o.tp_size}};
  if (o.cp_auto && o.cp_size > 1) {
    HP_CHECK(o.calibration.has_value(),
             "plan: --cp-algo auto needs a calibration of this machine and link; run "
             "`hp-bench calibrate [--link-rate RATE]` first");
    HP_CHECK(!attns.empty(), "plan: --cp-algo auto: the model has no attention modules");
    HP_CHECK(o.seq_len > 0, "plan: --cp-algo auto needs the sequence length (seq_len)");
    const auto& a = *attns.front().attention;
    CPWorkload w;
    w.seq = o.seq_len;
    w.heads = a.heads / o.tp_size;
    w.kv_heads = a.kv_heads / o.tp_size;
    w.head_dim = a.head_dim;
    w.hidden = a.hidden;
    w.batch = o.batch;
    w.load_balance = o.cp_config && o.cp_config->load_balance;
    if (o.cp_config) w.kv_head_policy = o.cp_config->kv_head_policy;
    w.ranks_on_node = static_cast<int>(world_size);
    w.ring_recomputes = a.host != nullptr && !a.host->primitive_stats_backward();
    auto ranked = rank_cp_configs(*o.calibration, o.cp_size, w);
    p.log.push_back(common::str_cat("cp auto: link ", o.calibration->link, ", ", ranked.size(),
                                    " legal choices for cp=", o.cp_size, " S=", o.seq_len));
    for (const auto& r : ranked)
      p.log.push_back("  " + describe(r));
    p.log.push_back("cp auto: chose " + ranked.front().name);
    p.cp_config = ranked.front().config;
  } else {
    p.cp_config = cp::normalize(o.cp_config, o.cp_size);
  }
  if (p.cp_config && o.seq_len > 0) cp::check_sequence(*p.cp_config, o.cp_size, o.seq_len);
  p.seq_len = o.seq_len;
  HP_CHECK(lins.empty() || !p.cp_config || !p.cp_config->load_balance,
           "plan: head-tail load balance reorders the sequence over the CP ranks, but the "
           "linear-attention layers (",
           lins.front().path,
           " and the others) carry their state along contiguous shards; drop --load-balance "
           "for a model with linear layers");
  p.linear = plan_linear(lins, o, p.log);
  check_mla_plan(mla_modules(m), o, p.cp_config);
  p.mla = o.mla;
  const auto moes = moe_modules(m);
  check_moe_plan(moes, o);
  p.has_moe = !moes.empty();
  const Layout act = p.activation_layout();
  for (const auto& info : infos) {
    ModuleShardingSpec spec;
    spec.path = info.path;
    spec.in_layout = spec.out_layout = act;
    for (const auto& [name, dim] : info.tp_shard_dims) {
      spec.param_placements[name] =
          o.tp_size > 1 && dim >= 0 ? common::str_cat("Shard(", dim, ")") : "Replicate";
    }
    if (info.attention) {
      const auto& a = *info.attention;
      if (p.cp_config) {
        cp::check_heads(*p.cp_config, o.cp_size, a.heads / o.tp_size, a.kv_heads / o.tp_size,
                        o.tp_size);
      }
      spec.is_attention = true;
      spec.cp.module_path = info.path;
      spec.cp.inner_wrapper = a.adapter;
      spec.cp.cp_seq_dim = a.seq_dim;
      spec.cp.cp_head_dim = a.heads_dim;
      spec.cp.cp_handoff_targets = a.handoffs;
      if (auto it = overrides.find(info.path); it != overrides.end()) {
        spec.cp = it->second;
        spec.cp.module_path = info.path;
      }
    }
    spec.is_linear = info.linear.has_value();
    spec.is_mla = info.mla.has_value();
    spec.is_dsa = info.mla.has_value() && info.mla->dsa != nullptr;
    HP_CHECK(p.modules.emplace(info.path, std::move(spec)).second,
             "plan: the model reports module '", info.path,
             "' twice; every module path must be unique");
  }
  return p;
}

namespace {

// Every MoE module counts its load over the ranks holding different tokens; with ep > 1 it
// keeps its EP rank's experts and dispatches over its EP group (before HSDP, which then leaves
// the experts alone).
void apply_expert_parallel(Plannable& model, ShardingPlan& plan, const comm::DeviceMesh& mesh,
                           std::vector<std::string>& lines) {
  plan.expert_params.clear();
  plan.expert_replicas.reset();
  plan.ep_group.reset();
  const auto moes = moe_modules(model);
  if (moes.empty()) return;
  auto tokens = mesh.group_ptr({"dp_replicate", "dp_shard", "cp"});
  if (tokens->size() == 1) tokens = nullptr;
  for (const auto& info : moes) {
    auto* m = info.moe->host;
    if (plan.ep_size == 1) {
      m->set_stats_group(tokens);
      continue;
    }
    m->set_expert_parallel(mesh.partition_group("ep"), tokens);
    for (const auto& [name, t] : m->named_expert_parameters())
      plan.expert_params.emplace_back(info.path + "." + name, t);
  }
  if (plan.ep_size > 1) {
    plan.expert_replicas = mesh.partition_group("ep_replicas");
    plan.ep_group = mesh.partition_group("ep");
    const auto& first = *moes.front().moe->host;
    lines.push_back(common::str_cat(
        "expert parallel: ep=", plan.ep_size, ", ", moes.size(), " MoE layers, experts ",
        first.first_expert(), "..", first.first_expert() + first.local_experts() - 1, " of ",
        moes.front().moe->experts,
        " on this rank; gradients "
        "summed over ",
        plan.expert_replicas->size(), " ranks holding the same experts"));
  }
}

}  // namespace

std::vector<std::string> ShardingApplier::apply(Plannable& model, ShardingPlan& plan,
                                                const comm::DeviceMesh& mesh, Mode mode) const {
  std::vector<std::string> lines;
  // The mesh the plan was made for: every group below comes from it (a mesh of the same world
  // size but other dims would install CP over a group the planner never checked).
  for (const auto& d : plan.mesh_dims) {
    const bool has = mesh.has_dim(d.name);
    HP_CHECK(has && mesh.size(d.name) == d.size, "apply: the plan was made for ", d.name, "=",
             d.size, ", but the mesh has ",
             has ? common::str_cat(d.name, "=", mesh.size(d.name)) : "no dim '" + d.name + "'",
             "; build the mesh from the plan: DeviceMesh(world, plan.mesh_dims, "
             "plan.mesh_options())");
  }
  plan.mode = mode;
  if (mode == Mode::kValidate) {
    HP_CHECK(plan.seq_len > 0,
             "apply: validate mode needs the plan's seq_len (PlanOptions::seq_len)");
    plan.checker = std::make_unique<BoundaryChecker>(
        std::map<std::string, int64_t>{{"cp", plan.cp_size}, {"tp", plan.tp_size}},
        std::map<int64_t, int64_t>{{1, plan.seq_len}});
    model.set_validation(plan.checker.get(), &plan.modules);
  } else {
    model.set_validation(nullptr, nullptr);
  }
  if (plan.cp_config) {
    auto topo = cp::CPTopology::build(mesh.world(), mesh.group_ptr({"cp"}), *plan.cp_config);
    for (const auto& info : attention_modules(model)) {
      auto it = plan.modules.find(info.path);
      HP_CHECK(it != plan.modules.end(), "apply: module '", info.path,
               "' is not in the plan; plan and apply the same model");
      cp::CPApplyOptions o;
      o.log = [&](const std::string& l) { lines.push_back(l); };
      cp::apply_context_parallel(*info.attention->host, it->second.cp, *plan.cp_config, topo, o);
    }
    for (const auto& info : linear_modules(model)) {
      HP_CHECK(plan.modules.count(info.path) == 1, "apply: module '", info.path,
               "' is not in the plan; plan and apply the same model");
      cp::LinearCPOptions o;
      o.module_path = info.path;
      o.mode = plan.linear.mode;
      o.state_exchange = plan.linear.state_exchange;
      o.schedule = plan.cp_config->schedule;
      lines.push_back(cp::apply_linear_cp(*info.linear->host, info.linear->shape, o, topo));
    }
    for (const auto& info : mla_modules(model)) {
      HP_CHECK(plan.modules.count(info.path) == 1, "apply: module '", info.path,
               "' is not in the plan; plan and apply the same model");
      if (info.mla->dsa != nullptr) {
        cp::DSACPOptions d;
        d.schedule = plan.cp_config->schedule;
        d.load_balance = plan.cp_config->load_balance;
        lines.push_back(cp::apply_dsa_cp(*info.mla->dsa, info.path, d, topo));
        continue;
      }
      cp::MLACPOptions o;
      o.strategy = plan.mla.strategy;
      o.schedule = plan.cp_config->schedule;
      o.load_balance = plan.cp_config->load_balance;
      lines.push_back(cp::apply_mla_cp(*info.mla->host, info.mla->shape, info.path, o, topo));
    }
  }
  apply_expert_parallel(model, plan, mesh, lines);
  model.set_fully_shard(nullptr);
  plan.fully_shard.reset();
  if (plan.hsdp()) {
    auto units = model.fully_shard_units();
    if (units.empty() && plan.dp_shard * plan.dp_replicate == 1) {
      // A model that offers no units runs CP and TP without HSDP: the caller reduces its
      // gradients (data parallelism needs the units: FullyShard refuses below).
      lines.push_back(
          common::str_cat("fully_shard: none (the model reports no units): its "
                          "gradients are not reduced over cp=",
                          plan.cp_size, " x tp=", plan.tp_size));
      return lines;
    }
    hsdp::HsdpGroups groups{mesh.group_ptr({"dp_shard", "cp"}), mesh.group_ptr({"dp_replicate"}),
                            plan.tp_size > 1 ? mesh.group_ptr({"tp"}) : nullptr};
    plan.fully_shard =
        std::make_shared<hsdp::FullyShard>(std::move(units), std::move(groups), plan.hsdp_options);
    model.set_fully_shard(plan.fully_shard.get());
    lines.push_back("fully_shard: " + plan.fully_shard->describe());
  }
  return lines;
}

}  // namespace hp::plan
