// Multi-head latent attention (DeepSeek-V3 MLA) after its projections: the core that CP
// strategies move data around (cp/mla.h) and the single-process form of it.
//
//   q       [B, Sq, H, d_nope + d_rope]   RoPE already applied to the last d_rope channels
//   latent  [B, Skv, R]                   the compressed KV (after its RMSNorm), R = kv_rank
//   k_rope  [B, Skv, d_rope]              one rotated key part shared by every head
//   w_ukv   [H * (d_nope + d_v), R]       per head h: rows [h*(dn+dv), +dn) give k_nope,
//                                         the next d_v rows give v
//   k_h = [latent W_k,h^T | k_rope]  [Skv, dn+dr];  v_h = latent W_v,h^T  [Skv, dv]
//   out_h = softmax(q_h k_h^T * scale + causal) v_h,  scale = 1/sqrt(d_nope + d_rope)
//   out     [B, Sq, H, d_v]
// Causal positions: query i sits at q_offset + i, key j at j (j <= q_offset + i is visible).
// Packed documents (masks.h): with `doc_ids` [Bd, S_total] (the global document id of every
// position) a key is visible only inside its query's document as well; the CP strategies pass the
// global ids and set each call's global q_start / kv_start.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>

#include <ATen/core/Tensor.h>

#include "hp/attention/attention.h"

namespace hp::attention {

struct MLAShape {
  int64_t heads = 4;
  int64_t d_nope = 32;
  int64_t d_rope = 16;
  int64_t d_v = 32;
  int64_t kv_rank = 64;
  int64_t qk_dim() const { return d_nope + d_rope; }
  // Every size positive; `who` starts the message.
  void check(const std::string& who) const;
  // The shape the tensors describe (heads from q, the rest from q, latent, k_rope and w_ukv);
  // throws naming the tensor whose size disagrees.
  static MLAShape of(const at::Tensor& q, const at::Tensor& latent, const at::Tensor& k_rope,
                     const at::Tensor& w_ukv, int64_t d_v, const std::string& who);
};

// Keys and values of heads [first, first + n) for the tokens of `latent` / `k_rope`, BNSD:
// k [B, n, S, d_nope + d_rope], v [B, n, S, d_v].
struct MLAKeys {
  at::Tensor k, v;
};
MLAKeys mla_expand(const at::Tensor& latent, const at::Tensor& k_rope, const at::Tensor& w_ukv,
                   const MLAShape& shape, int64_t first_head, int64_t num_heads);

// Attention of q (BSHD, the heads of `keys`) against `keys`, causal with `q_offset` (the
// position of q's first row relative to the keys' first row), or unmasked when !causal;
// `documents` (optional, global ids with this call's q_start / kv_start) hides keys of other
// documents, and the primitive skips the tiles they hide entirely.
// Returns {out [B, n, Sq, d_v] (BNSD), lse [B, n, Sq]} for merges by log-sum-exp.
AttentionResult mla_attend(const at::Tensor& q, const MLAKeys& keys, const MLAShape& shape,
                           bool causal, int64_t q_offset, const AttentionPrimitive& primitive,
                           const std::optional<Documents>& documents = std::nullopt);

// The whole single-process core: causal MLA of q over the latent, out [B, S, H, d_v]; with
// `doc_ids` [Bd, S] attention stays inside each document.
at::Tensor mla_attention(const at::Tensor& q, const at::Tensor& latent, const at::Tensor& k_rope,
                         const at::Tensor& w_ukv, const MLAShape& shape,
                         const std::string& primitive = "blockwise",
                         const at::Tensor& doc_ids = {});

// The model-facing surface CP hooks into for MLA layers (as host.h for softmax attention): a
// layer calls host.attend(queries, latent, k_rope, w_ukv, shape); with nothing installed that
// is mla_attention(queries(), ...) on the local tokens, and a CP strategy (cp/mla.h) installs an
// interceptor that moves the latent (or Q/K/V) around the core. `queries` produces the layer's
// q; an async interceptor calls it while its first collective travels. `doc_ids` is undefined
// (one document per row) or the global [Bd, S_total] document ids of packed sequences.
using MLAQueries = std::function<at::Tensor()>;

class MLAInterceptor {
 public:
  virtual ~MLAInterceptor() = default;
  virtual std::string id() const = 0;
  virtual at::Tensor attend(const MLAQueries& queries, const at::Tensor& latent,
                            const at::Tensor& k_rope, const at::Tensor& w_ukv,
                            const MLAShape& shape, const at::Tensor& doc_ids) = 0;
};

class MLAHost {
 public:
  explicit MLAHost(std::string primitive = "blockwise") : primitive_(std::move(primitive)) {}
  // A second interceptor with another id is an error; the same id again is a no-op.
  void install(std::shared_ptr<MLAInterceptor> interceptor);
  MLAInterceptor* installed() const { return interceptor_.get(); }
  at::Tensor attend(const MLAQueries& queries, const at::Tensor& latent, const at::Tensor& k_rope,
                    const at::Tensor& w_ukv, const MLAShape& shape, const at::Tensor& doc_ids = {});

 private:
  std::string primitive_;
  std::shared_ptr<MLAInterceptor> interceptor_;
};

}  // namespace hp::attention
