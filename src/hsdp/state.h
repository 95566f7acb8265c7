// FullyShard's private state, shared by the forward side (fully_shard.cpp: gather, prefetch,
// reshard, autograd hooks) and the gradient side (grad_pipeline.cpp: RS/AR pipeline, drain).
#pragma once

#include <chrono>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "hp/comm/comm_handle.h"
#include "hp/hsdp/fully_shard.h"
#include "sharded_param.h"

namespace hp::hsdp {

namespace detail {

// One fused all-gather of a unit's parameters of one dtype.
struct GatherBucket {
  std::vector<size_t> params;  // indices into Impl::params
  std::vector<int64_t> offsets;
  int64_t numel = 0;
  comm::CommHandle handle;
};

// One unit's gradients of one reduce dtype on their way through RS (shard group) and AR
// (replicate group). `reduced` is the flat shard ([numel]) once the RS finished.
struct GradBucket {
  size_t unit = 0;
  at::ScalarType dtype = at::kFloat;
  std::vector<size_t> params;
  std::vector<int64_t> offsets;
  int64_t numel = 0;
  std::vector<comm::CommHandle> rs;  // fusion: one; else one per parameter
  at::Tensor reduced;
  comm::CommHandle ar;
};

struct Unit {
  enum class State { kSharded, kGathering, kGathered };
  std::string name;
  std::vector<size_t> params;
  State state = State::kSharded;
  std::vector<GatherBucket> gathering;
  bool reshard_after_forward = true;
  bool armed = false;         // forward ran with grad mode: a backward is expected
  int64_t pending_grads = 0;  // AccumulateGrad hooks still to fire in this backward
  bool reduced = false;       // post-backward ran in this backward
};

}  // namespace detail

struct FullyShard::Impl {
  HsdpGroups groups;
  HsdpOptions options;
  int64_t sd = 1, r = 1, shard_rank = 0;
  std::vector<detail::ShardedParam> params;
  std::vector<detail::Unit> units;
  std::map<std::string, size_t> by_name;

  // Alive as long as the graph of the last grad-mode forward_root's output (its root node holds
  // it): expired with units still armed and no drain queued, that forward will never see a
  // backward (it threw, or its output was dropped).
  std::weak_ptr<void> root_graph;

  // Gradient pipeline.
  bool requires_all_reduce = true;
  bool drain_queued = false;
  std::vector<detail::GradBucket> rs_in_flight;  // unit N-1's, RS issued
  std::vector<detail::GradBucket> ar_in_flight;  // AR issued, not yet waited
  std::vector<detail::GradBucket> ready;         // reduced, to apply at the drain
  std::map<std::pair<size_t, at::ScalarType>, at::Tensor> partials;  // accumulation, no AR yet

  std::vector<std::string> events;
  HsdpStats stats;

  void record(const char* what, const std::string& unit);
  at::Tensor timed_wait(comm::CommHandle& h);

  // Forward side (fully_shard.cpp).
  void issue_gather(size_t u);
  void unshard(size_t u);
  void prefetch(size_t u);
  void reshard(size_t u);
  void arm(size_t u);
  // At a forward_root: disarms and reshards the units of an earlier forward that can no longer
  // be backpropagated (root_graph expired), waiting for a prefetch it left on the wire.
  void forget_abandoned_forward();
  void pre_backward(size_t u);
  void root_pre_backward();
  void queue_drain();
  void on_grad_ready(size_t u);

  // Gradient side (grad_pipeline.cpp).
  void post_backward(size_t u);
  void drain();
  std::vector<detail::GradBucket> issue_reduce_scatter(size_t u);
  void finish_reduce_scatter(detail::GradBucket& b);
  void after_reduce_scatter(detail::GradBucket b);
  void apply_ready();
};

}  // namespace hp::hsdp
