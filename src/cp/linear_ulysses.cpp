// Linear attention, mode ulysses: the mixer on P-th of the heads over the whole sequence. The
// mixer-level core (detail::ulysses_mix, what linear_mixer_cp runs) and the layer mode, over
// the packed exchanges of the Ulysses piece (strategy_pieces.h):
//
//   ulysses_to_heads: pack per destination rank j the parts of head group j
//        [B, T/P, P, Cg] --A2A(split P, concat seq)--> [B, T, Cg] -> the parts    (one all-to-all)
//   ulysses_to_sequence: o [B, T, n, X] --A2A(split seq, concat heads)--> [B, T/P, P*n, X]
//   ulysses_mix:  parts q, k [.., H/P, K], v [.., HV/P, V], g [.., HV/P(, K)], beta [.., HV/P]
//                 -> delta rule on [B, T, HV/P, .] (initial state: this rank's HV/P heads;
//                 resets [B, T/P] --all-gather(seq)--> [B, T], packed documents only)
//                 -> out back to [B, T/P, HV, V]; final [B, HV/P, K, V] all-gathered over heads
//   layer:   x [B, S/P, hidden] --project--> qkv, beta, gate (local tokens, all heads)
//            parts: [conv channels of head group j | beta_j | gate_j] -> to_heads ->
//            convolve (this group's conv channels, full sequence: no halo) -> delta rule
//            (zero state) -> to_sequence -> output (local z = x Wz)
//            packed documents: the global doc ids give the whole sequence's resets and conv taps
//            async: to_heads is started, z = x Wz computed while it travels, then waited
//   backward: the inverse all-to-alls (differentiable collectives).
#include <ATen/ATen.h>

#include "hp/comm/async_transfer.h"
#include "hp/comm/autograd_collectives.h"
#include "hp/comm/collectives.h"
#include "hp/common/check.h"
#include "hp/cp/linear.h"
#include "hp/cp/linear_mixer.h"
#include "strategy_pieces.h"

namespace hp::cp::detail {

attention::MixerResult ulysses_mix(const attention::MixerInputs& shard, const MixerKernel& kernel,
                                   bool output_final_state, const CPTopology& topology) {
  const int64_t p = topology.cp_size, r = topology.cp_rank;
  const int64_t nh = shard.q.size(2) / p, nv = shard.v.size(2) / p;
  std::vector<std::vector<at::Tensor>> parts;
  for (int64_t j = 0; j < p; ++j) {
    parts.push_back({shard.q.narrow(2, j * nh, nh), shard.k.narrow(2, j * nh, nh),
                     shard.v.narrow(2, j * nv, nv), shard.g.narrow(2, j * nv, nv),
                     shard.beta.narrow(2, j * nv, nv)});
  }
  auto mine = ulysses_to_heads(parts, topology.cp);
  attention::MixerInputs in;
  in.q = mine[0];
  in.k = mine[1];
  in.v = mine[2];
  in.g = mine[3];
  in.beta = mine[4];
  if (shard.initial_state.defined()) in.initial_state = shard.initial_state.narrow(1, r * nv, nv);
  if (shard.resets.defined()) {  // the whole sequence's document starts, one byte a token
    in.resets =
        comm::all_gather(*topology.cp, shard.resets.to(at::kByte).contiguous(), 1).to(at::kBool);
  }
  auto res = kernel.mix(in, output_final_state);
  attention::MixerResult out;
  out.out = ulysses_to_sequence(res.out, topology.cp);
  if (output_final_state) {
    out.final_state = comm::all_gather_autograd(res.final_state.contiguous(), 1, topology.cp);
  }
  return out;
}

namespace {

class LinearUlysses final : public attention::LinearInterceptor {
 public:
  LinearUlysses(LinearCPOptions options, std::shared_ptr<const CPTopology> topology)
      : options_(std::move(options)), topology_(std::move(topology)) {}

  std::string id() const override {
    return "linear-cp:" + options_.module_path + ":ulysses:" + topology_->id();
  }

  at::Tensor forward(const at::Tensor& x, const attention::LinearLayerStages& stages,
                     const at::Tensor& doc_ids) override {
    const auto shape = stages.shape();
    const int64_t p = topology_->cp_size, r = topology_->cp_rank;
    // After the all-to-all this rank holds the whole sequence (its heads): every document.
    const auto docs =
        attention::linear_documents(doc_ids, 0, x.size(1) * p, shape.conv_width, x.size(1) * p);
    const int64_t nh = shape.heads / p, nv = shape.value_heads / p, gw = shape.gate_width;
    auto t = stages.project(x);
    std::vector<std::vector<at::Tensor>> parts;
    for (int64_t j = 0; j < p; ++j) {
      parts.push_back({t.qkv.index_select(2, stages.head_channels(j * nh, nh)),
                       t.beta_logit.narrow(2, j * nv, nv),
                       t.gate_in.narrow(2, j * nv * gw, nv * gw)});
    }
    std::vector<at::Tensor> mine;  // qkv, beta, gate: [B, S, .]
    at::Tensor out_gate;
    if (options_.schedule == CPSchedule::kAsync) {
      HeadPacking how;
      auto flight = comm::all_to_all_start(pack_for_heads(parts, how), 2, 1, topology_->cp);
      out_gate = stages.project_out_gate(x);  // while the channels travel
      mine = unpack_heads(flight.wait(), how);
    } else {
      out_gate = stages.project_out_gate(x);
      mine = ulysses_to_heads(parts, topology_->cp);
    }
    auto conv = stages.convolve(mine[0], at::Tensor(), stages.head_channels(r * nh, nh), docs.taps);
    auto in = stages.mixer_inputs(conv, mine[1], mine[2], r * nh, nh);
    if (docs.resets.defined()) in.resets = docs.resets.expand({conv.size(0), conv.size(1)});
    auto o = stages.mix(in, false).out;  // [B, S, nv, V]
    return stages.output(ulysses_to_sequence(o, topology_->cp), out_gate);
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
