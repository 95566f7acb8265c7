// DeepSeek sparse attention (V3.2 style) after its projections: the lightning indexer, top-k
// selection, MLA in its shared-latent (MQA) form over the selected keys, and the indexer's KL
// loss. What cp/dsa.h runs on each rank (with the keys gathered) and the single-process form.
//
//   indexer    q_I [B, Sq, H_I, d_I], w [B, Sq, H_I], k_I [B, Skv, d_I] (one key per token):
//              I[t, s] = sum_j w[t, j] * relu(q_I[t, j] . k_I[s])   for s <= q_offset + t
//   selection  per query the top-k keys by I (every visible key when fewer), ties to the lower
//              position; indices [B, Sq, k] int64, ascending, -1 past the visible count; not
//              differentiated
//   attention  MLA (attention/mla.h shapes) over the selected keys only, in the absorbed form:
//              q_abs,h = [q_nope,h W_k,h | q_rope,h]  [R + dr];  kv_s = [latent_s | k_rope_s];
//              p = softmax(q_abs . kv_s * scale) over the selection; o_h = (p latent) W_v,h^T
//              (the same numbers as the expanded form, scale 1/sqrt(d_nope + d_rope))
//   loss       sum over queries t of KL(p_t || softmax(I[t, sel_t])), p_t the attention
//              distribution summed over heads and L1-normalised (a constant: the indexer learns
//              only from this loss, and the loss moves nothing but q_I, w and k_I)
//   variants   loss "sparse": attention and loss over the top-k selection; "dense" (indexer
//              warm-up): attention and loss over every visible key (the top-k is still reported)
// Layouts: given the same inputs, the selection is the same in every layout (CP ranks score
// other key widths; the scores of a key do not depend on them). In float32 a model's indexer
// inputs themselves differ between layouts in their last bits (a GEMM rounds a row by where it
// falls in its blocking), and two keys that tie in exact arithmetic (a repeated token) may then
// order differently: float32 DSA under CP can select other keys than the single-process run
// where scores tie. float64 inputs select identically (the tests hold it to that).
// Memory: no [Sq, Skv] tensor; the indexer scores and the attention run in query blocks; the
// attention's backward recomputes each query's scores from the forward's lse, and the loss's
// gradients are computed with it (it is a scalar).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include <ATen/core/Tensor.h>

#include "hp/attention/mla.h"

namespace hp::attention {

struct DSAOptions {
  int64_t topk = 2048;
  std::string loss = "sparse";  // sparse | dense
  int64_t block_q = 16;         // query rows per block
  // BSND: q [B, S, H, dq], q_I [B, S, H_I, d_I], w [B, S, H_I], out [B, S, H, d_v] (the
  // shapes below). BNSD: the heads before the sequence in those four (q [B, H, S, dq], q_I
  // [B, H_I, S, d_I], w [B, H_I, S], out [B, H, S, d_v]); latent, k_rope, k_I and the indices
  // have no head dim and are [B, S, ...] in both. Anything else is refused by check().
  std::string layout = "BSND";
  // Every name and size checked; `who` starts the message.
  void check(const std::string& who) const;
};

// The indexer inputs: query, weights and the (gathered) keys.
struct DSAIndexer {
  at::Tensor q, w, k;  // [B, Sq, H_I, d_I], [B, Sq, H_I], [B, Skv, d_I]
};

// BNSD inputs as the BSND views the kernels take (q or q_I [B, N, S, d] -> [B, S, N, d], w
// [B, N, S] -> [B, S, N]; a BSND tensor as it is), and an output back to `layout`.
at::Tensor dsa_bsnd_view(const at::Tensor& t, const std::string& layout);
DSAIndexer dsa_bsnd_view(const DSAIndexer& index, const std::string& layout);

// Top-k selection of queries at global positions q_offset.. against keys 0..Skv-1: indices
// [B, Sq, min(topk, Skv)].
at::Tensor dsa_select(const DSAIndexer& index, int64_t q_offset, int64_t topk, int64_t block_q);
// Every visible key (the dense variant's "selection"): [B, Sq, min(Skv, q_offset + Sq)].
at::Tensor dsa_all_visible(int64_t batch, int64_t sq, int64_t skv, int64_t q_offset);

struct DSAResult {
  at::Tensor out;      // [B, Sq, H, d_v]
  at::Tensor loss;     // scalar: the indexer loss summed over this call's queries
  at::Tensor indices;  // [B, Sq, min(topk, Skv)]: the selection (key positions, -1 pad)
};

// One call: q [B, Sq, H, dq] (RoPE applied) at global positions q_offset.., the keys' latent
// [B, Skv, R] and k_rope [B, Skv, dr] at positions 0.., w_ukv; the indexer. Differentiable:
// out in q, latent, k_rope, w_ukv; loss in index.q, index.w, index.k.
DSAResult dsa_attention(const at::Tensor& q, const at::Tensor& latent, const at::Tensor& k_rope,
                        const at::Tensor& w_ukv, const MLAShape& shape, const DSAIndexer& index,
                        int64_t q_offset, const DSAOptions& options);

// The pieces dsa_attention is made of (public for CP and tests).
// q_abs [B, Sq, H, R + dr] (the absorbed query) from q and w_ukv.
at::Tensor dsa_absorb_queries(const at::Tensor& q, const at::Tensor& w_ukv, const MLAShape& shape);
// Sparse MQA attention: out [B, Sq, H, R] (latent space) and the head-mean distribution
// p_mean [B, Sq, k] (not differentiated). kv [B, Skv, R + dr]; its first R columns are the values.
void dsa_sparse_mqa(const at::Tensor& q_abs, const at::Tensor& kv, const at::Tensor& indices,
                    int64_t value_dim, double scale, int64_t block_q, at::Tensor& out,
                    at::Tensor& p_mean);
// The indexer loss over `indices` with targets p [B, Sq, k] (rows sum to 1 over the valid keys).
at::Tensor dsa_indexer_loss(const DSAIndexer& index, const at::Tensor& indices, const at::Tensor& p,
                            int64_t block_q);

// What a DSA layer computes after its keys: the queries (RoPE applied) and the indexer's
// queries and weights, in the options' layout. The host runs it once, after the keys (the
// latent, k_rope and the index keys) are handed over: under async CP their gathers are then on
// their way while these projections run (the handoff point of the all-gather family).
struct DSAQueries {
  at::Tensor q, index_q, index_w;
};
using DSAQueriesFn = std::function<DSAQueries()>;

// The model-facing surface CP hooks into for DSA layers (as MLAHost for MLA): with nothing
// installed, dsa_attention on the local tokens (q_offset 0); cp/dsa.h installs its strategy.
class DSAInterceptor {
 public:
  virtual ~DSAInterceptor() = default;
  virtual std::string id() const = 0;
  virtual DSAResult attend(const DSAQueriesFn& queries, const at::Tensor& latent,
                           const at::Tensor& k_rope, const at::Tensor& w_ukv, const MLAShape& shape,
                           const at::Tensor& index_k, const DSAOptions& options) = 0;
};

class DSAHost {
 public:
  // A second interceptor with another id is an error; the same id again is a no-op.
  void install(std::shared_ptr<DSAInterceptor> interceptor);
  DSAInterceptor* installed() const { return interceptor_.get(); }
  DSAResult attend(const DSAQueriesFn& queries, const at::Tensor& latent, const at::Tensor& k_rope,
                   const at::Tensor& w_ukv, const MLAShape& shape, const at::Tensor& index_k,
                   const DSAOptions& options);

 private:
  std::shared_ptr<DSAInterceptor> interceptor_;
};

}  // namespace hp::attention
