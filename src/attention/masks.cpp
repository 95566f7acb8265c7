#include "hp/attention/masks.h"

#include <ATen/ATen.h>

#include "hp/common/check.h"

namespace hp::attention {

at::Tensor document_ids_from_cu_seqlens(const std::vector<int64_t>& cu, int64_t total) {
  HP_CHECK(cu.size() >= 2 && cu.front() == 0,
           "cu_seqlens must start at 0 and hold at least one document end (0,L1,L1+L2,...); got ",
           cu.size(), " values starting at ", cu.empty() ? -1 : cu.front());
  for (size_t i = 1; i < cu.size(); ++i) {
    HP_CHECK(cu[i] > cu[i - 1], "cu_seqlens must increase strictly: cu_seqlens[", i, "]=", cu[i],
             " after ", cu[i - 1], " (a document has at least one token)");
  }
  HP_CHECK(cu.back() <= total, "cu_seqlens ends at ", cu.back(), " beyond the sequence length ",
           total, "; the last boundary must be <= the sequence length");
  auto ids = at::empty({1, total}, at::kLong);
  auto* out = ids.data_ptr<int64_t>();
  int64_t doc = 0;
  for (int64_t pos = 0; pos < total; ++pos) {
    while (doc + 1 < static_cast<int64_t>(cu.size()) && pos >= cu[doc + 1])
      ++doc;
    out[pos] = doc;  // past the last boundary: doc = cu.size() - 1, the padding document
  }
  return ids;
}

void check_documents(const Documents& d, int64_t batch, int64_t q_len, int64_t kv_len,
                     const char* who) {
  HP_CHECK(d.ids.defined() && d.ids.dim() == 2, who,
           ": documents.ids must be a [B|1, S_total] tensor of document ids, got ",
           d.ids.defined() ? d.ids.dim() : 0, " dims");
  HP_CHECK(!at::isFloatingType(d.ids.scalar_type()) && d.ids.scalar_type() != at::kBool, who,
           ": documents.ids must hold integer ids, got ", c10::toString(d.ids.scalar_type()));
  HP_CHECK(d.ids.size(0) == 1 || d.ids.size(0) == batch, who, ": documents.ids has ", d.ids.size(0),
           " rows for a batch of ", batch, "; give one row per batch row or one");
  const int64_t total = d.ids.size(1);
  HP_CHECK(d.q_start >= 0 && d.q_start + q_len <= total && d.kv_start >= 0 &&
               d.kv_start + kv_len <= total,
           who, ": documents.q_start=", d.q_start, " (", q_len,
           " queries) or kv_start=", d.kv_start, " (", kv_len, " keys) reaches past the ", total,
           " positions of documents.ids; ids must cover the whole (global) sequence");
  if (total > 1) {
    auto ids = d.ids.to(at::kLong);
    HP_CHECK(!ids.slice(1, 1).lt(ids.slice(1, 0, total - 1)).any().item<bool>(), who,
             ": documents.ids decrease along the sequence; packed documents need non-decreasing "
             "ids (number the documents in order, padding last)");
  }
}

bool documents_hide_block(const DocumentIdsView& v, int64_t qb, int64_t qe, int64_t kb,
                          int64_t ke) {
  if (qe <= qb || ke <= kb) return true;
  for (int64_t b = 0; b < v.rows; ++b) {
    const int64_t* a = v.data + b * v.stride;
    // Non-decreasing ids: the ranges share a document iff their id intervals overlap.
    if (!(a[qe - 1] < a[kb] || a[ke - 1] < a[qb])) return false;
  }
  return true;
}

bool documents_fill_block(const DocumentIdsView& v, int64_t qb, int64_t qe, int64_t kb,
                          int64_t ke) {
  for (int64_t b = 0; b < v.rows; ++b) {
    const int64_t* a = v.data + b * v.stride;
    const int64_t doc = a[qb];
    if (a[qe - 1] != doc || a[kb] != doc || a[ke - 1] != doc) return false;
  }
  return true;
}

namespace {

// The ids as a CPU int64 [Bd, S] tensor (no copy when they already are) and its view.
struct CpuIds {
  explicit CpuIds(const Documents& d) : ids(d.ids.to(at::kCPU, at::kLong).contiguous()) {}
  DocumentIdsView view() const { return {ids.data_ptr<int64_t>(), ids.size(0), ids.size(1)}; }
  at::Tensor ids;
};

}  // namespace

bool documents_hide_block(const Documents& d, int64_t qb, int64_t qe, int64_t kb, int64_t ke) {
  return documents_hide_block(CpuIds(d).view(), qb, qe, kb, ke);
}

at::Tensor document_positions(const at::Tensor& ids) {
  HP_CHECK(ids.defined() && ids.dim() == 2, "document_positions: ids must be [B|1, S]");
  auto x = ids.to(at::kCPU, at::kLong).contiguous();
  auto out = at::empty_like(x);
  auto a = x.accessor<int64_t, 2>();
  auto o = out.accessor<int64_t, 2>();
  for (int64_t b = 0; b < x.size(0); ++b) {
    int64_t pos = 0;
    for (int64_t s = 0; s < x.size(1); ++s) {
      pos = (s > 0 && a[b][s] != a[b][s - 1]) ? 0 : (s > 0 ? pos + 1 : 0);
      o[b][s] = pos;
    }
  }
  return out.to(ids.device());
}

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
