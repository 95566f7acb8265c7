// Linear attention, mode state_passing (the source's "state P2P"): every rank keeps its
// contiguous shard of the sequence and receives only states. The mixer-level core
// (detail::state_passing_mix, what linear_mixer_cp runs) and the layer mode around it.
//
//   layer only: x [B, S/P, hidden] --project--> qkv [B, S/P, C], beta, gate
//     conv halo: qkv's last w-1 rows --ring shift +1--> the next rank (rank 0: zeros)
//     convolve [halo | qkv] -> q, k, v, g, beta of the shard; after the mixer: output
//     packed documents: the shard's resets and conv taps from the global doc ids; a reset in
//     the shard zeroes the transport after it and M (the mixer's run_by_documents), so the
//     state from the ranks before reaches only the shard's first document
//   state_passing_mix (q, k, v, g, beta of the shard):
//     one run of the kernel over the shard from a symbolic initial state, before any exchange:
//       values [v | 0_K], initial state [0 | I_K]  (state columns evolve independently)
//       -> out [out0 | P], final [S | M]: the shard's output and final state from any initial
//          state h are out0 + P h and M h + S   (M [B, HV, K, K], S [B, HV, K, V], float32+)
//     rank 0 with a user initial state h0: S <- M h0 + S (its final state; h0 enters there)
//     initial state h_r = fold of the summaries of ranks < r (rank 0: h0 or zeros):
//       all_gather  [S | M] [1, B, HV, K, V+K] all-gathered once; h = M_p h + S_p for p < r;
//                   the final state folds all P (every rank, no more bytes)
//       p2p         P-1 ring steps of M h + S; rank r's h is exact after r of them; the final
//                   state: every rank's M h + S all-gathered, rank P-1's kept
//     out = out0 + P h_r -> [B, S/P, HV, V]   (no second pass over the shard)
//     async (layer): the output gate's projection z = x Wz runs while the all-gather (or the
//     chain's first shift) travels; sync computes it with the other projections
//   backward: every exchange is differentiable (all-gather <-> reduce-scatter, shift <-> the
//   opposite shift), so d(initial state) flows back to the ranks whose summaries made it.
#include <ATen/ATen.h>

#include "hp/comm/async_transfer.h"
#include "hp/comm/autograd_collectives.h"
#include "hp/common/check.h"
#include "hp/cp/linear.h"
#include "hp/cp/linear_mixer.h"
#include "hp/cp/strategy.h"

namespace hp::cp {
namespace detail {
namespace {

// The shard's affine run (see the sketch above).
struct AffineRun {
  at::Tensor out0, transport;  // [B, T, HV, V], [B, T, HV, K]: out = out0 + transport . h
  at::Tensor m, s;             // [B, HV, K, K], [B, HV, K, V]: final = m h + s
};

AffineRun affine_run(const attention::MixerInputs& shard, const MixerKernel& kernel) {
  const int64_t b = shard.v.size(0), t = shard.v.size(1), hv = shard.v.size(2);
  const int64_t vd = shard.v.size(3), kd = shard.k.size(3);
  auto in = shard;
  in.v = at::cat({shard.v, at::zeros({b, t, hv, kd}, shard.v.options())}, -1);
  const auto state_dtype = shard.q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  auto opts = shard.v.options().dtype(state_dtype);
  in.initial_state =
      at::cat({at::zeros({b, hv, kd, vd}, opts), at::eye(kd, opts).expand({b, hv, kd, kd})}, -1);
  auto res = kernel.mix(in, /*output_final_state=*/true);
  return {res.out.narrow(-1, 0, vd), res.out.narrow(-1, vd, kd), res.final_state.narrow(-1, vd, kd),
          res.final_state.narrow(-1, 0, vd)};
}

// `x` on every rank but rank 0 of the group; `first` (still in the graph, gradient 0 for x) on
// rank 0.
at::Tensor replace_on_first(const at::Tensor& x, const at::Tensor& first, int64_t rank) {
  auto keep = at::full({}, rank > 0, at::TensorOptions().dtype(at::kBool));
  return at::where(keep, x, first);
}

// all_gather: this rank's initial state (and, asked for, the final state) from every rank's
// [S | M]. `s` is rank 0's final state there when a user initial state entered.
void gather_and_fold(const at::Tensor& m, const at::Tensor& s, const at::Tensor& h0,
                     bool output_final_state, const CPTopology& topo,
                     const std::function<void()>& while_in_flight, at::Tensor& h,
                     at::Tensor& final_state) {
  const int64_t p = topo.cp_size, r = topo.cp_rank, v = s.size(-1);
  auto packed = at::cat({s, m}, -1).unsqueeze(0).contiguous();  // [1, B, HV, K, V+K]
  auto flight = comm::all_gather_start(packed, 0, topo.cp);
  if (while_in_flight) while_in_flight();
  auto all = flight.wait();  // [P, B, HV, K, V+K]
  at::Tensor fold;           // undefined: the zero state
  const int64_t upto = output_final_state ? p : r;
  for (int64_t i = 0; i < upto; ++i) {
    auto summary = all.select(0, i);
    auto si = summary.narrow(-1, 0, v);
    fold = fold.defined() ? at::matmul(summary.narrow(-1, v, summary.size(-1) - v), fold) + si : si;
    if (i + 1 == r) h = fold;
  }
  if (r == 0) h = h0.defined() ? h0 : at::zeros_like(s);
  if (output_final_state) final_state = fold;
  // Every rank's graph uses the gathered summaries (rank 0 folds none), so every rank runs
  // their reduce-scatter in backward.
  h = anchored(h, {all});
}

// p2p: the chain. Rank 0's state is h0 (zeros without one) throughout. `while_in_flight` runs
// while the first shift travels (the later ones need the state it brings).
at::Tensor chain(const at::Tensor& m, const at::Tensor& s, const at::Tensor& h0,
                 const CPTopology& topo, const std::function<void()>& while_in_flight) {
  const int64_t p = topo.cp_size, r = topo.cp_rank;
  const auto first = h0.defined() ? h0 : at::zeros_like(s);
  auto h = first;
  for (int64_t step = 1; step < p; ++step) {
    auto final_state = (at::matmul(m, h) + s).contiguous();
    at::Tensor shifted;
    if (step == 1) {
      auto flight = comm::shift_start(final_state, 1, topo.cp);
      if (while_in_flight) while_in_flight();
      shifted = flight.wait();
    } else {
      shifted = comm::ring_shift(final_state, 1, topo.cp);
    }
    h = replace_on_first(shifted, first, r);
  }
  if (p == 1 && while_in_flight) while_in_flight();
  return h;
}

}  // namespace

attention::MixerResult state_passing_mix(const attention::MixerInputs& shard,
                                         const MixerKernel& kernel, bool output_final_state,
                                         const std::string& state_exchange,
                                         const CPTopology& topology,
                                         const std::function<void()>& while_in_flight) {
  const int64_t p = topology.cp_size, r = topology.cp_rank;
  auto run = affine_run(shard, kernel);
  const auto& m = run.m;
  const auto& s = run.s;
  at::Tensor h0;
  if (r == 0 && shard.initial_state.defined()) h0 = shard.initial_state.to(s.scalar_type());
  at::Tensor h, final_state;
  if (state_exchange == "p2p") {
    h = chain(m, s, h0, topology, while_in_flight);
    if (output_final_state) {
      auto mine = (at::matmul(m, h) + s).unsqueeze(0).contiguous();
      final_state = comm::all_gather_autograd(mine, 0, topology.cp).select(0, p - 1);
    }
  } else {
    HP_INTERNAL_ASSERT(state_exchange == "all_gather", "state_exchange '", state_exchange, "'");
    gather_and_fold(m, h0.defined() ? at::matmul(m, h0) + s : s, h0, output_final_state, topology,
                    while_in_flight, h, final_state);
  }
  // out[b, t, hv, :] = out0 + sum_k transport[b, t, hv, k] h[b, hv, k, :]
  auto correction = at::matmul(run.transport.transpose(1, 2).to(h.scalar_type()), h);
  attention::MixerResult res;
  res.out = run.out0 + correction.transpose(1, 2).to(run.out0.scalar_type());
  res.final_state = final_state;
  return res;
}

namespace {

class LinearStatePassing final : public attention::LinearInterceptor {
 public:
  LinearStatePassing(LinearCPOptions options, std::shared_ptr<const CPTopology> topology)
      : options_(std::move(options)), topology_(std::move(topology)) {}

