// Context parallelism for multi-head latent attention (attention/mla.h): two strategies over
// one core, used by hp-cp-run --attention mla and by the MLA layer.
//
// Shards: rank r of P holds S/P tokens of q [B, S/P, H, dq], latent [B, S/P, R] and k_rope
// [B, S/P, dr] (contiguous; with load_balance the data-order head-tail chunks 2r and 2P-2r-1);
// w_ukv is replicated. The output [B, S/P, H, dv] is in the shard's order. Causal always.
//
//   latent_all_gather  only [latent | k_rope] [B, S/P, R+dr] is all-gathered along the sequence;
//                      each rank up-projects the gathered latent into K/V for every head (its
//                      heads: TP shards them above this level) and attends its local queries
//                      with their causal offset. Backward: the reduce-scatter of the gradient.
//                      Load balance: two query parts over the natural-order keys.
//                      async: the gather starts before the queries exist; queries() runs while
//                      it travels, then each part attends its local keys (the diagonal block),
//                      then the earlier keys once they arrived (merged by log-sum-exp).
//   all_gather         the comparison: K/V expanded locally, then all-gathered (every head),
//                      otherwise as latent_all_gather (load balance, async)
//   ulysses            q, k, v (expanded from the local latent; unequal last dims) packed into
//                      one seq->head all-to-all, causal attention on H/P heads over the whole
//                      sequence, head->seq back. async: K/V's all-to-all starts first and
//                      queries() runs while it travels; q follows in its own all-to-all.
//
// Bytes one rank sends in the forward (e = element size, s = S/P):
//   latent_all_gather  (P-1) * B * s * (R + dr) * e
//   ulysses            B * s * H * (2 dq + dv) * e * (P-1)/P  +  B * s * H * dv * e * (P-1)/P
//   all_gather         (P-1) * B * s * H * (dq + dv) * e
// The backward moves the same bytes back.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <ATen/core/Tensor.h>

#include "hp/attention/mla.h"
#include "hp/cp/config.h"
#include "hp/cp/topology.h"

namespace hp::cp {

struct MLACPOptions {
  std::string strategy = "latent_all_gather";  // latent_all_gather | ulysses | all_gather
  bool load_balance = false;  // head-tail, data order (latent_all_gather, all_gather)
  CPSchedule schedule = CPSchedule::kSync;
  std::string primitive = "blockwise";  // the attention primitive each rank runs
};

const std::vector<std::string>& mla_cp_strategies();  // latent_all_gather, ulysses, all_gather

// Before any collective; rank-independent; messages start with `who` and name the field, the
// value and the fix: the strategy name, heads divisible by cp (ulysses), load balance not with
// ulysses and an even local length, the primitive name.
void check_mla_cp(const std::string& who, const MLACPOptions& options,
                  const attention::MLAShape& shape, int64_t local_seq, int64_t cp_size);

// MLA of this rank's shard. `queries` returns this rank's q shard; it is called exactly once,
// before any collective (sync) or while the first collective travels (async). Outputs and
// every gradient (q, latent, k_rope, w_ukv) equal the single-process attention::mla_attention
// on the whole sequence. The topology's CP group must outlive the graph.
// Packed documents: `doc_ids` [Bd, S] are the global ids (masks.h) of the whole sequence, the
// same on every rank (undefined: one document per row); they are checked before any
// collective, nothing extra travels, and latent_all_gather expands and attends no key that lies
// before its queries' documents.
at::Tensor mla_attention_cp(const std::function<at::Tensor()>& queries, const at::Tensor& latent,
                            const at::Tensor& k_rope, const at::Tensor& w_ukv,
                            const attention::MLAShape& shape, const MLACPOptions& options,
                            const CPTopology& topology, const at::Tensor& doc_ids = {});

// Installs `options` into an MLA layer's host (the interceptor runs mla_attention_cp over the
// topology's CP group). Checks the names before any collective; installing a different
// strategy on the same host is an error. Returns the apply log line.
std::string apply_mla_cp(attention::MLAHost& host, const attention::MLAShape& shape,
                         const std::string& module_path, const MLACPOptions& options,
                         const std::shared_ptr<const CPTopology>& topology);

// The formulas above, per rank; `seq` is the global length S.
int64_t mla_forward_bytes_per_rank(const std::string& strategy, const attention::MLAShape& shape,
                                   int64_t batch, int64_t seq, int64_t cp_size,
                                   int64_t element_size);
int64_t mla_expanded_gather_bytes_per_rank(const attention::MLAShape& shape, int64_t batch,
                                           int64_t seq, int64_t cp_size, int64_t element_size);

namespace detail {
at::Tensor mla_latent_all_gather(const std::function<at::Tensor()>& queries,
                                 const at::Tensor& latent, const at::Tensor& k_rope,
                                 const at::Tensor& w_ukv, const attention::MLAShape& shape,
                                 const MLACPOptions& options, const CPTopology& topology,
                                 const at::Tensor& doc_ids);
at::Tensor mla_ulysses(const std::function<at::Tensor()>& queries, const at::Tensor& latent,
                       const at::Tensor& k_rope, const at::Tensor& w_ukv,
                       const attention::MLAShape& shape, const MLACPOptions& options,
                       const CPTopology& topology, const at::Tensor& doc_ids);
}  // namespace detail

}  // namespace hp::cp
