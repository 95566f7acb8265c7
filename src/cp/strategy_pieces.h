// Internal to cp/: the two communication pieces every strategy is made of. Hybrid composes
// them over its sub-groups; all_gather and ulysses use one each over the whole CP group.
#pragma once

#include <ATen/core/Tensor.h>

#include "hp/comm/group.h"
#include "hp/cp/strategy.h"

namespace hp::cp::detail {

// K and V all-gathered along seq over `group` (rank order): [.., S/C, ..] -> [.., S, ..].
// Backward: reduce-scatter of dK, dV.
void gather_kv(at::Tensor& k, at::Tensor& v, const comm::GroupPtr& group, const QKVLayout& l);
at::Tensor gather_seq(const at::Tensor& x, const comm::GroupPtr& group, const QKVLayout& l);
comm::CommHandle gather_seq_async(const at::Tensor& x, const comm::GroupPtr& group,
                                  const QKVLayout& l);
comm::CommHandle gather_seq_grad_async(const at::Tensor& g, const comm::GroupPtr& group,
                                       const QKVLayout& l);  // reduce-scatter

// seq -> head all-to-all over `group` of size U: [.., S_l, .., N, ..] -> [.., U*S_l, .., N/U, ..].
at::Tensor scatter_heads(const at::Tensor& x, const comm::GroupPtr& group, const QKVLayout& l);
// Inverse: [.., U*S_l, .., N/U, ..] -> [.., S_l, .., N, ..].
at::Tensor gather_heads(const at::Tensor& x, const comm::GroupPtr& group, const QKVLayout& l);
comm::CommHandle scatter_heads_async(const at::Tensor& x, const comm::GroupPtr& group,
                                     const QKVLayout& l);
comm::CommHandle scatter_heads_grad_async(const at::Tensor& g, const comm::GroupPtr& group,
                                          const QKVLayout& l);  // the inverse all-to-all

// The Ulysses way of moving q, k and v (seq -> head all-to-all in the Ulysses group): what the
// ulysses and hybrid strategies share (strategy_ulysses.cpp).
class UlyssesMoves : public CPStrategy {
 public:
  std::vector<QKVRole> moved_roles() const override;
  at::Tensor move(QKVRole role, const at::Tensor& x, const CPRuntimeContext& ctx) const override;
  comm::CommHandle move_async(QKVRole role, const at::Tensor& x,
                              const CPRuntimeContext& ctx) const override;
  comm::CommHandle move_grad_async(QKVRole role, const at::Tensor& grad,
                                   const CPRuntimeContext& ctx) const override;
  // The output's way back: head -> seq all-to-all in the Ulysses group.
  at::Tensor restore_output(const std::vector<at::Tensor>& outs, const PreparedQKV& prepared,
                            const CPRuntimeContext& ctx) const override;
};

// Head-tail load balance (load_balance.cpp): the two query parts of this rank with their
// global offsets (swapping the tail with the mirror rank in the runtime form), the inverse for
// the outputs, and the gathered K/V of data-order shards put back in natural order.
void check_head_tail(const at::Tensor& q, const CPRuntimeContext& ctx);  // before any collective
std::vector<QueryPart> head_tail_parts(const at::Tensor& q, const CPRuntimeContext& ctx,
                                       int64_t kv_len);
at::Tensor head_tail_restore(const std::vector<at::Tensor>& outs, const CPRuntimeContext& ctx);
at::Tensor natural_order(const at::Tensor& gathered, const CPRuntimeContext& ctx);

}  // namespace hp::cp::detail
