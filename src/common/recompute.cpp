#include "hp/common/recompute.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include "hp/common/capsule.h"
#include "hp/common/check.h"

namespace hp::common {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct CheckpointFn : torch::autograd::Function<CheckpointFn> {
  // at::TensorList, not a vector: that is what autograd recognises as tensor inputs.
  static variable_list forward(AutogradContext* ctx, at::TensorList inputs, BlockFn fn) {
    std::vector<at::Tensor> in(inputs.begin(), inputs.end());
    ctx->save_for_backward(in);
    ctx->saved_data["fn"] = common::to_capsule(fn);
    at::NoGradGuard no_grad;
    return fn(in);
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto fn = common::from_capsule<BlockFn>(ctx->saved_data["fn"]);
    auto saved = ctx->get_saved_variables();
    std::vector<at::Tensor> inputs;
    for (const auto& s : saved) {
      auto d = s.detach();
      if (s.requires_grad()) d.requires_grad_(true);
      inputs.push_back(d);
    }
    std::vector<at::Tensor> outputs;
    {
      at::AutoGradMode enable(true);
      outputs = fn(inputs);
    }
    HP_CHECK(outputs.size() == grads.size(), "checkpoint: the recompute returned ", outputs.size(),
             " tensors, the forward ", grads.size());
    std::vector<at::Tensor> outs, gs;
    for (size_t i = 0; i < outputs.size(); ++i) {
      if (outputs[i].requires_grad() && grads[i].defined()) {
        outs.push_back(outputs[i]);
        gs.push_back(grads[i]);
      }
    }
    if (!outs.empty()) torch::autograd::backward(outs, gs);
    variable_list result;
    for (auto& in : inputs)
      result.push_back(in.requires_grad() ? in.grad() : at::Tensor());
    result.push_back(at::Tensor());
    return result;
  }
};

}  // namespace

std::vector<at::Tensor> checkpoint(const BlockFn& fn, const std::vector<at::Tensor>& inputs) {
  HP_CHECK(static_cast<bool>(fn), "checkpoint: the block function is empty");
  return CheckpointFn::apply(at::TensorList(inputs), fn);
}

}  // namespace hp::common
