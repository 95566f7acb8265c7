// Differentiable collectives (torch::autograd Functions). Each one's backward is the inverse
// collective of the gradient over the same group:
//
//   all_gather_autograd(x, dim)          fwd all_gather along dim     bwd reduce_scatter(sum)
//   reduce_scatter_autograd(x, dim)      fwd reduce_scatter(sum)      bwd all_gather
//   ulysses_seq_to_head(x, seq, head)    fwd all_to_all(split head, concat seq)
//                                        bwd ulysses_head_to_seq of the gradient
//   ulysses_head_to_seq(x, seq, head)    fwd all_to_all(split seq, concat head)
//                                        bwd ulysses_seq_to_head of the gradient
//   all_to_all_v_autograd(x, s, r)       fwd all_to_all_v(rows s out, r in)
//                                        bwd all_to_all_v(r out, s in) of the gradient
//   p2p_exchange(x, peer)                fwd send x to peer, receive peer's  bwd the same exchange
//   ring_shift(x, offset)                fwd shift by offset (to rank+offset) bwd shift by -offset
//   all_reduce_forward(x)                fwd all_reduce(sum)          bwd identity
//   all_reduce_backward(x)               fwd identity                 bwd all_reduce(sum)
//
// The group must outlive the autograd graph (groups live as long as their mesh/World).
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

#include "hp/comm/group.h"

namespace hp::comm {

at::Tensor all_gather_autograd(const at::Tensor& x, int64_t dim, const GroupPtr& group);
at::Tensor reduce_scatter_autograd(const at::Tensor& x, int64_t dim, const GroupPtr& group);

// [.., S/P (seq), .., N (head), ..] -> [.., S (seq), .., N/P (head), ..]
at::Tensor ulysses_seq_to_head(const at::Tensor& x, int64_t seq_dim, int64_t head_dim,
                               const GroupPtr& group);
// [.., S (seq), .., N/P (head), ..] -> [.., S/P (seq), .., N (head), ..]
at::Tensor ulysses_head_to_seq(const at::Tensor& x, int64_t seq_dim, int64_t head_dim,
                               const GroupPtr& group);

// Rows along dim 0 in variable splits (collectives.h all_to_all_v): expert-parallel dispatch
// and combine.
at::Tensor all_to_all_v_autograd(const at::Tensor& x, const std::vector<int64_t>& send_rows,
                                 const std::vector<int64_t>& recv_rows, const GroupPtr& group);

at::Tensor p2p_exchange(const at::Tensor& x, int peer, const GroupPtr& group);
at::Tensor ring_shift(const at::Tensor& x, int offset, const GroupPtr& group);

// The tensor-parallel pair (Megatron's g and f).
at::Tensor all_reduce_forward(const at::Tensor& x, const GroupPtr& group);
at::Tensor all_reduce_backward(const at::Tensor& x, const GroupPtr& group);

}  // namespace hp::comm
