// CPRuntime: one attention module's context parallelism, installed into its AttentionHost.
// Composes an adapter (where the call is intercepted, how options are rewritten) with a
// strategy (what is communicated). Checks q/k/v before any collective.
#pragma once

#include <memory>
#include <optional>
#include <string>

#include "hp/attention/host.h"
#include "hp/cp/adapter.h"
#include "hp/cp/async.h"
#include "hp/cp/strategy.h"

namespace hp::cp {

struct CPRuntimeOptions {
  std::string module_path;  // for messages and the runtime id
  QKVLayout layout;
  bool load_balance = false;  // head-tail (all_gather only)
  LoadBalanceForm load_balance_form = LoadBalanceForm::kDataOrder;
  bool async = false;  // moved roles arrive through handoff slots
  KVHeadPolicy kv_head_policy = KVHeadPolicy::kError;
  int64_t ulysses_head_groups = 0;        // async ulysses, usp, all_gather (ContextParallelConfig)
  bool async_always_local_first = false;  // async all_gather, hybrid (ContextParallelConfig)
  bool ring_keep_blocks = false;          // ring, usp (ContextParallelConfig)
  RingBackward ring_backward = RingBackward::kAuto;  // ring, usp (ContextParallelConfig)
  int64_t ulysses_row_parts = 0;                     // async ulysses (ContextParallelConfig)
};

class CPRuntime final : public attention::AttentionInterceptor,
                        public std::enable_shared_from_this<CPRuntime> {
 public:
  CPRuntime(std::shared_ptr<const CPAdapter> adapter, std::shared_ptr<const CPStrategy> strategy,
            std::shared_ptr<const CPTopology> topology, CPRuntimeOptions options);

  std::string id() const override;
  attention::AttentionResult intercept(const at::Tensor& q, const at::Tensor& k,
                                       const at::Tensor& v,
                                       const attention::AttentionOptions& options,
                                       const attention::AttentionFn& inner) override;
  attention::AttentionResult intercept_with_stats(
      const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
      const attention::AttentionOptions& options, const attention::AttentionFn& inner,
      const attention::StatsBackwardFn& from_stats) override;
  void on_forward_begin() override;
  void on_forward_end() override;
  // Async schedule: options of the next call, before its projections; the first K/V handoff
  // then asks the strategy whether the call needs its moves at all (CPStrategy::skips_moves).
  void on_announce(const attention::AttentionOptions& options) override;

  // Async schedule: the hook body of the handoff point `handoff` for `role`.
  at::Tensor on_handoff(QKVRole role, const std::string& handoff, const at::Tensor& x);
  bool is_async() const { return async_; }
  const CPRuntimeState& state() const { return *state_; }

  const CPAdapter& adapter() const { return *adapter_; }
  const CPStrategy& strategy() const { return *strategy_; }
  const CPTopology& topology() const { return *ctx_.topology; }

 private:
  // Checks q/k/v before any collective and records the K/V head count (ctx_.kv_heads).
  void validate(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                const attention::AttentionOptions& options);
  // One call's options, before any collective reads them (the sync call, or the announced
  // options at the async schedule's first handoff; q_heads -1 where not yet known):
  //  - packed documents: the ids cover the global sequence (local_len x cp positions) for
  //    `batch` rows (the strategies' block skipping reads them, unchecked);
  //  - a tensor mask: rows are this rank's local_len queries, columns the global keys;
  //  - causal_meta: CP places the queries and keys itself, so only the neutral value passes;
  //  - the strategy's own checks (CPStrategy::check_options).
  void check_call_options(const attention::AttentionOptions& options, int64_t batch,
                          int64_t q_heads, int64_t local_len, const std::string& who) const;

  std::shared_ptr<const CPAdapter> adapter_;
  std::shared_ptr<const CPStrategy> strategy_;
  CPRuntimeContext ctx_;
  std::string module_path_;
  bool async_ = false;
  std::shared_ptr<CPRuntimeState> state_;
  int64_t calls_in_forward_ = 0;
  // The announced options of the next call, and (once a handoff has asked) whether its moves
  // are skipped; both cleared by the call.
  std::optional<attention::AttentionOptions> announced_;
  std::optional<bool> skip_moves_;
};

}  // namespace hp::cp
