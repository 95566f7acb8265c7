#include "sharded_param.h"

#include <algorithm>

#include <ATen/ATen.h>
#include <c10/core/CPUAllocator.h>
#include <c10/core/StorageImpl.h>

#include "hp/common/check.h"

namespace hp::hsdp::detail {

int64_t ShardedParam::valid_rows(int64_t shard_rank) const {
  return std::clamp<int64_t>(rows - shard_rank * chunk_rows, 0, chunk_rows);
}

void check_shardable(const std::string& name, const at::Tensor& full) {
  HP_CHECK(full.defined(), "fully_shard: parameter '", name, "' is undefined");
  HP_CHECK(full.is_leaf(), "fully_shard: parameter '", name,
           "' is not a leaf tensor (computed from others); list the module's registered "
           "parameters");
  HP_CHECK(full.requires_grad(), "fully_shard: parameter '", name,
           "' does not require grad (frozen): HSDP shards parameters it trains; unfreeze it "
           "(requires_grad_(true)) before sharding, or keep it out of the units");
  HP_CHECK(full.storage().nbytes() > 0, "fully_shard: parameter '", name,
           "' holds no memory: it is already sharded by another FullyShard (a model is sharded "
           "once; build a new model to shard it again)");
  HP_CHECK(full.dim() >= 1, "fully_shard: parameter '", name,
           "' is a 0-d scalar; register it with shape [1]");
}

ShardedParam make_sharded(const std::string& name, const at::Tensor& full, int64_t shard_rank,
                          int64_t shard_size, bool tp_partial_grad) {
  check_shardable(name, full);
  ShardedParam p;
  p.name = name;
  p.full = full;
  p.rows = full.size(0);
  p.row_numel = full.numel() / std::max<int64_t>(1, p.rows);
  p.chunk_rows = (p.rows + shard_size - 1) / shard_size;
  p.tp_partial_grad = tp_partial_grad;
  at::NoGradGuard no_grad;
  auto sizes = full.sizes().vec();
  sizes[0] = p.chunk_rows;
  auto shard = at::zeros(sizes, full.options().requires_grad(false));
  const int64_t valid = p.valid_rows(shard_rank);
  if (valid > 0) {
    shard.narrow(0, 0, valid).copy_(full.detach().narrow(0, shard_rank * p.chunk_rows, valid));
  }
  p.shard = shard.requires_grad_(true);
  // The module's tensor gets its own contiguous memory (it may have been a view), then frees it.
  full.set_data(full.detach().clone(at::MemoryFormat::Contiguous));
  release(full);
  return p;
}

namespace {
c10::StorageImpl* storage_of(const at::Tensor& t) {
  return t.storage().unsafeGetStorageImpl();
}
}  // namespace

bool is_allocated(const at::Tensor& full) {
  return storage_of(full)->nbytes() > 0;
}

void allocate(const at::Tensor& full) {
  auto* s = storage_of(full);
  const size_t nbytes = static_cast<size_t>(full.numel()) * full.element_size();
  if (s->nbytes() == nbytes) return;
  auto* allocator = s->allocator() ? s->allocator() : c10::GetAllocator(full.device().type());
  s->set_data_ptr(allocator->allocate(nbytes));
  s->set_nbytes(nbytes);
}

void release(const at::Tensor& full) {
  auto* s = storage_of(full);
  s->set_data_ptr(at::DataPtr(nullptr, full.device()));
  s->set_nbytes(0);
}

at::Tensor raw_view(const at::Tensor& full) {
  HP_INTERNAL_ASSERT(is_allocated(full), "alias of a released parameter");
  return at::from_blob(storage_of(full)->data(), full.sizes(), full.strides(),
                       full.options().requires_grad(false));
}

void copy_in(ShardedParam& p, const at::Tensor& gathered, int64_t offset) {
  allocate(p.full);
  auto dst = raw_view(p.full).view({p.rows, p.row_numel});
  const int64_t sd = gathered.size(0);
  for (int64_t s = 0; s < sd; ++s) {
    const int64_t valid = p.valid_rows(s);
    if (valid == 0) break;
    dst.narrow(0, s * p.chunk_rows, valid)
        .copy_(gathered[s].narrow(0, offset, valid * p.row_numel).view({valid, p.row_numel}));
  }
}

at::Tensor padded_grad(const ShardedParam& p, const at::Tensor& grad, int64_t shard_size,
                       at::ScalarType dtype) {
  auto out = at::zeros({shard_size * p.chunk_rows, p.row_numel}, p.full.options().dtype(dtype));
  if (grad.defined()) out.narrow(0, 0, p.rows).copy_(grad.reshape({p.rows, p.row_numel}));
  return out.view({shard_size, p.shard_numel()});
}

}  // namespace hp::hsdp::detail
