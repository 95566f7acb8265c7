#include "hp/tp/parallel_linear.h"

#include <ATen/ATen.h>

#include "hp/comm/autograd_collectives.h"
#include "hp/common/check.h"

namespace hp::tp {
namespace {

// This TP rank's slice along `dim` of the seeded full [out, in] weight.
at::Tensor weight_shard(int64_t out, int64_t in, const LinearInit& init, int64_t dim,
                        const comm::GroupPtr& tp, const char* what) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(init.seed);
  auto full = at::randn({out, in}, gen, at::kFloat) * init.std;
  const int64_t local = tp_local(full.size(dim), tp, what);
  const int64_t r = tp ? tp->rank() : 0;
  return full.narrow(dim, r * local, local).clone();
}

}  // namespace

int64_t tp_local(int64_t n, const comm::GroupPtr& tp, const char* what) {
  const int64_t t = tp ? tp->size() : 1;
  HP_CHECK(n % t == 0, what, "=", n, " is not divisible by tp_size=", t,
           "; choose a tp_size that divides ", n);
  return n / t;
}

at::Tensor copy_to_tp(const at::Tensor& x, const comm::GroupPtr& group) {
  return group ? comm::all_reduce_backward(x, group) : x;
}

at::Tensor reduce_from_tp(const at::Tensor& x, const comm::GroupPtr& group) {
  return group ? comm::all_reduce_forward(x, group) : x;
}

ColumnParallelLinearImpl::ColumnParallelLinearImpl(int64_t in, int64_t out, comm::GroupPtr tp,
                                                   LinearInit init)
    : tp_(std::move(tp)) {
  weight = register_parameter(
      "weight", weight_shard(out, in, init, 0, tp_, "column-parallel output features"));
}

at::Tensor ColumnParallelLinearImpl::forward(const at::Tensor& x) {
  return at::matmul(copy_to_tp(x, tp_), weight.t());
}

RowParallelLinearImpl::RowParallelLinearImpl(int64_t in, int64_t out, comm::GroupPtr tp,
                                             LinearInit init)
    : tp_(std::move(tp)) {
  weight = register_parameter("weight",
                              weight_shard(out, in, init, 1, tp_, "row-parallel input features"));
}

at::Tensor RowParallelLinearImpl::forward(const at::Tensor& x) {
  return reduce_from_tp(at::matmul(x, weight.t()), tp_);
}

std::map<std::string, int64_t> tp_shard_dims(const torch::nn::Module& module) {
  std::map<std::string, int64_t> out;
  for (const auto& p : module.named_parameters())
    out[p.key()] = -1;
  auto dim_of = [](const torch::nn::Module* m) -> int64_t {
    if (dynamic_cast<const ColumnParallelLinearImpl*>(m) != nullptr) return 0;
    if (dynamic_cast<const RowParallelLinearImpl*>(m) != nullptr) return 1;
    return -1;
  };
  if (const int64_t d = dim_of(&module); d >= 0) out["weight"] = d;
  // Not include_self: the module need not be held by a shared_ptr.
  for (const auto& m : module.named_modules("", /*include_self=*/false)) {
    if (const int64_t d = dim_of(m.value().get()); d >= 0) out[m.key() + ".weight"] = d;
  }
  return out;
}

}  // namespace hp::tp
