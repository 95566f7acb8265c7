// Data movement (DispatchPlan in dispatch.h):
//   counts  [E] per rank --all_to_all(split E into P)--> [P, E/P]: source s's rows per local
//           expert
//   rows    [N, H] --all_to_all_v(send_rows, recv_rows)--> [sum recv, H] source-major
//           --index_select(expert_major)--> expert-major (experts run here)
//   back    --index_select(source_major)--> source-major --all_to_all_v(recv, send)--> [N, H]
#include "hp/moe/dispatch.h"

#include <ATen/ATen.h>

#include "hp/comm/autograd_collectives.h"
#include "hp/comm/collectives.h"
#include "hp/common/check.h"

namespace hp::moe {

DispatchPlan plan_dispatch(const std::vector<int64_t>& rows_per_expert, comm::Group& ep) {
  const int64_t p = ep.size(), e = static_cast<int64_t>(rows_per_expert.size());
  HP_CHECK(e % p == 0, "expert parallelism: ", e, " experts over ep=", p,
           " ranks; the number of experts must be divisible by ep");
  const int64_t local = e / p;
  DispatchPlan plan;
  plan.send_rows.assign(p, 0);
  for (int64_t i = 0; i < e; ++i)
    plan.send_rows[i / local] += rows_per_expert[i];
  // got[s * local + j]: rows source s sends to my local expert j.
  auto got = comm::all_to_all(ep, at::tensor(rows_per_expert, at::kLong), 0, 0).contiguous();
  const int64_t* g = got.data_ptr<int64_t>();
  plan.recv_rows.assign(p, 0);
  plan.rows_per_expert.assign(local, 0);
  std::vector<int64_t> start(p * local);  // where (s, j) begins in the source-major rows
  int64_t offset = 0;
  for (int64_t s = 0; s < p; ++s) {
    for (int64_t j = 0; j < local; ++j) {
      start[s * local + j] = offset;
      offset += g[s * local + j];
      plan.recv_rows[s] += g[s * local + j];
      plan.rows_per_expert[j] += g[s * local + j];
    }
  }
  std::vector<int64_t> order;
  order.reserve(offset);
  for (int64_t j = 0; j < local; ++j) {
    for (int64_t s = 0; s < p; ++s) {
      for (int64_t k = 0; k < g[s * local + j]; ++k)
        order.push_back(start[s * local + j] + k);
    }
  }
  plan.expert_major = at::tensor(order, at::kLong);
  plan.source_major = at::empty_like(plan.expert_major);
  if (offset > 0) {
    plan.source_major.index_put_({plan.expert_major}, at::arange(offset, at::kLong));
  }
  return plan;
}

at::Tensor dispatch(const at::Tensor& rows, const DispatchPlan& plan, const comm::GroupPtr& ep) {
  auto arrived = comm::all_to_all_v_autograd(rows, plan.send_rows, plan.recv_rows, ep);
  return arrived.index_select(0, plan.expert_major.to(rows.device()));
}

at::Tensor combine(const at::Tensor& rows, const DispatchPlan& plan, const comm::GroupPtr& ep) {
  auto source_major = rows.index_select(0, plan.source_major.to(rows.device()));
  return comm::all_to_all_v_autograd(source_major, plan.recv_rows, plan.send_rows, ep);
}

}  // namespace hp::moe
