// Linear attention, mode ulysses: the layer on P-th of its heads over the whole sequence.
//
//   x [B, S/P, hidden] --project--> qkv, beta, gate (local tokens, all heads), out_gate
//   pack per destination rank j: [conv channels of head group j | beta_j | gate_j]
//        [B, S/P, P, Cg] --A2A(split P, concat seq)--> [B, S, Cg]        (one all-to-all)
//   convolve (this group's conv channels, full sequence: no halo) -> delta rule (zero state)
//        o [B, S, HV/P, V] --A2A(split seq, concat heads)--> [B, S/P, HV, V] -> output (local z)
//   backward: the inverse all-to-alls (differentiable collectives).
#include <ATen/ATen.h>

#include "hp/comm/autograd_collectives.h"
#include "hp/common/check.h"
#include "hp/cp/linear.h"

namespace hp::cp::detail {
namespace {

class LinearUlysses final : public attention::LinearInterceptor {
 public:
  LinearUlysses(LinearCPOptions options, std::shared_ptr<const CPTopology> topology)
      : options_(std::move(options)), topology_(std::move(topology)) {}

  std::string id() const override {
    return "linear-cp:" + options_.module_path + ":ulysses:" + topology_->id();
  }

  at::Tensor forward(const at::Tensor& x, const attention::LinearLayerStages& stages) override {
    const auto shape = stages.shape();
    const auto& group = topology_->cp;
    const int64_t p = topology_->cp_size, r = topology_->cp_rank;
    const int64_t nh = shape.heads / p, nv = shape.value_heads / p, gw = shape.gate_width;
    auto t = stages.project(x);
    std::vector<at::Tensor> groups;
    int64_t conv_channels = 0;
    for (int64_t j = 0; j < p; ++j) {
      auto channels = stages.head_channels(j * nh, nh);
      conv_channels = channels.size(0);
      groups.push_back(at::cat({t.qkv.index_select(2, channels), t.beta_logit.narrow(2, j * nv, nv),
                                t.gate_in.narrow(2, j * nv * gw, nv * gw)},
                               2));
    }
    auto packed = at::stack(groups, 2);                                     // [B, S/P, P, Cg]
    auto mine = comm::ulysses_seq_to_head(packed, 1, 2, group).squeeze(2);  // [B, S, Cg]
    auto qkv = mine.narrow(2, 0, conv_channels);
    auto beta = mine.narrow(2, conv_channels, nv);
    auto gate = mine.narrow(2, conv_channels + nv, nv * gw);
    auto conv = stages.convolve(qkv, at::Tensor(), stages.head_channels(r * nh, nh));
    auto in = stages.mixer_inputs(conv, beta, gate, r * nh, nh);
    auto o = stages.mix(in, false).out;  // [B, S, nv, V]
    auto back = comm::ulysses_head_to_seq(o.flatten(2).unsqueeze(2), 1, 2, group);
    auto local = back.reshape({x.size(0), x.size(1), shape.value_heads, shape.value_dim});
    return stages.output(local, t.out_gate);
  }

 private:
  LinearCPOptions options_;
  std::shared_ptr<const CPTopology> topology_;
};

}  // namespace

std::shared_ptr<attention::LinearInterceptor> make_linear_ulysses(
    const LinearCPOptions& options, std::shared_ptr<const CPTopology> topology) {
  return std::make_shared<LinearUlysses>(options, std::move(topology));
}

}  // namespace hp::cp::detail
