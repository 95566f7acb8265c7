// Expert-parallel dispatch and combine. EP rank r of P holds the experts
// [r E/P, (r+1) E/P). A rank's routed rows arrive sorted by expert (then by token and slot);
// dispatch sends each expert's rows to the rank holding it and regroups what arrives by local
// expert; combine is its exact inverse. Both are differentiable (their backward is the other
// direction's all-to-all of the gradient).
//
//   rank r, rows sorted by expert   [e0: a0 | e1: a1 | ... ]   (this rank's tokens)
//     all_to_all_counts: how many rows every source sends to each of my experts
//     all_to_all_v:      rows to the experts' owners   -> [src 0: e_l0, e_l1 | src 1: ...]
//     regroup:           expert-major                  -> [e_l0: src 0, src 1 | e_l1: ...]
//   experts run on contiguous rows; combine = regroup back + the reverse all_to_all_v.
//
// Within one expert the rows stay in (source rank, token, slot) order.
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

#include "hp/comm/group.h"

namespace hp::moe {

struct DispatchPlan {
  std::vector<int64_t> send_rows;        // per EP rank: rows this rank sends it
  std::vector<int64_t> recv_rows;        // per EP rank: rows it sends this rank
  std::vector<int64_t> rows_per_expert;  // per local expert, after regrouping
  at::Tensor expert_major;               // received row order -> expert-major (index_select)
  at::Tensor source_major;               // the inverse permutation
};

// Collective over `ep` (one all-to-all of E int64 counts). rows_per_expert: this rank's rows
// per global expert [E] (E divisible by the group size).
DispatchPlan plan_dispatch(const std::vector<int64_t>& rows_per_expert, comm::Group& ep);

// rows [N, H] sorted by expert -> the rows of this rank's experts, expert-major.
at::Tensor dispatch(const at::Tensor& rows, const DispatchPlan& plan, const comm::GroupPtr& ep);
// expert-major results -> [N, H] in the order `dispatch` took them.
at::Tensor combine(const at::Tensor& rows, const DispatchPlan& plan, const comm::GroupPtr& ep);

}  // namespace hp::moe
