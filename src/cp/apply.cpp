#include "hp/cp/apply.h"

#include <iostream>

#include "hp/common/check.h"
#include "hp/cp/adapter.h"
#include "hp/cp/runtime.h"
#include "hp/cp/strategy.h"

namespace hp::cp {
namespace {

std::string handoff_str(const std::map<std::string, std::string>& h) {
  std::string out = "{";
  for (const auto& [k, v] : h)
    out += common::str_cat(out.size() > 1 ? "," : "", k, ":", v);
  return out + "}";
}

void check_backend(const CPTopology& t, const CPStrategy& s, const StrategyRegistry& registry) {
  for (const auto& g : {t.cp, t.ulysses, t.co}) {
    if (!g || g->size() == 1) continue;
    for (auto op : s.required_ops()) {
      if (g->transport().supports(op)) continue;
      std::string usable;
      for (const auto& n : registry.names()) {
        bool ok = true;
        for (auto need : registry.get(n)->required_ops())
          ok = ok && g->transport().supports(need);
        if (ok) usable += common::str_cat(usable.empty() ? "" : ", ", n);
      }
      HP_CHECK(false, "CP strategy '", s.name(), "' needs ", comm::op_name(op), " on group '",
               g->name(), "', which backend '", g->transport().backend_name(),
               "' does not provide; choose a strategy whose collectives it has (",
               usable.empty() ? "none here" : usable, ")");
    }
  }
}

}  // namespace

void LegacyWrapperRegistry::add(const std::string& name, LegacyWrapperFn fn,
                                const AdapterRegistry* adapters) {
  const auto& a = adapters != nullptr ? *adapters : AdapterRegistry::builtin();
  HP_CHECK(!a.contains(name), "legacy CP wrapper name '", name,
           "' is taken by a built-in adapter; pick another name");
  HP_CHECK(static_cast<bool>(fn), "legacy CP wrapper '", name, "' has no function");
  wrappers_[name] = std::move(fn);
}

const LegacyWrapperFn* LegacyWrapperRegistry::find(const std::string& name) const {
  auto it = wrappers_.find(name);
  return it == wrappers_.end() ? nullptr : &it->second;
}

std::vector<std::string> LegacyWrapperRegistry::names() const {
  std::vector<std::string> out;
  for (const auto& [k, v] : wrappers_)
    out.push_back(k);
  return out;
}

std::string apply_context_parallel(attention::AttentionHost& host, CPModuleSpec& spec,
                                   const ContextParallelConfig& config,
                                   const std::shared_ptr<const CPTopology>& topology,
                                   const CPApplyOptions& options) {
  HP_CHECK(topology != nullptr, "apply_context_parallel('", spec.module_path,
           "'): no CP topology; build one with CPTopology::build at apply time");
  const auto& t = *topology;
  const auto& adapters =
      options.adapters != nullptr ? *options.adapters : AdapterRegistry::builtin();
  const auto& strategies =
      options.strategies != nullptr ? *options.strategies : StrategyRegistry::builtin();
  const QKVLayout layout{spec.cp_seq_dim, spec.cp_head_dim};
  layout.check(common::str_cat("module '", spec.module_path, "'"));
  // normalize()'s checks, whether or not the caller ran it: e.g. load balance under a strategy
  // without it would leave head-tail shards masked in natural order (a wrong result).
  if (t.cp_size > 1) normalize(config, t.cp_size, &strategies);
  HP_CHECK(ulysses_degree_of(config, t.cp_size) == t.ulysses_degree, "module '", spec.module_path,
           "': the CP topology was built for ulysses_degree=", t.ulysses_degree,
           " but the config says ", ulysses_degree_of(config, t.cp_size));

  std::string adapter_name = spec.inner_wrapper;
  std::string fallback;  // set when async falls back to sync
  std::string schedule = to_string(config.schedule);
  std::string strategy_name = to_string(config.algorithm);
  if (!adapters.contains(spec.inner_wrapper)) {
    const LegacyWrapperFn* legacy =
        options.legacy ? options.legacy->find(spec.inner_wrapper) : nullptr;
    if (legacy == nullptr) {
      std::string valid = adapters.names_list();
      if (options.legacy) {
        for (const auto& n : options.legacy->names())
          valid += ", " + n;
      }
      HP_CHECK(false, "module '", spec.module_path, "': inner_wrapper '", spec.inner_wrapper,
               "' is neither a CP adapter nor a registered legacy wrapper; valid: ", valid);
    }
    HP_CHECK(config.algorithm == CPAlgorithm::kAllGather && config.schedule == CPSchedule::kSync &&
                 !config.load_balance,
             "module '", spec.module_path, "': legacy wrapper '", spec.inner_wrapper,
             "' implements only all_gather + sync, but the plan asks for algorithm=",
             to_string(config.algorithm), " schedule=", to_string(config.schedule),
             config.load_balance ? " load_balance=true" : "", "; use an adapter (",
             adapters.names_list(), ") or all_gather + sync");
    (*legacy)(host, t.cp);
    adapter_name = "legacy:" + spec.inner_wrapper;
  } else {
    auto adapter = adapters.get(adapter_name);
    auto strategy = strategies.get(strategy_name);
    check_backend(t, *strategy, strategies);
    // Async: every moved role needs a handoff point on this module.
    std::vector<std::pair<QKVRole, attention::HandoffPoint*>> points;
    if (config.schedule == CPSchedule::kAsync) {
      std::string missing;
      for (auto role : strategy->moved_roles()) {
        auto it = spec.cp_handoff_targets.find(role_name(role));
        auto* point = it == spec.cp_handoff_targets.end() ? nullptr : host.handoff(it->second);
        if (point == nullptr) {
          missing += common::str_cat(missing.empty() ? "" : ", ", role_name(role),
                                     it == spec.cp_handoff_targets.end()
                                         ? " (no cp_handoff_targets entry)"
                                         : " ('" + it->second + "' is not a handoff point here)");
        } else {
          points.emplace_back(role, point);
        }
      }
      if (!missing.empty()) {
        std::string known;
        for (const auto& n : host.handoff_names())
          known += (known.empty() ? "" : ", ") + n;
        HP_CHECK(config.async_fallback == AsyncFallback::kSync, "module '", spec.module_path,
                 "': schedule=async with strategy ", strategy_name,
                 " needs a handoff point for each of its moved tensors; missing: ", missing,
                 ". Handoff points on this module: ", known.empty() ? "none" : known,
                 ". Set cp_handoff_targets (e.g. {q: q_handoff, k: k_handoff, v: v_handoff}) or "
                 "async_fallback=sync to run synchronously");
        fallback = common::str_cat("sync(missing handoff: ", missing, ")");
        points.clear();
      }
    }
    const bool async = config.schedule == CPSchedule::kAsync && fallback.empty();
    auto runtime = std::make_shared<CPRuntime>(
        adapter, strategy, topology,
        CPRuntimeOptions{spec.module_path, layout, config.load_balance, config.load_balance_form,
                         async, config.kv_head_policy, config.ulysses_head_groups,
                         config.async_always_local_first, config.ring_keep_blocks,
                         config.ring_backward, config.ulysses_row_parts});
    host.install(adapter->slot(), runtime);
    auto* installed = static_cast<CPRuntime*>(host.installed(adapter->slot()));
    auto shared = std::static_pointer_cast<CPRuntime>(installed->shared_from_this());
    for (auto& [role, point] : points) {
      const std::string name = point->name();
      const QKVRole r = role;
      point->set_hook(shared->id(), [shared, r, name](const at::Tensor& x) {
        return shared->on_handoff(r, name, x);
      });
    }
    schedule = async ? "async" : "sync";
  }
  spec.resolved_inner_wrapper = adapter_name;
  spec.resolved_cp_strategy = strategy_name;
  spec.resolved_schedule = schedule;
  const std::string line = common::str_cat(
      "CP inner-wrap: module=", spec.module_path, " adapter=", adapter_name,
      " strategy=", strategy_name, " schedule=", schedule, " cp_size=", t.cp_size,
      " ulysses_degree=", t.ulysses_degree, " colossal_degree=", t.colossal_degree,
      config.load_balance ? common::str_cat(" load_balance=", to_string(config.load_balance_form))
                          : std::string(),
      config.kv_head_policy == KVHeadPolicy::kRepeat ? " kv_head_policy=repeat" : "",
      " handoff=", handoff_str(spec.cp_handoff_targets),
      " fallback=", fallback.empty() ? "none" : fallback);
  if (!fallback.empty()) {
    const std::string warning = common::str_cat("warning: module '", spec.module_path,
                                                "': schedule=async falls back to sync: ", fallback);
    if (options.log) {
      options.log(warning);
    } else {
      std::cerr << warning << std::endl;
    }
  }
  if (options.log) {
    options.log(line);
  } else {
    std::cerr << line << std::endl;
  }
  return line;
}

}  // namespace hp::cp
