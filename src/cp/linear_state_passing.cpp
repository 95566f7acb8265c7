// Linear attention, mode state_passing (the source's "state P2P"): every rank keeps its
// contiguous shard of the sequence and receives only states.
//
//   x [B, S/P, hidden] --project--> qkv [B, S/P, C], beta, gate, out_gate
//   conv halo: qkv's last w-1 rows --ring shift +1--> the next rank (rank 0: zeros)
//   convolve [halo | qkv] -> q, k, v, g, beta of the shard
//   summary of the shard: final = M h + S   (M [B, HV, K, K], S [B, HV, K, V])
//   initial state h_r = fold of the summaries of ranks < r:
//     all_gather  [S | M] [B, HV, K, V+K] all-gathered once; h = M_p h + S_p for p < r
//     p2p         P-1 ring steps of M h + S; rank r's h is exact after r of them
//   delta rule from h_r -> output
//   backward: every exchange is differentiable (all-gather <-> reduce-scatter, shift <-> the
//   opposite shift), so d(initial state) flows back to the ranks whose summaries made it.
#include <ATen/ATen.h>

#include "hp/comm/autograd_collectives.h"
#include "hp/common/check.h"
#include "hp/cp/linear.h"
#include "hp/cp/strategy.h"

namespace hp::cp::detail {
namespace {

// `x` on every rank but rank 0 of the group; zeros (still in the graph, gradient 0) on rank 0.
at::Tensor zero_on_first(const at::Tensor& x, int64_t rank) {
  auto keep = at::full({}, rank > 0, at::TensorOptions().dtype(at::kBool));
  return at::where(keep, x, at::zeros_like(x));
}

class LinearStatePassing final : public attention::LinearInterceptor {
 public:
  LinearStatePassing(LinearCPOptions options, std::shared_ptr<const CPTopology> topology)
      : options_(std::move(options)), topology_(std::move(topology)) {}

  std::string id() const override {
    return "linear-cp:" + options_.module_path + ":state_passing/" + options_.state_exchange + ":" +
           topology_->id();
  }

  at::Tensor forward(const at::Tensor& x, const attention::LinearLayerStages& stages) override {
    const auto shape = stages.shape();
    const auto& group = topology_->cp;
    const int64_t r = topology_->cp_rank, w = shape.conv_width;
    HP_CHECK(x.size(1) >= w - 1, "linear attention CP (state_passing) on module '",
             options_.module_path, "': the local shard has ", x.size(1),
             " tokens, fewer than the conv halo of ", w - 1,
             "; use fewer CP ranks or a longer sequence");
    auto t = stages.project(x);
    at::Tensor halo;
    if (w > 1) {
      auto tail = t.qkv.narrow(1, x.size(1) - (w - 1), w - 1).contiguous();
      halo = zero_on_first(comm::ring_shift(tail, 1, group), r);
    }
    auto conv = stages.convolve(t.qkv, halo, at::Tensor());
    auto in = stages.mixer_inputs(conv, t.beta_logit, t.gate_in, 0, shape.heads);
    at::Tensor m, s;
    stages.state_summary(in, m, s);
    in.initial_state = options_.state_exchange == "p2p" ? chain(m, s) : gather_and_fold(m, s);
    auto o = stages.mix(in, false).out;
    return stages.output(o, t.out_gate);
  }

 private:
  at::Tensor gather_and_fold(const at::Tensor& m, const at::Tensor& s) const {
    const int64_t r = topology_->cp_rank, v = s.size(-1);
    auto packed = at::cat({s, m}, -1).unsqueeze(0).contiguous();     // [1, B, HV, K, V+K]
    auto all = comm::all_gather_autograd(packed, 0, topology_->cp);  // [P, B, HV, K, V+K]
    auto h = at::zeros_like(s);
    for (int64_t p = 0; p < r; ++p) {
      auto mine = all.select(0, p);
      h = at::matmul(mine.narrow(-1, v, mine.size(-1) - v), h) + mine.narrow(-1, 0, v);
    }
    // Every rank's graph uses the gathered summaries (rank 0 folds none), so every rank runs
    // their reduce-scatter in backward.
    return anchored(h, {all});
  }

  at::Tensor chain(const at::Tensor& m, const at::Tensor& s) const {
    const int64_t p = topology_->cp_size, r = topology_->cp_rank;
    auto h = at::zeros_like(s);
    for (int64_t step = 1; step < p; ++step) {
      auto final_state = (at::matmul(m, h) + s).contiguous();
      h = zero_on_first(comm::ring_shift(final_state, 1, topology_->cp), r);
    }
    return h;
  }

  LinearCPOptions options_;
  std::shared_ptr<const CPTopology> topology_;
};

}  // namespace

std::shared_ptr<attention::LinearInterceptor> make_linear_state_passing(
    const LinearCPOptions& options, std::shared_ptr<const CPTopology> topology) {
  return std::make_shared<LinearStatePassing>(options, std::move(topology));
}

}  // namespace hp::cp::detail
