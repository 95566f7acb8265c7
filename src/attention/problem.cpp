#include "problem.h"

#include <cmath>
#include <limits>

#include "hp/common/check.h"
#include "hp/common/shape.h"

namespace hp::attention::detail {
Problem validate(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                 const AttentionOptions& o, const char* who) {
  HP_CHECK(q.defined() && k.defined() && v.defined(), who, ": q, k and v must all be defined");
  HP_CHECK(q.dim() == 4 && k.dim() == 4 && v.dim() == 4, who,
           ": q, k, v must be 4-d BNSD [B, N, S, D]; got q ", common::shape_str(q.sizes()), ", k ",
           common::shape_str(k.sizes()), ", v ", common::shape_str(v.sizes()),
           " (a BSHD tensor needs .transpose(1, 2) first)");
  Problem p;
  p.batch = q.size(0);
  p.q_heads = q.size(1);
  p.q_len = q.size(2);
  p.qk_dim = q.size(3);
  p.kv_heads = k.size(1);
  p.kv_len = k.size(2);
  p.v_dim = v.size(3);
  HP_CHECK(k.size(0) == p.batch && v.size(0) == p.batch, who, ": batch sizes differ: q ", p.batch,
           ", k ", k.size(0), ", v ", v.size(0));
  HP_CHECK(k.size(3) == p.qk_dim, who, ": last dim of q (", p.qk_dim, ") and k (", k.size(3),
           ") differ; q and k must share Dqk (only v may have its own last dim Dv)");
  HP_CHECK(v.size(1) == p.kv_heads && v.size(2) == p.kv_len, who, ": v ",
           common::shape_str(v.sizes()), " must match k ", common::shape_str(k.sizes()),
           " in Nkv and Skv (dims 1 and 2; only the last dim Dv may differ)");
  HP_CHECK(p.kv_heads >= 1 && p.q_heads % p.kv_heads == 0, who, ": Nq=", p.q_heads,
           " is not a multiple of Nkv=", p.kv_heads,
           "; GQA needs every KV head to serve the same number of query heads");
  p.group = p.q_heads / p.kv_heads;
  HP_CHECK(q.scalar_type() == k.scalar_type() && q.scalar_type() == v.scalar_type(), who,
           ": q, k, v dtypes differ (", c10::toString(q.scalar_type()), ", ",
           c10::toString(k.scalar_type()), ", ", c10::toString(v.scalar_type()), ")");
  HP_CHECK(at::isFloatingType(q.scalar_type()), who, ": dtype ", c10::toString(q.scalar_type()),
           " is not floating point");
  p.compute_dtype = q.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  p.scale = o.scale.value_or(1.0 / std::sqrt(static_cast<double>(p.qk_dim)));
  HP_CHECK(std::isfinite(p.scale) && p.scale > 0, who, ": scale=", p.scale,
           " must be finite and > 0 (leave it unset for 1/sqrt(head_dim))");
  p.causal = o.causal;
  if (o.causal_meta) {
    HP_CHECK(o.causal, who, ": causal_meta is set but causal is false; set causal=true");
    const auto& m = *o.causal_meta;
    HP_CHECK(m.q_len < 0 || m.q_len == p.q_len, who, ": causal_meta.q_len=", m.q_len, " but q has ",
             p.q_len, " positions");
    HP_CHECK(m.kv_len < 0 || m.kv_len == p.kv_len, who, ": causal_meta.kv_len=", m.kv_len,
             " but k has ", p.kv_len, " positions");
    HP_CHECK(m.q_offset >= 0, who, ": causal_meta.q_offset=", m.q_offset, " must be >= 0");
    p.q_offset = m.q_offset;
  }
  if (o.mask.defined()) {
    const auto& m = o.mask;
    HP_CHECK(m.scalar_type() == at::kBool || at::isFloatingType(m.scalar_type()), who,
             ": mask dtype ", c10::toString(m.scalar_type()),
             " must be bool (true = attend) or floating point (additive)");
    HP_CHECK(m.dim() >= 2 && m.dim() <= 4, who, ": mask ", common::shape_str(m.sizes()),
             " must have 2 to 4 dims, broadcastable to [B, Nq, Sq, Skv] = [", p.batch, ",",
             p.q_heads, ",", p.q_len, ",", p.kv_len, "]");
    auto m4 = m;
    while (m4.dim() < 4)
      m4 = m4.unsqueeze(0);
    const bool ok = m4.size(2) == p.q_len && m4.size(3) == p.kv_len &&
                    (m4.size(0) == 1 || m4.size(0) == p.batch) &&
                    (m4.size(1) == 1 || m4.size(1) == p.q_heads);
    HP_CHECK(ok, who, ": mask ", common::shape_str(m.sizes()),
             " is not broadcastable to [B, Nq, Sq, Skv] = [", p.batch, ",", p.q_heads, ",", p.q_len,
             ",", p.kv_len, "]; give it shape [Sq, Skv], [B|1, Nq|1, Sq, Skv]");
    p.mask_is_bool = m.scalar_type() == at::kBool;
    p.mask = p.mask_is_bool ? m4 : m4.to(p.compute_dtype);
  }
  if (o.mask_fn) {
    HP_CHECK(static_cast<bool>(o.mask_fn->fn), who, ": mask_fn is set but has no function");
    p.mask_fn = o.mask_fn;
  }
  if (o.documents) {
    check_documents(*o.documents, p.batch, p.q_len, p.kv_len, who);
    p.docs = *o.documents;
    p.docs->ids = o.documents->ids.to(at::kCPU, at::kLong).contiguous();
  }
  HP_CHECK(o.block_q >= 1 && o.block_kv >= 1, who, ": block sizes block_q=", o.block_q,
           " block_kv=", o.block_kv, " must be >= 1");
  return p;
}

TileMask::TileMask(const Problem& p, int64_t block_q, int64_t block_kv)
    : p_(p),
      block_q_(std::max<int64_t>(1, std::min(block_q, std::max<int64_t>(p.q_len, 1)))),
      block_kv_(std::max<int64_t>(1, std::min(block_kv, std::max<int64_t>(p.kv_len, 1)))) {
  nq_ = (p.q_len + block_q_ - 1) / block_q_;
  nk_ = (p.kv_len + block_kv_ - 1) / block_kv_;
  kinds_.assign(static_cast<size_t>(nq_ * nk_), BlockKind::kFull);
  user_masked_.assign(kinds_.size(), 0);
  const bool other_masks = p.mask.defined() || p.mask_fn.has_value();
  const auto* docs = p.docs ? &*p.docs : nullptr;
  DocumentIdsView ids;  // validate() made them CPU int64, contiguous
  if (docs != nullptr) ids = {docs->ids.data_ptr<int64_t>(), docs->ids.size(0), docs->ids.size(1)};
  for (int64_t qb = 0; qb < nq_; ++qb) {
    const int64_t qs = qb * block_q_, qe = std::min(p.q_len, qs + block_q_);
    for (int64_t kb = 0; kb < nk_; ++kb) {
      const int64_t ks = kb * block_kv_, ke = std::min(p.kv_len, ks + block_kv_);
      BlockKind kind = BlockKind::kFull;
      bool masked = false;  // whether the user masks hide part of the tile
      if (p.causal) {
        if (ks > p.q_offset + qe - 1) {
          kind = BlockKind::kEmpty;  // wholly above the diagonal: skipped, never computed
        } else if (ke - 1 > p.q_offset + qs) {
          kind = BlockKind::kPartial;
        }
      }
      if (kind != BlockKind::kEmpty && docs != nullptr) {
        const int64_t q0 = docs->q_start, k0 = docs->kv_start;
        if (documents_hide_block(ids, q0 + qs, q0 + qe, k0 + ks, k0 + ke)) {
          kind = BlockKind::kEmpty;  // no document spans the tile: skipped
        } else if (!documents_fill_block(ids, q0 + qs, q0 + qe, k0 + ks, k0 + ke)) {
          kind = BlockKind::kPartial;
          masked = true;
        }
      }
      if (kind != BlockKind::kEmpty && other_masks) {
        auto vis = visible(qs, qe, ks, ke);
        if (vis.defined()) {
          if (!vis.any().item<bool>()) {
            kind = BlockKind::kEmpty;
          } else if (!vis.all().item<bool>()) {
            kind = BlockKind::kPartial;
            masked = true;
          }
        }
        // An additive mask must be added to every tile it touches.
        if (p.mask.defined() && !p.mask_is_bool && kind != BlockKind::kEmpty) {
          kind = BlockKind::kPartial;
          masked = true;
        }
      }
      kinds_[qb * nk_ + kb] = kind;
      user_masked_[qb * nk_ + kb] = masked ? 1 : 0;
    }
  }
}

at::Tensor TileMask::visible(int64_t qs, int64_t qe, int64_t ks, int64_t ke) const {
  at::Tensor vis;
  if (p_.mask.defined()) {
    auto blk = p_.mask.slice(2, qs, qe).slice(3, ks, ke);
    vis = p_.mask_is_bool ? blk : blk.ne(-std::numeric_limits<double>::infinity());
  }
  if (p_.mask_fn) {
    const auto& mf = *p_.mask_fn;
    auto opts = at::TensorOptions().dtype(at::kLong);
    auto b = (mf.per_batch ? at::arange(p_.batch, opts) : at::zeros({1}, opts)).view({-1, 1, 1, 1});
    auto h = (mf.per_head ? at::arange(p_.q_heads, opts) : at::zeros({1}, opts))
                 .add(mf.head_index_offset)
                 .view({1, -1, 1, 1});
    auto qi = at::arange(qs + mf.q_index_offset, qe + mf.q_index_offset, opts).view({1, 1, -1, 1});
    auto ki =
        at::arange(ks + mf.kv_index_offset, ke + mf.kv_index_offset, opts).view({1, 1, 1, -1});
    auto fv = mf.fn(b, h, qi, ki);
    HP_CHECK(fv.defined() && fv.scalar_type() == at::kBool, "mask_fn must return a bool tensor");
    fv = fv.expand({b.size(0), h.size(1), qe - qs, ke - ks});
    vis = vis.defined() ? at::logical_and(vis, fv) : fv;
  }
  if (p_.docs) {
    const auto& d = *p_.docs;  // [Bd, S_total] -> [Bd, 1, bq, bk]
    auto qd = d.ids.slice(1, d.q_start + qs, d.q_start + qe).view({-1, 1, qe - qs, 1});
    auto kd = d.ids.slice(1, d.kv_start + ks, d.kv_start + ke).view({-1, 1, 1, ke - ks});
    auto same = qd.eq(kd);
    vis = vis.defined() ? at::logical_and(vis, same) : same;
  }
  return vis;
}

at::Tensor TileMask::to_grouped(const at::Tensor& m) const {
  // m: [Bx, Hx, bq, bk], Hx in {1, Nq}.
  const int64_t bx = m.size(0), bq = m.size(2), bk = m.size(3);
  const int64_t g = p_.group;
  if (m.size(1) == p_.q_heads) return m.reshape({bx, p_.kv_heads, g * bq, bk});
  return m.unsqueeze(2).expand({bx, 1, g, bq, bk}).reshape({bx, 1, g * bq, bk});
}

void TileMask::apply(at::Tensor& s, int64_t qb, int64_t kb, bool with_causal) const {
  const int64_t qs = qb * block_q_, qe = std::min(p_.q_len, qs + block_q_);
  const int64_t ks = kb * block_kv_, ke = std::min(p_.kv_len, ks + block_kv_);
  const double neg_inf = -std::numeric_limits<double>::infinity();
  if (p_.mask.defined() && !p_.mask_is_bool) {
    s.add_(to_grouped(p_.mask.slice(2, qs, qe).slice(3, ks, ke)));
  }
  at::Tensor hidden;
  if (with_causal && p_.causal && ke - 1 > p_.q_offset + qs) {
    auto qi = at::arange(qs + p_.q_offset, qe + p_.q_offset, at::kLong).view({-1, 1});
    auto kj = at::arange(ks, ke, at::kLong).view({1, -1});
    hidden = kj.gt(qi).view({1, 1, qe - qs, ke - ks});
  }
  if (has_user_masks()) {
    auto inv = visible(qs, qe, ks, ke).logical_not();
    hidden = hidden.defined() ? at::logical_or(hidden, inv) : inv;
  }
  if (hidden.defined()) s.masked_fill_(to_grouped(hidden), neg_inf);
}

void TileMask::apply_head(at::Tensor& s, int64_t qb, int64_t kb, int64_t b, int64_t kvh) const {
  const int64_t qs = qb * block_q_, qe = std::min(p_.q_len, qs + block_q_);
  const int64_t ks = kb * block_kv_, ke = std::min(p_.kv_len, ks + block_kv_);
  const int64_t g = p_.group, bq = qe - qs, bk = ke - ks;
  // [Bx, Hx, bq, bk] -> this head group's [G*bq, bk].
  auto pick = [&](const at::Tensor& m) {
    auto x = m.select(0, m.size(0) > 1 ? b : 0);
    x = x.size(0) > 1 ? x.slice(0, kvh * g, (kvh + 1) * g) : x.expand({g, bq, bk});
    return x.reshape({g * bq, bk});
  };
  if (p_.mask.defined() && !p_.mask_is_bool) {
    s.add_(pick(p_.mask.slice(2, qs, qe).slice(3, ks, ke)));
  }
  if (has_user_masks()) {
    s.masked_fill_(pick(visible(qs, qe, ks, ke)).logical_not(),
                   -std::numeric_limits<double>::infinity());
  }
}

}  // namespace hp::attention::detail

