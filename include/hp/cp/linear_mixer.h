// Context parallelism for a stateful linear-attention mixer on its own (GDN, KDA;
// attention/mixer.h, attention/delta_rule.h): q, k, v, g, beta sharded along the sequence, no
// layer around them. The same two modes as the layers (cp/linear.h), from ONE implementation:
// the layer modes call the pieces declared here (detail::state_passing_mix, the Ulysses
// exchanges), so each exchange exists once.
//
// Shards: rank r of P holds the contiguous tokens [r*T/P, (r+1)*T/P) of every input, BSHD as in
// mixer.h: q, k [B, T/P, H, K]; v [B, T/P, HV, V]; g [B, T/P, HV] (GDN) or [B, T/P, HV, K] (KDA);
// beta [B, T/P, HV]. Every rank passes the same sizes except T/P (state_passing allows unequal
// shards; ulysses needs equal ones).
//
//   ulysses        one packed seq->head all-to-all of q, k, v, g, beta; the kernel on the full
//                  sequence for this rank's H/P q/k heads and HV/P value heads; one head->seq
//                  all-to-all of the output. Needs H % P == 0 (then HV % P == 0 too).
//   state_passing  each rank's affine summary of its shard (final = M * initial + S), its initial
//                  state the fold of the summaries of the ranks before it, then the kernel from
//                  that state. state_exchange: all_gather (one all-gather of [S | M]) or p2p (a
//                  chain of P-1 ring shifts of [B, HV, K, V] states).
//
// The initial state and the final state (contract of this function; the tests hold it to it):
//   initial_state  [B, HV, K, V] or undefined; pass the same tensor on every rank.
//                  ulysses: each rank reads its value heads. state_passing: it enters at rank 0
//                  (rank 0 reads it; the other ranks may pass it or not).
//                  Its gradient on a rank is that rank's part: the sum over the CP ranks is the
//                  full gradient (as for any replicated input, e.g. parameters). state_passing
//                  puts all of it on rank 0; ulysses each rank its heads' rows.
//   final_state    (options.output_final_state) the whole sequence's final state [B, HV, K, V],
//                  the same on every rank: ulysses all-gathers it over heads; state_passing gives
//                  rank P-1's, all_gather by folding all P gathered summaries on every rank (no
//                  extra bytes), p2p by one all-gather of every rank's local final state from
//                  which each rank keeps rank P-1's. As for every output of a CP call, the loss
//                  is the sum of the ranks' losses: a gradient of final_state given on several
//                  ranks is summed, so give it on one rank (zeros on the others).
//   resets         (packed documents) this rank's shard of the whole sequence's document starts
//                  [B, T_local] bool (MixerInputs::resets); a shard whose first token starts a
//                  document has it set there. state_passing: a reset in the shard zeroes M and
//                  the transport after it, so the state from the ranks before reaches only the
//                  shard's first document (no extra bytes). ulysses: one all-gather of the
//                  resets (one byte a token) gives every rank the whole sequence's.
// Outputs and every gradient (q, k, v, g, beta, the initial state) equal the single-process
// kernel on the whole sequence: every exchange is a differentiable collective (comm/).
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "hp/attention/mixer.h"
#include "hp/comm/group.h"
#include "hp/cp/topology.h"

namespace hp::cp {

struct LinearMixerCPOptions {
  std::string mode = "state_passing";         // state_passing | ulysses
  std::string state_exchange = "all_gather";  // all_gather | p2p (state_passing)
  std::string kernel = "chunked";             // chunked | recurrent: what runs on each share
};

// Checks a linear CP mode before any collective; rank-independent. Messages start with `who`
// and name the field, the value and the fix: the mode and exchange names, and for ulysses
// heads (H) and value_heads (HV) divisible by cp_size.
void check_linear_cp_mode(const std::string& who, const std::string& mode,
                          const std::string& state_exchange, int64_t heads, int64_t value_heads,
                          int64_t cp_size);

// The mixer (delta rule with `gate`: kPerHead GDN, kPerChannel KDA) under CP on this rank's
// shard. Validates everything (names, shapes of the shard, heads for ulysses) before any
// collective. cp_size 1 runs the kernel alone. The topology's CP group must outlive the graph.
attention::MixerResult linear_mixer_cp(const attention::MixerInputs& shard,
                                       const attention::MixerOptions& options,
                                       attention::GateKind gate, const LinearMixerCPOptions& cp,
                                       const CPTopology& topology);

// Bytes per element of what linear_mixer_cp moves.
struct LinearMixerElementSizes {
  int64_t inputs = 4;  // q, k, v, g, beta as packed by ulysses (their promoted type)
  int64_t out = 4;     // the output (q's type)
  int64_t state = 4;   // summaries and states: float32, float64 for double inputs
  static LinearMixerElementSizes of(const attention::MixerInputs& in);
};

// Bytes one rank sends in the forward of linear_mixer_cp (the same on every rank); `global` is
// the whole call (tokens = T, the global length), gw = 1 (GDN) or K (KDA):
//   ulysses        B * T/P * (2HK + HV*V + HV*gw + HV) * e_in * (P-1)/P     q, k, v, g, beta
//                + B * T * HV/P * V * e_out * (P-1)/P                        the output back
//                [+ (P-1) * B * HV/P * K * V * e_state                       final, all-gather]
//   state_passing all_gather  (P-1) * B * HV * K * (V + K) * e_state          [S | M]
//                 p2p         (P-1) * B * HV * K * V * e_state                the chain
//                             [+ (P-1) * B * HV * K * V * e_state             final, all-gather]
//   with_resets, ulysses:     [+ (P-1) * B * T/P                               resets, all-gather]
// The backward sends the same bytes again (each collective's inverse moves what it moved) when
// every output, final_state included, gets a gradient, the resets' all-gather excepted (not
// differentiable); so a forward + backward is this plus the same without resets.
int64_t linear_mixer_forward_bytes_per_rank(const attention::MixerShape& global,
                                            attention::GateKind gate,
                                            const LinearMixerCPOptions& cp, int64_t cp_size,
                                            const LinearMixerElementSizes& elements,
                                            bool output_final_state, bool with_resets = false);

// What a linear CP mode runs on its share of the work: the mixer from an initial state (state
// passing runs it once, with values [v | 0] from the initial state [0 | I], to get the shard's
// output and final state as affine maps of any initial state). delta_rule_kernel gives the delta
// rule's; a layer's stages give theirs (cp/linear_*.cpp).
struct MixerKernel {
  std::function<attention::MixerResult(const attention::MixerInputs&, bool output_final_state)> mix;
};
MixerKernel delta_rule_kernel(const attention::MixerOptions& options, attention::GateKind gate,
                              const std::string& kernel);

namespace detail {

// state_passing on this rank's shard (its initial_state per the contract above): summary,
// exchange ("all_gather" | "p2p"), then kernel.mix from the folded state. `while_in_flight`
// (optional) runs once while the exchange's first collective travels (the caller's
// independent work: the async schedule).
attention::MixerResult state_passing_mix(const attention::MixerInputs& shard,
                                         const MixerKernel& kernel, bool output_final_state,
                                         const std::string& state_exchange,
                                         const CPTopology& topology,
                                         const std::function<void()>& while_in_flight = {});

// ulysses on this rank's shard: to_heads, kernel.mix, to_sequence (and the final state
// all-gathered over heads).
attention::MixerResult ulysses_mix(const attention::MixerInputs& shard, const MixerKernel& kernel,
                                   bool output_final_state, const CPTopology& topology);

}  // namespace detail
}  // namespace hp::cp
