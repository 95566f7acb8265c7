// The mixer-level entry of linear-attention CP: checks, the delta rule as the kernel of a share,
// and the byte formula. The data movement of each mode is drawn atop its own file:
// linear_ulysses.cpp and linear_state_passing.cpp (shared with the layer modes).
#include "hp/cp/linear_mixer.h"

#include <ATen/ATen.h>

#include "hp/attention/delta_rule.h"
#include "hp/common/check.h"

namespace hp::cp {

void check_linear_cp_mode(const std::string& who, const std::string& mode,
                          const std::string& state_exchange, int64_t heads, int64_t value_heads,
                          int64_t cp_size) {
  const int64_t p = cp_size;
  HP_CHECK(p >= 1, who, ": cp_size=", p, " must be >= 1");
  if (mode == "ulysses") {
    HP_CHECK(state_exchange == "all_gather", who, ": state_exchange='", state_exchange,
             "' chooses how mode=state_passing folds its states; mode=ulysses exchanges none, so "
             "drop it (or use mode=state_passing)");
    HP_CHECK(heads % p == 0 && value_heads % p == 0, who, ": mode=ulysses needs q/k heads (", heads,
             ") and value heads (", value_heads, ") divisible by cp_size=", p,
             "; use mode=state_passing or a cp_size that divides ", heads);
  } else if (mode == "state_passing") {
    HP_CHECK(state_exchange == "all_gather" || state_exchange == "p2p", who, ": state_exchange='",
             state_exchange, "' is not valid; valid: all_gather, p2p");
  } else {
    HP_CHECK(false, who, ": mode='", mode, "' is not valid; valid: ulysses, state_passing");
  }
}

MixerKernel delta_rule_kernel(const attention::MixerOptions& options, attention::GateKind gate,
                              const std::string& kernel) {
  HP_CHECK(kernel == "chunked" || kernel == "recurrent", "linear mixer CP: kernel='", kernel,
           "' is not valid; valid: chunked, recurrent");
  MixerKernel k;
  const bool chunked = kernel == "chunked";
  k.mix = [options, gate, chunked](const attention::MixerInputs& in, bool output_final_state) {
    auto o = options;
    o.output_final_state = output_final_state;
    return chunked ? attention::delta_rule_chunked(in, o, gate)
                   : attention::delta_rule_recurrent(in, o, gate);
  };
  return k;
}

attention::MixerResult linear_mixer_cp(const attention::MixerInputs& shard,
                                       const attention::MixerOptions& options,
                                       attention::GateKind gate, const LinearMixerCPOptions& cp,
                                       const CPTopology& topology) {
  const std::string who = "linear mixer CP (mode=" + cp.mode + ")";
  HP_CHECK(gate == attention::GateKind::kPerHead || gate == attention::GateKind::kPerChannel, who,
           ": the gate kind must be per-head (GDN) or per-channel (KDA)");
  const auto shape = attention::validate_mixer_inputs(shard, options, gate, true, who);
  check_linear_cp_mode(who, cp.mode, cp.state_exchange, shape.heads, shape.value_heads,
                       topology.cp_size);
  auto kernel = delta_rule_kernel(options, gate, cp.kernel);
  if (topology.cp_size == 1) return kernel.mix(shard, options.output_final_state);
  if (cp.mode == "ulysses") {
    return detail::ulysses_mix(shard, kernel, options.output_final_state, topology);
  }
  return detail::state_passing_mix(shard, kernel, options.output_final_state, cp.state_exchange,
                                   topology);
}

LinearMixerElementSizes LinearMixerElementSizes::of(const attention::MixerInputs& in) {
  auto packed = in.q.scalar_type();
  for (const auto* t : {&in.k, &in.v, &in.g, &in.beta}) {
    if (t->defined()) packed = c10::promoteTypes(packed, t->scalar_type());
  }
  LinearMixerElementSizes e;
  e.inputs = static_cast<int64_t>(c10::elementSize(packed));
  e.out = static_cast<int64_t>(c10::elementSize(in.q.scalar_type()));
  e.state = in.q.scalar_type() == at::kDouble ? 8 : 4;
  return e;
}

int64_t linear_mixer_forward_bytes_per_rank(const attention::MixerShape& s,
                                            attention::GateKind gate,
                                            const LinearMixerCPOptions& cp, int64_t cp_size,
                                            const LinearMixerElementSizes& e,
                                            bool output_final_state, bool with_resets) {
  const int64_t p = cp_size;
  if (p <= 1) return 0;
  const int64_t gw = gate == attention::GateKind::kPerChannel ? s.key_dim : 1;
  const int64_t state = s.batch * s.value_heads * s.key_dim * s.value_dim * e.state;
  if (cp.mode == "ulysses") {
    const int64_t channels = 2 * s.heads * s.key_dim + s.value_heads * (s.value_dim + gw + 1);
    const int64_t in = s.batch * (s.tokens / p) * channels * e.inputs;
    const int64_t out = s.batch * s.tokens * (s.value_heads / p) * s.value_dim * e.out;
    const int64_t final_state = output_final_state ? (p - 1) * state / p : 0;
    const int64_t resets = with_resets ? (p - 1) * s.batch * (s.tokens / p) : 0;
    return in * (p - 1) / p + out * (p - 1) / p + final_state + resets;
  }
  if (cp.state_exchange == "p2p") return (p - 1) * state * (output_final_state ? 2 : 1);
  return (p - 1) * s.batch * s.value_heads * s.key_dim * (s.value_dim + s.key_dim) * e.state;
}

}  // namespace hp::cp
