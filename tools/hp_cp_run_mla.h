// hp-cp-run --attention mla|dsa: MLA's core (attention/mla.h) forward/backward under CP
// (cp/mla.h) over P ranks (threads in this process) on whole-sequence tensors from a
// torch.save file; writes whole-sequence results loadable by torch.load. Causal always.
//
// IN.pt, a dict (BSHD, float32 or float64):
//   q [B, S, H, d_nope + d_rope] (RoPE applied to its last d_rope channels); latent [B, S, R]
//   (after its norm); k_rope [B, S, d_rope] (RoPE applied); w_ukv [H * (d_nope + d_v), R] (per
//   head the d_nope rows of k_nope, then the d_v rows of v); optional dout [B, S, H, d_v]
//   (then gradients). d_rope is k_rope's width, d_nope q's width minus d_rope, kv_rank latent's
//   width, d_v w_ukv's rows / H - d_nope.
// OUT.pt: out [B, S, H, d_v]; with dout also dq, dlatent, dk_rope, dw_ukv (the sum over ranks).
//
// --attention dsa (attention/dsa.h, cp/dsa.h): the same entries plus q_index [B, S, H_I, d_I],
// w_index [B, S, H_I], k_index [B, S, d_I]; --topk N (clamped to S with a note on stderr),
// --index-loss sparse|dense; --cp-algo all_gather (the only DSA strategy) [--schedule]
// [--load-balance]. OUT.pt adds topk_indices [B, S, min(N, S)] (global key positions, -1 where
// fewer are visible), index_loss (scalar, summed over all queries) and, with dout, dq_index,
// dw_index, dk_index (gradients of the index loss only; dout drives the attention's).
// --cp-algo latent_all_gather (default) | ulysses | all_gather (expanded K/V, the comparison);
// --schedule sync|async; --load-balance (head-tail, the shards made by shard_sequence);
// --primitive math|blockwise; --cu-seqlens 0,L1,L1+L2,... (mla only: packed documents, global
// boundaries shared by every batch row; attention stays inside each document).
// stdout: one JSON line: the configuration, comm_bytes_per_rank (counted), comm_bytes_theory
// (cp/mla.h formula, twice with a backward) and the expanded-K/V gather's formula beside it.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace hp_cp_run {

struct MLAArgs {
  std::string input, output;
  int cp_size = 2;
  std::string attention = "mla";  // mla | dsa
  std::string strategy = "latent_all_gather", schedule = "sync", primitive = "blockwise";
  bool load_balance = false;
  int64_t topk = 2048;                // dsa
  std::string index_loss = "sparse";  // dsa
  std::vector<int64_t> cu_seqlens;    // mla: packed documents (empty: none)
};

int run_mla(const MLAArgs& m);

}  // namespace hp_cp_run
