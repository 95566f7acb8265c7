// Mask vocabulary of the attention layer: causal metadata and flex-style mask functions.
#pragma once

#include <cstdint>
#include <functional>
#include <vector>

#include <ATen/core/Tensor.h>

namespace hp::attention {

// Key j (kv index in [0, kv_len)) is visible to local query i (in [0, q_len)) iff
// j <= q_offset + i. Under CP q_offset > 0 and q_len < kv_len are normal.
struct CausalMetadata {
  int64_t q_offset = 0;
  int64_t q_len = -1;   // -1: the query length of the tensors
  int64_t kv_len = -1;  // -1: the key length of the tensors
};

// A flex-style mask function, vectorised: it receives int64 index tensors that broadcast
// against each other (b [Bb,1,1,1], h [1,Hb,1,1], q_idx [1,1,bq,1], kv_idx [1,1,1,bk]; indices
// are *global* within the tensors passed to the primitive) and returns a bool tensor
// broadcastable to their common shape, true = attend.
// per_batch / per_head: false when the mask does not depend on b / h (evaluated once and
// broadcast, which is much cheaper).
struct MaskFunction {
  std::function<at::Tensor(const at::Tensor& b, const at::Tensor& h, const at::Tensor& q_idx,
                           const at::Tensor& kv_idx)>
      fn;
  bool per_batch = false;
  bool per_head = false;
  // Added to q_idx / kv_idx before calling fn: lets CP evaluate a mask written for global
  // positions on a local shard.
  int64_t q_index_offset = 0;
  int64_t kv_index_offset = 0;
  int64_t head_index_offset = 0;  // likewise for h (Ulysses keeps a slice of the heads)
};

// Packed sequences: documents laid end to end in one sequence; key j is visible to query i only
// when both lie in the same document (on top of causal and any other mask).
//   ids      [Bd, S_total] int64 (Bd = 1 or the batch), the document id of every *global*
//            position, non-decreasing along the sequence (padding is a document of its own).
//   q_start  global position of the call's first query row; kv_start likewise for its keys.
// A single-process call leaves both starts 0 (S_total = the sequence). Under CP the caller
// passes the ids of the whole global sequence and the strategy's adapter sets the starts for
// each block it computes, so every strategy sees the same documents. Because the ids never
// decrease, a tile's documents are known from its corner ids: tiles that no document spans are
// skipped (never computed), tiles inside one document run unmasked.
struct Documents {
  at::Tensor ids;
  int64_t q_start = 0;
  int64_t kv_start = 0;
};

// ids [1, total] from cumulative document boundaries {0, L1, L1+L2, ..., total} (FlashAttention's
// cu_seqlens); positions past the last boundary (< total) form one more document (padding).
at::Tensor document_ids_from_cu_seqlens(const std::vector<int64_t>& cu_seqlens, int64_t total);
// Checks `d` for a call with `batch` rows, q_len queries and kv_len keys; `who` starts messages.
void check_documents(const Documents& d, int64_t batch, int64_t q_len, int64_t kv_len,
                     const char* who);
// Whether the documents hide every (query, key) pair of queries [q_begin, q_end) x keys
// [kv_begin, kv_end) (global positions) in every batch row: no document spans both ranges.
bool documents_hide_block(const Documents& d, int64_t q_begin, int64_t q_end, int64_t kv_begin,
                          int64_t kv_end);
// The same on ids already in CPU int64 row-major memory ([rows, stride]), for per-tile loops,
// and whether both ranges lie inside one and the same document in every batch row.
struct DocumentIdsView {
  const int64_t* data = nullptr;
  int64_t rows = 0, stride = 0;
};
bool documents_hide_block(const DocumentIdsView& ids, int64_t q_begin, int64_t q_end,
                          int64_t kv_begin, int64_t kv_end);
bool documents_fill_block(const DocumentIdsView& ids, int64_t q_begin, int64_t q_end,
                          int64_t kv_begin, int64_t kv_end);
// Position within its document of every position: [Bd, S_total] int64 (what RoPE takes when
// positions restart per document).
at::Tensor document_positions(const at::Tensor& ids);

// Key within `window` positions behind the query (and not ahead of it): q - window < kv <= q.
MaskFunction sliding_window_mask(int64_t window);

// Packed sequences: attend only within the same document. doc_ids [S] int64, one id per
// position (queries and keys index the same packed sequence).
MaskFunction document_mask(const at::Tensor& doc_ids);

// The block mask of `fn` for a [batch, heads, q_len, kv_len] problem tiled block_q x block_kv:
// a [num_q_blocks, num_kv_blocks] uint8 tensor, 0 = every entry hidden (the tile is skipped),
// 1 = partly visible (masked elementwise), 2 = fully visible (no masking). With causal = true
// (and q_offset) the causal rule is folded in. The blockwise primitive builds exactly this.
at::Tensor block_mask(const MaskFunction& fn, int64_t batch, int64_t heads, int64_t q_len,
                      int64_t kv_len, int64_t block_q, int64_t block_kv, bool causal = false,
                      int64_t q_offset = 0);

}  // namespace hp::attention
