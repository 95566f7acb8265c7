// The model-facing surface context parallelism hooks into for linear-attention layers (the
// counterpart of host.h for softmax attention; models include attention/, never cp/).
//
// A linear-attention layer exposes its stages (LinearLayerStages); its forward is
// host.forward(x, stages). With nothing installed that runs the stages in order on the local
// tokens; a CP mode (cp/linear_*) installs an interceptor that puts communication between them:
//   project -> [halo | all-to-all] -> convolve -> mixer_inputs -> [state exchange] -> mix
//           -> [all-to-all] -> output(project_out_gate)
// project_out_gate is a stage of its own: nothing before output needs it, so an async CP mode
// computes it while a collective travels.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include <ATen/core/Tensor.h>

#include "hp/attention/mixer.h"

namespace hp::attention {

// Sizes a CP mode needs to know of a layer.
struct LinearLayerShape {
  int64_t heads = 0;        // q/k heads H
  int64_t value_heads = 0;  // HV
  int64_t key_dim = 0;      // K
  int64_t value_dim = 0;    // V
  int64_t conv_width = 1;   // depthwise causal conv: w-1 rows of halo
  int64_t gate_width = 0;   // gate_in channels per value head: 1 (GDN) or K (KDA)
};

// Per-token projections of a layer that the mixer needs: [B, S, *] each.
struct LinearTokens {
  at::Tensor qkv;         // conv channels: q [H*K] | k [H*K] | v [HV*V]
  at::Tensor beta_logit;  // [B, S, HV]
  at::Tensor gate_in;     // [B, S, HV * gate_width]
};

class LinearLayerStages {
 public:
  virtual ~LinearLayerStages() = default;
  virtual LinearLayerShape shape() const = 0;
  virtual LinearTokens project(const at::Tensor& x) const = 0;
  // The output gate's projection [B, S, HV*V] (only output() reads it).
  virtual at::Tensor project_out_gate(const at::Tensor& x) const = 0;
  // The conv channels (indices into qkv) of q/k heads [first, first + n) and their value heads,
  // in the order convolve/mixer_inputs expect them for that head range.
  virtual at::Tensor head_channels(int64_t first_head, int64_t num_heads) const = 0;
  // silu(causal depthwise conv); `halo` [B, w-1, C] precedes the first row (undefined: zeros);
  // `channels` selects a head range's conv channels (qkv then holds only those); `taps`
  // (packed documents, LinearDocuments::taps) [B|1, S, w] bool: which of the w inputs of each
  // output row (oldest first) it may read; undefined: all.
  virtual at::Tensor convolve(const at::Tensor& qkv, const at::Tensor& halo,
                              const at::Tensor& channels, const at::Tensor& taps) const = 0;
  // beta_logit / gate_in hold the value heads of [first_head, first_head + num_heads) only.
  virtual MixerInputs mixer_inputs(const at::Tensor& conv, const at::Tensor& beta_logit,
                                   const at::Tensor& gate_in, int64_t first_head,
                                   int64_t num_heads) const = 0;
  virtual MixerResult mix(const MixerInputs& in, bool output_final_state) const = 0;
  // The affine summary of a shard: its final state is M * initial + S (M [B, HV, K, K],
  // S [B, HV, K, V], float32 at least). What state-passing CP exchanges.
  virtual void state_summary(const MixerInputs& in, at::Tensor& m, at::Tensor& s) const = 0;
  virtual at::Tensor output(const at::Tensor& mixed, const at::Tensor& out_gate) const = 0;
};

// Packed documents as the tokens [begin, begin + n) of a sequence see them, from the document
// ids of the whole sequence doc_ids [B|1, S] (int64; a token whose id differs from the token
// before it starts a document):
//   resets  [B|1, n] bool: the mixer's document starts (MixerInputs::resets); global token 0 is
//           never one (nothing precedes it)
//   taps    [B|1, n, w] bool: convolve's taps; tap j of row t reads token begin + t + j - (w-1)
//           and is kept when that token is in row t's document (taps before token 0 read the
//           zero halo and stay kept)
// Both undefined when doc_ids is undefined. Throws (naming the sizes) when doc_ids does not
// describe exactly `total` tokens (the global sequence length; negative: any length) or
// [begin, begin + n) is not inside them.
struct LinearDocuments {
  at::Tensor resets, taps;
};
LinearDocuments linear_documents(const at::Tensor& doc_ids, int64_t begin, int64_t n,
                                 int64_t conv_width, int64_t total = -1);

// Runs the stages of one forward, in place of the plain order (implemented by cp/). doc_ids:
// packed documents of the whole global sequence [B|1, S] (undefined: one document per row).
class LinearInterceptor {
 public:
  virtual ~LinearInterceptor() = default;
  virtual std::string id() const = 0;
  virtual at::Tensor forward(const at::Tensor& x, const LinearLayerStages& stages,
                             const at::Tensor& doc_ids) = 0;
};

// The plain order on one rank: project, convolve, mixer_inputs, mix, output (x holds the whole
// sequence, so doc_ids [B|1, S] are its own).
at::Tensor run_linear_stages(const at::Tensor& x, const LinearLayerStages& stages,
                             const at::Tensor& doc_ids = {});

class LinearHost {
 public:
  // A second interceptor with another id is an error; the same id again is a no-op.
  void install(std::shared_ptr<LinearInterceptor> interceptor);
  LinearInterceptor* installed() const { return interceptor_.get(); }
  at::Tensor forward(const at::Tensor& x, const LinearLayerStages& stages,
                     const at::Tensor& doc_ids = {});

 private:
  std::shared_ptr<LinearInterceptor> interceptor_;
};

}  // namespace hp::attention
