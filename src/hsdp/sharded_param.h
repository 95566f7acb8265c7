// One parameter under HSDP: its dim-0 shard (the optimizer's leaf) and the module's full-shape
// tensor whose memory is allocated only while the unit is gathered.
//
//   full  [rows, rest...]  -- padded to Sd*c rows -->  Sd chunks of [c, rest...]
//   shard s = rows [s*c, (s+1)*c) (zero rows past `rows`)
//
// The full tensor keeps its TensorImpl (autograd saved it in forward); only its storage is
// freed and re-allocated, and data is written through an alias, so no version counter moves.
#pragma once

#include <cstdint>
#include <memory>
#include <string>

#include <ATen/core/Tensor.h>

namespace torch::autograd {
struct Node;
}

namespace hp::hsdp::detail {

struct ShardedParam {
  std::string name;
  at::Tensor full;   // the module's parameter (leaf, full TP-local shape)
  at::Tensor shard;  // [c, rest...] leaf; holds the reduced gradient after a backward
  int64_t rows = 0, chunk_rows = 0, row_numel = 0;
  bool tp_partial_grad = false;
  std::shared_ptr<torch::autograd::Node> accumulator;  // kept alive: our post hook lives on it

  int64_t shard_numel() const { return chunk_rows * row_numel; }
  int64_t full_numel() const { return rows * row_numel; }
  int64_t valid_rows(int64_t shard_rank) const;
};

// Throws unless `full` can be sharded: a defined leaf that requires grad, holding memory (not
// sharded already), at least 1-d. FullyShard checks every parameter before it shards any.
void check_shardable(const std::string& name, const at::Tensor& full);

// Builds the shard of `full` for `shard_rank` of `shard_size` and frees `full`'s memory.
ShardedParam make_sharded(const std::string& name, const at::Tensor& full, int64_t shard_rank,
                          int64_t shard_size, bool tp_partial_grad);

bool is_allocated(const at::Tensor& full);
void allocate(const at::Tensor& full);
void release(const at::Tensor& full);
// A tensor over `full`'s current memory that shares neither autograd state nor version counter.
at::Tensor raw_view(const at::Tensor& full);

// Writes the gathered rows into `p.full` (allocating it): `gathered` is [Sd, n] and
// p's chunk from shard rank s sits at gathered[s, offset : offset + shard_numel].
void copy_in(ShardedParam& p, const at::Tensor& gathered, int64_t offset);

// The full gradient as [Sd, shard_numel] (padding rows zero), in `dtype`; zeros when undefined.
at::Tensor padded_grad(const ShardedParam& p, const at::Tensor& grad, int64_t shard_size,
                       at::ScalarType dtype);

}  // namespace hp::hsdp::detail
