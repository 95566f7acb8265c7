// Context parallelism for DSA (attention/dsa.h), the all-gather family of the source design:
// the index keys k_I [B, S/P, d_I] and [latent | k_rope] [B, S/P, R + dr] are all-gathered
// along the sequence, once each (every consumer in the layer reads the one gathered tensor and
// its gradient is reduce-scattered once); each rank scores its local queries against every
// visible global key with its causal offset, selects the top-k, runs the sparse attention and
// the indexer loss on its queries. Head-tail load balance (data-order shards: two query parts
// with their offsets over the natural-order keys) and async (the gathers start first; the
// layer's query projections and their absorption into the latent space run while they travel)
// are both supported.
//
//   k_I     --all-gather--> [B, S, d_I]        selection + loss (gradient: reduce-scatter)
//   latent | k_rope --all-gather--> [B, S, R + dr]   sparse attention (gradient: reduce-scatter)
//   per query part (offset o): select(q_I, w, k_I[0, S)) -> sparse MQA -> out, p -> loss
//
// Bytes one rank sends in the forward: (P-1) * B * S/P * (d_I + R + dr) * e; the backward the
// same again. The loss returned is this rank's share (sum over its queries); the sum over
// ranks is the single-process loss. Outputs, the loss and every gradient equal
// attention::dsa_attention on the whole sequence.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include <ATen/core/Tensor.h>

#include "hp/attention/dsa.h"
#include "hp/cp/config.h"
#include "hp/cp/topology.h"

namespace hp::cp {

struct DSACPOptions {
  bool load_balance = false;  // head-tail, data order
  CPSchedule schedule = CPSchedule::kSync;
};

// Before any collective: the DSA options, the shapes of this rank's shard, the local length
// (even with load balance), the layout (BSND, q [B, S/P, H, dq]; BNSD is read as a BSND view).
void check_dsa_cp(const std::string& who, const attention::DSAOptions& dsa,
                  const DSACPOptions& options, const at::Tensor& q, const at::Tensor& latent,
                  const at::Tensor& k_rope, const attention::DSAIndexer& index, int64_t cp_size);

// This rank's shard of every input (q, latent, k_rope, index.q, index.w, index.k: [B, S/P, ...]);
// w_ukv replicated. indices are global key positions.
attention::DSAResult dsa_attention_cp(const at::Tensor& q, const at::Tensor& latent,
                                      const at::Tensor& k_rope, const at::Tensor& w_ukv,
                                      const attention::MLAShape& shape,
                                      const attention::DSAIndexer& index,
                                      const attention::DSAOptions& dsa, const DSACPOptions& options,
                                      const CPTopology& topology);

// The same with the queries computed by `queries` after the keys (latent, k_rope, index_k) are
// handed over, as a DSA layer's host runs it: async starts both gathers first, so they travel
// while the layer projects its queries (its handoff point); sync computes the queries first.
// The keys are checked before any collective; the queries with them, before any collective
// under sync and as soon as they exist under async.
attention::DSAResult dsa_attention_cp(const attention::DSAQueriesFn& queries,
                                      const at::Tensor& latent, const at::Tensor& k_rope,
                                      const at::Tensor& w_ukv, const attention::MLAShape& shape,
                                      const at::Tensor& index_k, const attention::DSAOptions& dsa,
                                      const DSACPOptions& options, const CPTopology& topology);

// Installs DSA CP into a DSA layer's host (the interceptor runs dsa_attention_cp over the
// topology's CP group). Returns the apply log line.
std::string apply_dsa_cp(attention::DSAHost& host, const std::string& module_path,
                         const DSACPOptions& options,
                         const std::shared_ptr<const CPTopology>& topology);

int64_t dsa_forward_bytes_per_rank(const attention::MLAShape& shape, int64_t index_dim,
                                   int64_t batch, int64_t seq, int64_t cp_size,
                                   int64_t element_size);

}  // namespace hp::cp
