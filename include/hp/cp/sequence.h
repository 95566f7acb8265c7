// Sequence sharding for CP (DESIGN section 5.4): which positions each CP rank holds.
//
// Without load balance rank r holds the contiguous slice r of P. With head-tail load balance
// the sequence is cut into 2P chunks and rank r holds chunks {2r, 2P-2r-1} (in that order), so
// every rank does the same causal work. Inputs, labels and position ids are sharded the same
// way; position ids are what RoPE needs (global positions).
#pragma once

#include <cstdint>
#include <vector>

#include <ATen/core/Tensor.h>

namespace hp::cp {

// Chunk ids (of 2P) rank r holds under load balance: {2r, 2P-2r-1}.
std::vector<int64_t> load_balance_chunks(int64_t cp_rank, int64_t cp_size);

// This rank's part of `full` along seq_dim. The length must divide by cp_size (2*cp_size with
// load balance): pad first (pad_sequence / shard_batch).
at::Tensor shard_sequence(const at::Tensor& full, int64_t seq_dim, int64_t cp_rank, int64_t cp_size,
                          bool load_balance);

// Inverse: every rank's shard (in rank order) back to the natural order.
at::Tensor unshard_sequence(const std::vector<at::Tensor>& shards, int64_t seq_dim,
                            bool load_balance);

// Pads `t` along seq_dim to a multiple of `multiple` with `value`.
at::Tensor pad_sequence(const at::Tensor& t, int64_t seq_dim, int64_t multiple, double value);

struct ShardedBatch {
  at::Tensor input_ids;     // [B, S_local]
  at::Tensor labels;        // [B, S_local], -100 on padding
  at::Tensor position_ids;  // [B, S_local], global positions (continuing into the padding), or
                            // with documents the position within each document
  // Packed documents only: [B, S_padded] ids of the *whole* padded sequence (not sharded:
  // attention needs the documents of the keys other ranks hold too; the padding is one more
  // document), and this rank's shard of them.
  at::Tensor doc_ids;
  at::Tensor local_doc_ids;
  int64_t padded_len = 0;  // global length after padding
};

// Pads [B, S] ids/labels to a multiple of cp_size (2*cp_size with load balance) - ids with 0,
// labels with -100, positions continuing - and returns this rank's shard of each. With
// `doc_ids` ([B, S], non-decreasing per row: packed documents) the padding becomes a document of
// its own, positions restart at 0 in every document, and the ids are returned as well.
ShardedBatch shard_batch(const at::Tensor& input_ids, const at::Tensor& labels, int64_t cp_rank,
                         int64_t cp_size, bool load_balance, const at::Tensor& doc_ids = {});

}  // namespace hp::cp
