// Tensor parallelism (DESIGN section 7): column- and row-parallel linear layers over a TP
// group, Megatron-style.
//
//   ColumnParallelLinear  W [out, in] split on out:  x (replicated) -> copy_to_tp -> x W_r^T
//                         forward identity, backward all-reduce of dx over TP
//   RowParallelLinear     W [out, in] split on in:   x_r (sharded) -> x_r W_r^T -> reduce_from_tp
//                         forward all-reduce over TP, backward identity
// Weights are made from the *full* weight (seeded), then sliced by TP rank, so a TP model and
// its single-process twin start identical. With no TP group both are plain linear layers.
#pragma once

#include <cstdint>
#include <map>
#include <string>

#include <ATen/core/Tensor.h>
#include <torch/nn/module.h>

#include "hp/comm/group.h"

namespace hp::tp {

// Identity forward, all-reduce(sum) of the gradient over `group` backward.
at::Tensor copy_to_tp(const at::Tensor& x, const comm::GroupPtr& group);
// All-reduce(sum) over `group` forward, identity backward.
at::Tensor reduce_from_tp(const at::Tensor& x, const comm::GroupPtr& group);

struct LinearInit {
  uint64_t seed = 0;  // the full weight is randn(out, in, seed) * std
  double std = 0.02;
};

class ColumnParallelLinearImpl : public torch::nn::Module {
 public:
  ColumnParallelLinearImpl(int64_t in, int64_t out, comm::GroupPtr tp, LinearInit init);
  at::Tensor forward(const at::Tensor& x);
  at::Tensor weight;  // [out / T, in]

 private:
  comm::GroupPtr tp_;
};

class RowParallelLinearImpl : public torch::nn::Module {
 public:
  RowParallelLinearImpl(int64_t in, int64_t out, comm::GroupPtr tp, LinearInit init);
  at::Tensor forward(const at::Tensor& x);  // x [.., in / T]
  at::Tensor weight;                        // [out, in / T]

 private:
  comm::GroupPtr tp_;
};

// Every parameter of `module` (recursively, names as named_parameters gives them) -> the dim
// TP splits it along: 0 for a column-parallel weight, 1 for a row-parallel weight, -1 for a
// parameter every TP rank holds whole. What the planner's placements are made from.
std::map<std::string, int64_t> tp_shard_dims(const torch::nn::Module& module);

// Size of this rank's share of `n` over the TP group; n must divide by the group size.
int64_t tp_local(int64_t n, const comm::GroupPtr& tp, const char* what);

}  // namespace hp::tp
