// Linear attention, mode ulysses: the mixer on P-th of the heads over the whole sequence. The
// two exchanges (shared by the mixer-level core and the layer mode), the mixer-level core
// (detail::ulysses_mix, what linear_mixer_cp runs) and the layer mode.
//
//   ulysses_to_heads: pack per destination rank j the parts of head group j
//        [B, T/P, P, Cg] --A2A(split P, concat seq)--> [B, T, Cg] -> the parts    (one all-to-all)
//   ulysses_to_sequence: o [B, T, n, X] --A2A(split seq, concat heads)--> [B, T/P, P*n, X]
//   ulysses_mix:  parts q, k [.., H/P, K], v [.., HV/P, V], g [.., HV/P(, K)], beta [.., HV/P]
//                 -> delta rule on [B, T, HV/P, .] (initial state: this rank's HV/P heads)
//                 -> out back to [B, T/P, HV, V]; final [B, HV/P, K, V] all-gathered over heads
//   layer:   x [B, S/P, hidden] --project--> qkv, beta, gate (local tokens, all heads), out_gate
//            parts: [conv channels of head group j | beta_j | gate_j] -> to_heads ->
//            convolve (this group's conv channels, full sequence: no halo) -> delta rule
//            (zero state) -> to_sequence -> output (local z)
//   backward: the inverse all-to-alls (differentiable collectives).
#include <ATen/ATen.h>

#include "hp/comm/autograd_collectives.h"
#include "hp/common/check.h"
#include "hp/cp/linear.h"
#include "hp/cp/linear_mixer.h"

namespace hp::cp::detail {

std::vector<at::Tensor> ulysses_to_heads(const std::vector<std::vector<at::Tensor>>& parts,
                                         const comm::GroupPtr& group) {
  HP_INTERNAL_ASSERT(!parts.empty() && !parts[0].empty(), "ulysses_to_heads: no parts");
  const auto& first = parts[0];
  auto dtype = first[0].scalar_type();
  std::vector<int64_t> widths;
  for (const auto& t : first) {
    dtype = c10::promoteTypes(dtype, t.scalar_type());
    widths.push_back(t.numel() / (t.size(0) * t.size(1)));
  }
  std::vector<at::Tensor> groups;
  groups.reserve(parts.size());
  for (const auto& dest : parts) {
    std::vector<at::Tensor> flat;
    flat.reserve(dest.size());
    for (const auto& t : dest)
      flat.push_back(t.reshape({t.size(0), t.size(1), -1}).to(dtype));
    groups.push_back(at::cat(flat, 2));
  }
  auto packed = at::stack(groups, 2);                                     // [B, T/P, P, Cg]
  auto mine = comm::ulysses_seq_to_head(packed, 1, 2, group).squeeze(2);  // [B, T, Cg]
  std::vector<at::Tensor> out;
  int64_t offset = 0;
  for (size_t i = 0; i < first.size(); ++i) {
    auto shape = first[i].sizes().vec();
    shape[1] = mine.size(1);
    out.push_back(mine.narrow(2, offset, widths[i]).reshape(shape).to(first[i].scalar_type()));
    offset += widths[i];
  }
  return out;
}

at::Tensor ulysses_to_sequence(const at::Tensor& o, const comm::GroupPtr& group) {
  const int64_t p = group->size();
  auto back = comm::ulysses_head_to_seq(o.flatten(2).unsqueeze(2), 1, 2, group);  // [B, T/P, P, nX]
  return back.reshape({o.size(0), back.size(1), p * o.size(2), o.size(3)});
}

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

  at::Tensor forward(const at::Tensor& x, const attention::LinearLayerStages& stages) override {
    const auto shape = stages.shape();
    const int64_t p = topology_->cp_size, r = topology_->cp_rank;
    const int64_t nh = shape.heads / p, nv = shape.value_heads / p, gw = shape.gate_width;
    auto t = stages.project(x);
    std::vector<std::vector<at::Tensor>> parts;
    for (int64_t j = 0; j < p; ++j) {
      parts.push_back({t.qkv.index_select(2, stages.head_channels(j * nh, nh)),
                       t.beta_logit.narrow(2, j * nv, nv),
                       t.gate_in.narrow(2, j * nv * gw, nv * gw)});
    }
    auto mine = ulysses_to_heads(parts, topology_->cp);  // qkv, beta, gate: [B, S, .]
    auto conv = stages.convolve(mine[0], at::Tensor(), stages.head_channels(r * nh, nh));
    auto in = stages.mixer_inputs(conv, mine[1], mine[2], r * nh, nh);
    auto o = stages.mix(in, false).out;  // [B, S, nv, V]
    return stages.output(ulysses_to_sequence(o, topology_->cp), t.out_gate);
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
