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

// seq -> head all-to-all over `group` of size U: [.., S_l, .., N, ..] -> [.., U*S_l, .., N/U, ..].
at::Tensor scatter_heads(const at::Tensor& x, const comm::GroupPtr& group, const QKVLayout& l);
// Inverse: [.., U*S_l, .., N/U, ..] -> [.., S_l, .., N, ..].
at::Tensor gather_heads(const at::Tensor& x, const comm::GroupPtr& group, const QKVLayout& l);

}  // namespace hp::cp::detail
