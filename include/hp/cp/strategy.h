// CP strategies: *what* is communicated around one attention call (DESIGN section 5.2).
// Adapters decide *how* attention is reached; any adapter works with any strategy.
//
//   prepared = strategy.prepare_qkv(q, k, v, ctx)     local shards -> what attention consumes
//   outs[i]  = attention(part.q, prepared.k, prepared.v, causal_metadata(part.state))
//              for each query part (one, or two under head-tail load balance)
//   out      = strategy.restore_output(outs, prepared, ctx)   -> local sequence shard
//
// Tensors are in the module's layout (ctx.layout: seq_dim / head_dim, any 4-d layout with the
// head dim size D last); every collective is differentiable (backward = inverse collective).
#pragma once

#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "hp/attention/masks.h"
#include "hp/comm/comm_handle.h"
#include "hp/comm/types.h"
#include "hp/cp/topology.h"

namespace hp::cp {

struct QKVLayout {
  int64_t seq_dim = 2;  // BNSD default
  int64_t head_dim = 1;
};

struct CPRuntimeContext {
  std::shared_ptr<const CPTopology> topology;
  QKVLayout layout;
  // Head-tail load balance (all_gather only): whether, and in which of the two forms.
  bool load_balance = false;
  LoadBalanceForm load_balance_form = LoadBalanceForm::kDataOrder;
};

// Per-call state a strategy hands from prepare_qkv to restore_output and the adapters.
struct CallState {
  attention::CausalMetadata causal;  // q_offset, q_len, kv_len of the post-strategy tensors
  int64_t head_offset = 0;           // global index of the first query head attention sees
  int64_t local_seq = 0;             // the caller's local sequence length
};

// One attention call of a prepared layer: a query block with its own causal state. Most
// strategies have one part; head-tail load balance has two (the head and the tail chunk).
struct QueryPart {
  at::Tensor q;
  CallState state;
};

struct PreparedQKV {
  at::Tensor k, v;
  std::vector<QueryPart> parts;
};

enum class QKVRole { kQ = 0, kK = 1, kV = 2 };
const char* role_name(QKVRole role);  // "q", "k", "v"

// A strategy is: the collective each of q/k/v goes through ("moving" it), then `finish`, which
// turns the moved tensors into the attention call(s). The sync schedule moves each role with
// a differentiable collective; the async schedule launches the same collective at the role's
// handoff point and waits for it at the attention call (backward: the inverse, launched by
// the wait and waited at the handoff).
class CPStrategy {
 public:
  virtual ~CPStrategy() = default;
  virtual std::string name() const = 0;
  // Collectives the strategy issues (checked against the backend at apply time).
  virtual std::vector<comm::OpKind> required_ops() const = 0;

  // Roles that go through a collective before attention (all_gather: k, v; ulysses and
  // hybrid: q, k, v), in the order they are moved.
  virtual std::vector<QKVRole> moved_roles() const = 0;
  virtual at::Tensor move(QKVRole role, const at::Tensor& x, const CPRuntimeContext& ctx) const = 0;
  virtual comm::CommHandle move_async(QKVRole role, const at::Tensor& x,
                                      const CPRuntimeContext& ctx) const = 0;
  // The inverse collective of a gradient of the moved tensor.
  virtual comm::CommHandle move_grad_async(QKVRole role, const at::Tensor& grad,
                                           const CPRuntimeContext& ctx) const = 0;
  // From the moved q/k/v (roles that are not moved are passed as given) to what attention
  // consumes. `q_local` is the caller's query shard.
  virtual PreparedQKV finish(const at::Tensor& q_local, const at::Tensor& q, const at::Tensor& k,
                             const at::Tensor& v, const CPRuntimeContext& ctx) const = 0;

  // Sync schedule: checks, moves every moved role, finishes.
  PreparedQKV prepare_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                          const CPRuntimeContext& ctx) const;
  // Checks that must pass before any collective of this call (sync or async).
  virtual void check_inputs(const at::Tensor& /*q*/, const CPRuntimeContext& /*ctx*/) const {}
  // `outs[i]` is the attention output of prepared.parts[i].
  virtual at::Tensor restore_output(const std::vector<at::Tensor>& outs,
                                    const PreparedQKV& prepared,
                                    const CPRuntimeContext& ctx) const = 0;
  virtual attention::CausalMetadata causal_metadata(const CallState& state) const {
    return state.causal;
  }
};

std::shared_ptr<const CPStrategy> make_all_gather_strategy();
std::shared_ptr<const CPStrategy> make_ulysses_strategy();
std::shared_ptr<const CPStrategy> make_hybrid_strategy();

// "all_gather", "ulysses", "hybrid" -> strategy; errors list the valid names.
std::shared_ptr<const CPStrategy> strategy_for(const std::string& name);
std::vector<std::string> strategy_names();

}  // namespace hp::cp
