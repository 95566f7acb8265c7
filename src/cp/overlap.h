// Internal to cp/: the async all_gather call that overlaps the K/V all-gather with attention.
#pragma once

#include <functional>

#include "hp/attention/host.h"
#include "hp/cp/adapter.h"
#include "hp/cp/strategy.h"

namespace hp::cp::detail {

using ConsumeFn = std::function<at::Tensor(QKVRole, const at::Tensor&)>;

// Whether the overlapped call applies: all_gather or ulysses, data-order (or no) load balance, no
// mask tensor or mask function (their frames start at key 0), BNSD or BSHD.
bool can_overlap(const CPStrategy& strategy, const CPRuntimeContext& ctx,
                 const attention::AttentionOptions& options);

// Attention of the local queries against this rank's own K/V chunks first (while the
// all-gathers are in flight), then `consume` waits for the gathered K/V and the remote key
// ranges follow; the partial results merge by their log-sum-exp (differentiable).
at::Tensor overlapped_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const attention::AttentionOptions& options,
                                const attention::AttentionFn& inner, const CPAdapter& adapter,
                                const CPStrategy& strategy, const CPRuntimeContext& ctx,
                                const ConsumeFn& consume);

// Ulysses: the own head group's diagonal block first (local), then the rest once Q, K, V
// arrive; the output all-to-all as in the sync schedule.
at::Tensor overlapped_ulysses(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const attention::AttentionOptions& options,
                              const attention::AttentionFn& inner, const CPAdapter& adapter,
                              const CPStrategy& strategy, const CPRuntimeContext& ctx,
                              const ConsumeFn& consume);

}  // namespace hp::cp::detail