  std::string id() const override {
    return "linear-cp:" + options_.module_path + ":state_passing/" + options_.state_exchange + ":" +
           topology_->id();
  }

  at::Tensor forward(const at::Tensor& x, const attention::LinearLayerStages& stages,
                     const at::Tensor& doc_ids) override {
    const auto shape = stages.shape();
    const int64_t r = topology_->cp_rank, w = shape.conv_width, n = x.size(1);
    HP_CHECK(n >= w - 1, "linear attention CP (state_passing) on module '", options_.module_path,
             "': the local shard has ", n, " tokens, fewer than the conv halo of ", w - 1,
             "; use fewer CP ranks or a longer sequence");
    // This rank's contiguous tokens [r n, (r+1) n): its resets (a reset drops the state that
    // arrives from the ranks before) and conv taps (the halo rows of another document dropped).
    const auto docs = attention::linear_documents(doc_ids, r * n, n, w, n * topology_->cp_size);
    auto t = stages.project(x);
    at::Tensor out_gate;
    std::function<void()> while_in_flight;
    if (options_.schedule == CPSchedule::kAsync) {
      while_in_flight = [&] { out_gate = stages.project_out_gate(x); };
    } else {
      out_gate = stages.project_out_gate(x);
    }
    at::Tensor halo;
    if (w > 1) {
      auto tail = t.qkv.narrow(1, x.size(1) - (w - 1), w - 1).contiguous();
      auto shifted = comm::ring_shift(tail, 1, topology_->cp);
      halo = replace_on_first(shifted, at::zeros_like(shifted), r);
    }
    auto conv = stages.convolve(t.qkv, halo, at::Tensor(), docs.taps);
    auto in = stages.mixer_inputs(conv, t.beta_logit, t.gate_in, 0, shape.heads);
    if (docs.resets.defined()) in.resets = docs.resets.expand({x.size(0), n});
    MixerKernel kernel;
    kernel.mix = [&stages](const attention::MixerInputs& i, bool f) { return stages.mix(i, f); };
    auto o =
        state_passing_mix(in, kernel, false, options_.state_exchange, *topology_, while_in_flight)
            .out;
    return stages.output(o, out_gate);
  }

 private:
  LinearCPOptions options_;
  std::shared_ptr<const CPTopology> topology_;
};

}  // namespace

std::shared_ptr<attention::LinearInterceptor> make_linear_state_passing(
    const LinearCPOptions& options, std::shared_ptr<const CPTopology> topology) {
  return std::make_shared<LinearStatePassing>(options, std::move(topology));
}

}  // namespace detail
}  // namespace hp::cp
