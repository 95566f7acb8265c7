// Gated delta-rule linear attention: Gated DeltaNet (GDN) and Kimi Delta Attention (KDA), the
// stateful mixers of mixer.h (shapes, GVA, gates and the initial/final state are specified
// there).
//
// Per batch row and value head, state S [K, V], q scaled by `scale` (default 1/sqrt(K)):
//   GDN  S_t = exp(g_t) S_{t-1}              g_t a scalar log-gate per head
//   KDA  S_t = Diag(exp(g_t)) S_{t-1}        g_t in R^K: row k of S decays by exp(g_t[k])
//   then S_t += beta_t k_t (v_t - S_t^T k_t)^T;   o_t = S_t^T q_t
//
// Two kernels, the same numbers:
//   recurrent  the token-by-token recurrence above (the ground truth in tests; any dtype)
//   chunked    chunks of `chunk_size` tokens (default 64). Within a chunk, with G_t the
//              cumulative log-gate and S_0 the state entering the chunk:
//                u  = (I + tril_-1(diag(beta) (K e^G)(K e^-G)^T))^-1 diag(beta) (V - (K e^G) S_0)
//                     = U - W S_0                       (WY form: U, W independent of S_0)
//                O  = (Q e^G) S_0 + tril((Q e^G)(K e^-G)^T) u
//                S_C = e^{G_C} S_0 + (K e^{G_C - G})^T u
//              so the state passes between chunks with two [C,K]x[K,V]-sized matmuls, and every
//              C x C matrix of decayed products is built from factors e^{G_t - G_ref} with a
//              reference inside the block (no overflow for log-gates in [-10, 0] per token).
//              No [T, T] tensor. Computed in float32 (float64 for double inputs), one autograd
//              node: (batch, value head) rows in parallel; forward keeps only the inputs and the
//              state entering each chunk; a hand-written backward recomputes a row's chunk terms
//              and runs the state gradient back through the chunks. It gives every gradient: q,
//              k, v, g, beta and the initial state, and a gradient of the final state flows in
//              (a sequence split in two with the first half's final state as the second half's
//              initial state has the gradients of the whole). Once differentiable.
#pragma once

#include <memory>
#include <string>

#include "hp/attention/mixer.h"

namespace hp::attention {

// The per-token log-gate floor the model layers clamp to (model/linear_attention). The chunked
// kernel itself holds for any gate: below this floor KDA's intra-chunk sub-blocks shrink so its
// decay factors stay in float32's range.
inline constexpr double kMinLogGate = -10.0;

// Both honour in.resets (packed documents, mixer.h) through run_by_documents.
MixerResult delta_rule_recurrent(const MixerInputs& inputs, const MixerOptions& options,
                                 GateKind gate);
MixerResult delta_rule_chunked(const MixerInputs& inputs, const MixerOptions& options,
                               GateKind gate);

// The affine summary of a sequence: its final state is m * initial_state + s for every initial
// state (m [B, HV, K, K], s [B, HV, K, V]; in.initial_state is ignored; a row with a reset in
// in.resets has m = 0 and s its last document's final state). Differentiable. What
// state-passing CP exchanges: a rank's initial state is the fold of the summaries before it.
void delta_rule_state_summary(const MixerInputs& inputs, const MixerOptions& options, GateKind gate,
                              at::Tensor& m, at::Tensor& s);

// kernel: "chunked" (default) or "recurrent".
std::unique_ptr<StatefulMixer> make_gated_delta_net(const std::string& kernel = "chunked");
std::unique_ptr<StatefulMixer> make_kimi_delta_attention(const std::string& kernel = "chunked");

}  // namespace hp::attention
