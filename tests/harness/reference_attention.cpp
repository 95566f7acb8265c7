#include "reference_attention.h"

#include <cmath>
#include <limits>

#include <ATen/ATen.h>

#include "hp/common/check.h"
#include "hp/common/shape.h"

namespace hp::testing {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// causal[i][j] = (j <= q_offset + i), entry by entry.
at::Tensor causal_visibility(int64_t q_len, int64_t kv_len, int64_t q_offset) {
  auto c = at::empty({q_len, kv_len}, at::kBool);
  auto a = c.accessor<bool, 2>();
  for (int64_t i = 0; i < q_len; ++i) {
    for (int64_t j = 0; j < kv_len; ++j) {
      a[i][j] = j <= q_offset + i;
    }
  }
  return c;
}

// The kv head query head h reads: h / (Nq / Nkv).
at::Tensor kv_head_of_query_head(int64_t q_heads, int64_t kv_heads) {
  auto idx = at::empty({q_heads}, at::kLong);
  auto a = idx.accessor<int64_t, 1>();
  for (int64_t h = 0; h < q_heads; ++h) {
    a[h] = h / (q_heads / kv_heads);
  }
  return idx;
}

}  // namespace

ReferenceAttention reference_attention(const at::Tensor& q, const at::Tensor& k,
                                       const at::Tensor& v,
                                       const attention::AttentionOptions& options) {
  HP_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4,
           "reference_attention: q, k, v must be 4-d BNSD; got q ", common::shape_str(q.sizes()),
           ", k ", common::shape_str(k.sizes()), ", v ", common::shape_str(v.sizes()));
  const int64_t batch = q.size(0), q_heads = q.size(1), q_len = q.size(2), qk_dim = q.size(3);
  const int64_t kv_heads = k.size(1), kv_len = k.size(2);
  HP_CHECK(k.size(0) == batch && v.size(0) == batch && k.size(3) == qk_dim &&
               v.size(1) == kv_heads && v.size(2) == kv_len,
           "reference_attention: q ", common::shape_str(q.sizes()), ", k ",
           common::shape_str(k.sizes()), ", v ", common::shape_str(v.sizes()),
           " do not fit q [B, Nq, Sq, Dqk], k [B, Nkv, Skv, Dqk], v [B, Nkv, Skv, Dv]");
  HP_CHECK(kv_heads >= 1 && q_heads % kv_heads == 0, "reference_attention: Nq=", q_heads,
           " is not a multiple of Nkv=", kv_heads);
  HP_CHECK(q_len >= 1 && kv_len >= 1, "reference_attention: Sq=", q_len, " and Skv=", kv_len,
           " must be >= 1");
  HP_CHECK(!options.documents,
           "reference_attention: documents are checked by reference_packed_attention");
  const double scale = options.scale.value_or(1.0 / std::sqrt(static_cast<double>(qk_dim)));
  const int64_t sizes[] = {batch, q_heads, q_len, kv_len};

  // GQA: the kv head of every query head, gathered (a copy is fine here).
  const auto kv_head = kv_head_of_query_head(q_heads, kv_heads);
  auto kh = k.to(at::kDouble).index_select(1, kv_head);                  // [B, Nq, Skv, Dqk]
  auto vh = v.to(at::kDouble).index_select(1, kv_head);                  // [B, Nq, Skv, Dv]
  auto s = at::matmul(q.to(at::kDouble), kh.transpose(-2, -1)) * scale;  // [B, Nq, Sq, Skv]

  auto visible = at::ones(sizes, at::kBool);
  if (options.causal) {
    const int64_t q_offset = options.causal_meta ? options.causal_meta->q_offset : 0;
    visible = at::logical_and(visible, causal_visibility(q_len, kv_len, q_offset));
  }
  if (options.mask.defined()) {
    if (options.mask.scalar_type() == at::kBool) {
      visible = at::logical_and(visible, options.mask.expand(sizes));
    } else {
      auto additive = options.mask.to(at::kDouble).expand(sizes);
      s = s + additive;
      visible = at::logical_and(visible, additive.ne(-kInf));
    }
  }
  if (options.mask_fn) {
    const auto& mf = *options.mask_fn;
    const auto idx = at::TensorOptions().dtype(at::kLong);
    auto b = at::arange(batch, idx).view({-1, 1, 1, 1});
    auto h = (at::arange(q_heads, idx) + mf.head_index_offset).view({1, -1, 1, 1});
    auto qi = (at::arange(q_len, idx) + mf.q_index_offset).view({1, 1, -1, 1});
    auto kj = (at::arange(kv_len, idx) + mf.kv_index_offset).view({1, 1, 1, -1});
    auto fv = mf.fn(b, h, qi, kj);
    HP_CHECK(fv.defined() && fv.scalar_type() == at::kBool,
             "reference_attention: mask_fn must return a bool tensor");
    visible = at::logical_and(visible, fv.expand(sizes));
  }

  // Hidden scores take no part (and get no gradient). Rows with no visible key: the row max is
  // replaced by 0 and the row sum by 1, so exp(-inf) = 0 gives out 0 and no NaN anywhere.
  s = s.masked_fill(visible.logical_not(), -kInf);
  auto dead = visible.logical_not().all(-1, /*keepdim=*/true);  // [B, Nq, Sq, 1]
  // The max only keeps exp in range; the formula does not depend on it (no gradient through it).
  auto row_max = at::where(dead, at::zeros({}, s.options()), s.amax(-1, /*keepdim=*/true)).detach();
  auto e = at::exp(s - row_max);
  auto row_sum = at::where(dead, at::ones({}, s.options()), e.sum(-1, /*keepdim=*/true));
  auto p = e / row_sum;
  ReferenceAttention r;
  r.out = at::matmul(p, vh);
  r.lse = at::where(dead, at::full({}, -kInf, s.options()), row_max + at::log(row_sum)).squeeze(-1);
  r.visible = visible;
  return r;
}

at::Tensor reference_packed_attention(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                      const at::Tensor& doc_ids, bool causal) {
  auto ids = doc_ids.to(at::kLong);
  attention::AttentionOptions o;
  o.causal = causal;
  std::vector<at::Tensor> rows;
  for (int64_t b = 0; b < q.size(0); ++b) {
    auto row = ids[ids.size(0) == 1 ? 0 : b];
    std::vector<at::Tensor> docs;
    for (int64_t begin = 0; begin < row.size(0);) {
      int64_t end = begin + 1;
      while (end < row.size(0) && row[end].item<int64_t>() == row[begin].item<int64_t>())
        ++end;
      auto cut = [&](const at::Tensor& x) {
        return x.narrow(0, b, 1).narrow(2, begin, end - begin);
      };
      docs.push_back(reference_attention(cut(q), cut(k), cut(v), o).out);
      begin = end;
    }
    rows.push_back(at::cat(docs, 2));
  }
  return at::cat(rows, 0);
}

}  // namespace hp::testing