namespace hp::attention {

at::Tensor block_mask(const MaskFunction& fn, int64_t batch, int64_t heads, int64_t q_len,
                      int64_t kv_len, int64_t block_q, int64_t block_kv, bool causal,
                      int64_t q_offset) {
  HP_CHECK(static_cast<bool>(fn.fn), "block_mask: the mask function is empty");
  HP_CHECK(batch >= 1 && heads >= 1 && q_len >= 1 && kv_len >= 1 && block_q >= 1 && block_kv >= 1,
           "block_mask: sizes must be >= 1 (batch=", batch, " heads=", heads, " q_len=", q_len,
           " kv_len=", kv_len, " block_q=", block_q, " block_kv=", block_kv, ")");
  detail::Problem p;
  p.batch = batch;
  p.q_heads = heads;
  p.kv_heads = heads;
  p.q_len = q_len;
  p.kv_len = kv_len;
  p.causal = causal;
  p.q_offset = q_offset;
  p.mask_fn = fn;
  detail::TileMask tiles(p, block_q, block_kv);
  auto out = at::empty({tiles.num_q_blocks(), tiles.num_kv_blocks()}, at::kByte);
  auto acc = out.accessor<uint8_t, 2>();
  for (int64_t i = 0; i < tiles.num_q_blocks(); ++i) {
    for (int64_t j = 0; j < tiles.num_kv_blocks(); ++j) {
      acc[i][j] = static_cast<uint8_t>(tiles.kind(i, j));
    }
  }
  return out;
}

}  // namespace hp::attention
