#include "hp/attention/masks.h"

#include <ATen/ATen.h>

#include "hp/common/check.h"

namespace hp::attention {

MaskFunction sliding_window_mask(int64_t window) {
  HP_CHECK(window >= 1, "sliding_window_mask: window=", window, " must be >= 1");
  MaskFunction m;
  m.fn = [window](const at::Tensor&, const at::Tensor&, const at::Tensor& q, const at::Tensor& kv) {
    return at::logical_and(kv.le(q), kv.gt(q - window));
  };
  return m;
}

MaskFunction document_mask(const at::Tensor& doc_ids) {
  HP_CHECK(doc_ids.defined() && doc_ids.dim() == 1,
           "document_mask: doc_ids must be a 1-d "
           "tensor with one document id per position");
  auto ids = doc_ids.to(at::kLong).contiguous();
  MaskFunction m;
  m.fn = [ids](const at::Tensor&, const at::Tensor&, const at::Tensor& q, const at::Tensor& kv) {
    HP_CHECK(q.max().item<int64_t>() < ids.size(0) && kv.max().item<int64_t>() < ids.size(0),
             "document_mask: a position is beyond doc_ids (", ids.size(0), " ids)");
    return ids.index({q.flatten()}).view(q.sizes()).eq(ids.index({kv.flatten()}).view(kv.sizes()));
  };
  return m;
}

}  // namespace hp::attention
