#include "hp/tp/parallel_linear.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include "hp/comm/collectives.h"
#include "hp/common/check.h"

namespace hp::tp {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct GroupBox : torch::CustomClassHolder {
  explicit GroupBox(comm::GroupPtr g) : group(std::move(g)) {}
  comm::GroupPtr group;
};

comm::Group& group_of(AutogradContext* ctx) {
  auto h = ctx->saved_data["group"].toCapsule();
  return *static_cast<GroupBox*>(h.get())->group;
}

struct CopyToTp : torch::autograd::Function<CopyToTp> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x,
                            c10::intrusive_ptr<GroupBox> g) {
    ctx->saved_data["group"] = c10::IValue::make_capsule(g);
    return x.view_as(x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {comm::all_reduce(group_of(ctx), grads[0].contiguous()), at::Tensor()};
  }
};

struct ReduceFromTp : torch::autograd::Function<ReduceFromTp> {
  static at::Tensor forward(AutogradContext*, const at::Tensor& x, c10::intrusive_ptr<GroupBox> g) {
    return comm::all_reduce(*g->group, x.contiguous());
  }
  static variable_list backward(AutogradContext*, variable_list grads) {
    return {grads[0], at::Tensor()};
  }
};

at::Tensor full_weight(int64_t out, int64_t in, const LinearInit& init) {
  auto gen = at::make_generator<at::CPUGeneratorImpl>(init.seed);
  return at::randn({out, in}, gen, at::kFloat) * init.std;
}

}  // namespace

int64_t tp_local(int64_t n, const comm::GroupPtr& tp, const char* what) {
  const int64_t t = tp ? tp->size() : 1;
  HP_CHECK(n % t == 0, what, "=", n, " is not divisible by tp_size=", t,
           "; choose a tp_size that divides ", n);
  return n / t;
}

at::Tensor copy_to_tp(const at::Tensor& x, const comm::GroupPtr& group) {
  if (!group || group->size() == 1) return x;
  return CopyToTp::apply(x, c10::make_intrusive<GroupBox>(group));
}

at::Tensor reduce_from_tp(const at::Tensor& x, const comm::GroupPtr& group) {
  if (!group || group->size() == 1) return x;
  return ReduceFromTp::apply(x, c10::make_intrusive<GroupBox>(group));
}

ColumnParallelLinearImpl::ColumnParallelLinearImpl(int64_t in, int64_t out, comm::GroupPtr tp,
                                                   LinearInit init)
    : tp_(std::move(tp)) {
  const int64_t local = tp_local(out, tp_, "column-parallel output features");
  const int64_t r = tp_ ? tp_->rank() : 0;
  weight =
      register_parameter("weight", full_weight(out, in, init).narrow(0, r * local, local).clone());
}

at::Tensor ColumnParallelLinearImpl::forward(const at::Tensor& x) {
  return at::matmul(copy_to_tp(x, tp_), weight.t());
}

RowParallelLinearImpl::RowParallelLinearImpl(int64_t in, int64_t out, comm::GroupPtr tp,
                                             LinearInit init)
    : tp_(std::move(tp)) {
  const int64_t local = tp_local(in, tp_, "row-parallel input features");
  const int64_t r = tp_ ? tp_->rank() : 0;
  weight =
      register_parameter("weight", full_weight(out, in, init).narrow(1, r * local, local).clone());
}

at::Tensor RowParallelLinearImpl::forward(const at::Tensor& x) {
  return reduce_from_tp(at::matmul(x, weight.t()), tp_);
}

}  // namespace hp::tp
