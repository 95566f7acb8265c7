// Sequence mixers that are not softmax attention: linear attention with a recurrent state
// (Gated DeltaNet, Kimi Delta Attention; DESIGN section 14). The kernels and their CP modes
// (Ulysses, state passing) implement this interface; this header is its contract.
//
// Per batch row b and value head h the mixer carries a state S [K, V] along the sequence:
//   S_t = update(S_{t-1}; q_t, k_t, v_t, g_t, beta_t)        (the mixer's recurrence)
//   o_t = S_t^T (scale * q_t)                                 scale defaults to 1/sqrt(K)
// starting from S_0 = initial_state (zeros when undefined). For example Gated DeltaNet:
//   S_t = exp(g_t) S_{t-1};  S_t += beta_t k_t (v_t - S_t^T k_t)^T
// and Kimi Delta Attention the same with a per-channel decay Diag(exp(g_t)).
//
// Layout BSHD, as the public linear-attention kernels:
//   q, k            [B, T, H, K]
//   v               [B, T, HV, V]    HV a multiple of H (GVA): value head h reads q/k head
//                                    h / (HV / H)
//   g               natural-log gates (<= 0 for a decay): [B, T, HV] for a scalar gate per head
//                   (GateKind::kPerHead), [B, T, HV, K] per channel (GateKind::kPerChannel);
//                   undefined for a mixer without gates (GateKind::kNone)
//   beta            [B, T, HV] write strengths (mixers with uses_beta())
//   initial_state   [B, HV, K, V] or undefined
//   resets          packed documents: [B, T] bool, true where a token starts a new document;
//                   the state is zeroed before that token's update, so nothing crosses a
//                   document boundary and the initial state reaches only the tokens before the
//                   row's first reset (a reset at token 0 drops it). Undefined: one document.
// Result: out [B, T, HV, V] in q's dtype; final_state [B, HV, K, V] when
// options.output_final_state (state math in float32 at least, float64 for double inputs).
//
// Differentiable in every input, the initial state included: backward returns dq, dk, dv, dg,
// dbeta and d(initial_state), and accepts a gradient of final_state. So a sequence split in
// two, the first half's final state fed as the second half's initial state, has exactly the
// outputs and gradients of the whole sequence (what state-passing CP relies on: a forward that
// used the initial state but a backward that dropped its gradient would train wrong silently).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>

#include <ATen/core/Tensor.h>

namespace hp::attention {

enum class GateKind { kNone, kPerHead, kPerChannel };

struct MixerInputs {
  at::Tensor q, k, v;
  at::Tensor g;              // see GateKind
  at::Tensor beta;           // mixers with uses_beta()
  at::Tensor initial_state;  // optional
  at::Tensor resets;         // optional [B, T] bool: document starts (see above)
};

struct MixerOptions {
  std::optional<double> scale;      // default 1/sqrt(K)
  bool output_final_state = false;  // also return S_T
  int64_t chunk_size = 64;          // chunked kernels: tokens per chunk
};

struct MixerResult {
  at::Tensor out;          // [B, T, HV, V]
  at::Tensor final_state;  // [B, HV, K, V] when output_final_state, else undefined
};

// The sizes of one mixer call.
struct MixerShape {
  int64_t batch = 0, tokens = 0, heads = 0, value_heads = 0, key_dim = 0, value_dim = 0;
  double scale = 1.0;
};

class StatefulMixer {
 public:
  virtual ~StatefulMixer() = default;
  virtual std::string name() const = 0;
  virtual GateKind gate_kind() const = 0;
  virtual bool uses_beta() const = 0;
  // Validates (validate_mixer_inputs) before any work, then runs the recurrence.
  virtual MixerResult forward(const MixerInputs& inputs, const MixerOptions& options) const = 0;
};

// A mixer kernel without document resets.
using MixerRun = std::function<MixerResult(const MixerInputs&, const MixerOptions&)>;

// Runs `run` with in.resets honoured: every row is cut into its documents (at its resets), the
// documents run as the rows of padded batches, one `run` per group of similar lengths (zeros
// after a document's last token leave its state alone), the row's initial state enters its
// first document only (unless that starts with a reset), and the outputs go back in place; the
// final state is the row's last document's. Differentiable (slices, pads and concatenations
// around the `run`s). Without resets (or none set), `run` on `in` as it is.
MixerResult run_by_documents(const MixerInputs& in, const MixerOptions& options,
                             const MixerRun& run);

// Checks every shape and dtype of the contract above for a mixer with `gate` and `uses_beta`
// and returns the sizes; throws hp::Error naming `who`, the tensor, its shape and the expected
// one.
MixerShape validate_mixer_inputs(const MixerInputs& inputs, const MixerOptions& options,
                                 GateKind gate, bool uses_beta, const std::string& who);

}  // namespace hp::attention
