#include "hp/attention/linear_host.h"

#include "hp/common/check.h"

namespace hp::attention {

at::Tensor run_linear_stages(const at::Tensor& x, const LinearLayerStages& stages) {
  const auto shape = stages.shape();
  auto t = stages.project(x);
  auto conv = stages.convolve(t.qkv, at::Tensor(), at::Tensor());
  auto in = stages.mixer_inputs(conv, t.beta_logit, t.gate_in, 0, shape.heads);
  return stages.output(stages.mix(in, false).out, stages.project_out_gate(x));
}

void LinearHost::install(std::shared_ptr<LinearInterceptor> interceptor) {
  HP_CHECK(interceptor != nullptr, "LinearHost::install: interceptor is null");
  if (interceptor_) {
    HP_CHECK(interceptor_->id() == interceptor->id(),
             "a different CP mode is already installed on this linear-attention layer: "
             "installed '",
             interceptor_->id(), "', new '", interceptor->id(),
             "'. Apply context parallelism once per layer (re-applying the same plan is fine)");
    return;
  }
  interceptor_ = std::move(interceptor);
}

at::Tensor LinearHost::forward(const at::Tensor& x, const LinearLayerStages& stages) {
  return interceptor_ ? interceptor_->forward(x, stages) : run_linear_stages(x, stages);
}

}  // namespace hp::attention
