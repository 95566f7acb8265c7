// The attention layer every CP strategy ends in (DESIGN section 6).
//
//   AttentionPrimitive::forward(q, k, v, options) -> {out, lse}      differentiable in q, k, v
//
// Layout BNSD: q [B, Nq, Sq, Dqk], k [B, Nkv, Skv, Dqk], v [B, Nkv, Skv, Dv];
// out [B, Nq, Sq, Dv] in q's dtype, lse [B, Nq, Sq] float32, float64 for double inputs
// (natural-log sum of exp of the scaled, masked scores). q and k share Dqk (the score
// contraction); v may have its own last dim Dv (MLA: Dqk 192, Dv 128). q, k, v share one dtype.
// GQA/MQA: Nq must be a multiple of Nkv; query head h reads kv head h / (Nq / Nkv) by index
// mapping (K/V are never repeated in memory).
//
// Visibility of key j to local query i is the AND of
//   * causal (when options.causal):  j <= causal.q_offset + i
//   * a bool user mask (true = attend), or an additive float user mask (added to the scores;
//     -inf hides), broadcastable to [B, Nq, Sq, Skv]; never modified
//   * a mask function (flex style) evaluated per block; blocks it hides entirely are skipped
//   * documents (packed sequences, masks.h): same document only; tiles no document spans are
//     skipped, tiles inside one document run unmasked
// A query row with no visible key yields out = 0 and lse = -inf (never NaN), and zero gradient.
// NaN in, NaN out: a NaN among a row's visible scores makes that row's out, lse and gradients
// NaN in every primitive (never zeros).
//
// Accuracy at extreme logit scales (float32 inputs; tests/attention/edge_numerics_test.cpp):
// out and every gradient stay within ~1e-7 relative of the float64 formula at |scores| ~ 1e5
// for both primitives. The blockwise backward recomputes p = exp(s - m) / l from the forward's
// row max m (one of the scores, exact) and row sum l, not from the float32 lse = m + log l,
// whose rounding (up to 2^-24 |lse|, ~4e-3 at 1e5) would scale a whole row of p and gave dv a
// 2e-3 relative error. The lse a primitive returns is still float32 and carries that rounding:
// callers that merge partial results by their lse (CP strategies that split a call) inherit
// an output error of up to ~2^-24 |lse| relative.
#pragma once

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "hp/attention/masks.h"

namespace hp::attention {

struct AttentionOptions {
  bool causal = false;
  // Where this rank's queries and keys sit in the global sequence (CP). Unset: q_offset 0 and
  // the lengths of q and k. When set, q_len/kv_len must match the tensors (-1: take them).
  std::optional<CausalMetadata> causal_meta;
  std::optional<double> scale;  // default 1/sqrt(Dqk)
  at::Tensor mask;              // optional bool (true = attend) or additive float mask
  std::optional<MaskFunction> mask_fn;
  std::optional<Documents> documents;
  // Blockwise kernel tiling (rows of Q per block, rows of K/V per block).
  int64_t block_q = 256;
  int64_t block_kv = 256;
};

struct AttentionResult {
  at::Tensor out;  // [B, Nq, Sq, Dv]
  at::Tensor lse;  // [B, Nq, Sq], float32 (float64 for double inputs)
};

struct AttentionGrads {
  at::Tensor dq, dk, dv;  // shaped and typed as q, k, v
};

class AttentionPrimitive {
 public:
  virtual ~AttentionPrimitive() = default;
  virtual std::string name() const = 0;
  // Validates its inputs (clear hp::Error before any work) and computes attention.
  virtual AttentionResult forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                  const AttentionOptions& options) const = 0;

  // Optional (where offers_backward_from_stats()): the gradients of q, k, v of one piece of a
  // call whose keys were split into pieces (the blocks of a CP ring), given the merged `out`
  // [B, Nq, Sq, Dv] and `lse` [B, Nq, Sq] of the whole call and its output gradient `dout`:
  //   p = exp(s - lse),  dS = p * (dout v^T - rowsum(dout * out)),  dq = dS k,  dk = dS^T q,
  //   dv = p^T dout   (s the scaled, masked scores of this piece; rows with lse = -inf: zero)
  // Summing dq over the pieces and placing each piece's dk/dv gives the whole call's gradients,
  // with no forward recomputed per piece. `out` may instead be given as its row sums against
  // `dout`, delta = rowsum(dout * out) [B, Nq, Sq] (all the backward reads of it: a caller that
  // moves the statistics to another rank sends that, not the output). `options` describe this
  // piece (causal offsets, masks) as forward() takes them. p is rebuilt from the float32 lse (float
  // inputs), not from the forward's row max and sum: like a merge by lse (above), it carries a
  // relative error of up to ~2^-24 |lse|, which only matters at extreme logit scales (|scores| ~
  // 1e5).
  virtual bool offers_backward_from_stats() const { return false; }
  virtual AttentionGrads backward_from_stats(const at::Tensor& q, const at::Tensor& k,
                                             const at::Tensor& v, const at::Tensor& out,
                                             const at::Tensor& lse, const at::Tensor& dout,
                                             const AttentionOptions& options) const;
};

// Explicit scores, fp32 softmax: the ground truth. O(Sq * Skv) memory.
std::unique_ptr<AttentionPrimitive> make_math_attention();
// Flash-style online softmax over K/V blocks, fp32 accumulators, custom backward recomputing
// from lse: O(S * D) memory. Skips causal blocks above the diagonal and blocks a mask hides.
// Offers backward_from_stats.
std::unique_ptr<AttentionPrimitive> make_blockwise_attention();

// How the blockwise kernels multiply their float tiles in this process: "avx512" (our register-
// blocked kernel, where the CPU has AVX-512F) or "blas" (the process's BLAS; also where the
// environment sets HP_TILE_GEMM=blas). Benchmarks print it beside their figures.
std::string blockwise_tile_gemm_path();
// GFLOP/s of that path on the kernels' own tile shape: [256 x 64] x [64 x 256] products (q k^T
// at D = 64), `reps` of them on each of the calling thread's intra-op threads at once, one
// product per call as the kernels make them; the median of 5 rounds. The roofline the kernels'
// GEMM work could reach on this machine, beside the 2048^3 matmul of the process's BLAS.
double blockwise_tile_gemm_gflops(int reps = 2000);

// Name -> primitive. builtin() holds "math", "blockwise" (and "sdpa" when the found LibTorch
// has at::scaled_dot_product_attention); it is immutable. Make your own registry to add more.
class AttentionRegistry {
 public:
  static const AttentionRegistry& builtin();

  void add(std::unique_ptr<AttentionPrimitive> primitive);
  // Throws hp::Error listing the valid names when `name` is unknown.
  const AttentionPrimitive& get(const std::string& name) const;
  bool contains(const std::string& name) const;
  std::vector<std::string> names() const;

 private:
  std::vector<std::unique_ptr<AttentionPrimitive>> primitives_;
};

}  // namespace hp::attention
