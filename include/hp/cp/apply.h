// Installing CP into one attention module (the CP part of ShardingApplier::apply).
#pragma once

#include <array>
#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "hp/attention/host.h"
#include "hp/comm/group.h"
#include "hp/cp/config.h"
#include "hp/cp/topology.h"

namespace hp::cp {
class StrategyRegistry;  // strategy.h
class AdapterRegistry;   // adapter.h
}  // namespace hp::cp

namespace hp::cp {

// The CP fields of a module's sharding spec (DESIGN section 9).
struct CPModuleSpec {
  std::string module_path;                // e.g. "layers.0.self_attn"
  std::string inner_wrapper = "sdpa_hf";  // an adapter name or a legacy wrapper name
  int64_t cp_seq_dim = 2;
  int64_t cp_head_dim = 1;
  std::array<int64_t, 3> cp_qkv_indices{0, 1, 2};
  std::map<std::string, std::string> cp_handoff_targets;  // "q" -> "q_norm", ... (async)
  // Set by apply: what really runs.
  std::string resolved_inner_wrapper;
  std::string resolved_cp_strategy;
  std::string resolved_schedule;  // "sync", "async", or "sync" after an async fallback
};

// Legacy full wrappers: fn(target, cp_group) takes over the module itself. Allowed only with
// all_gather + sync (they cannot follow any other strategy).
using LegacyWrapperFn =
    std::function<void(attention::AttentionHost& target, const comm::GroupPtr& cp_group)>;

class LegacyWrapperRegistry {
 public:
  // `name` must not be an adapter of `adapters` (null: AdapterRegistry::builtin()).
  void add(const std::string& name, LegacyWrapperFn fn, const AdapterRegistry* adapters = nullptr);
  const LegacyWrapperFn* find(const std::string& name) const;
  std::vector<std::string> names() const;

 private:
  std::map<std::string, LegacyWrapperFn> wrappers_;
};

struct CPApplyOptions {
  const LegacyWrapperRegistry* legacy = nullptr;
  const StrategyRegistry* strategies = nullptr;  // null: StrategyRegistry::builtin()
  const AdapterRegistry* adapters = nullptr;     // null: AdapterRegistry::builtin()
  std::function<void(const std::string&)> log;   // receives the apply log line; null: stderr
};

// Resolves adapter + strategy, runs the apply-time checks (layout, schedule, backend support),
// installs the runtime into `host` (idempotent for the same runtime, an error for a different
// one), fills spec.resolved_*, logs and returns the DESIGN section 5.8 line. `config` must be
// normalised (cp::normalize).
std::string apply_context_parallel(attention::AttentionHost& host, CPModuleSpec& spec,
                                   const ContextParallelConfig& config,
                                   const std::shared_ptr<const CPTopology>& topology,
                                   const CPApplyOptions& options = {});

}  // namespace hp::cp
