// The intra-chunk terms of the chunked delta rule (delta_rule_chunks.h).
//
//   q, k, v, G, beta [.., C, X] -> decayed products kk, qk [.., C, C] (block decomposition for
//   KDA, one masked gate matrix for GDN) -> T = (I + beta tril_-1(kk))^-1 (one unit-lower
//   triangular solve) -> [u w] = T beta [V, K e^G] (one matmul); q e^G, k e^{G_C - G}, e^{G_C}.
#include "delta_rule_chunks.h"

#include <limits>
#include <vector>

#include <ATen/ATen.h>

namespace hp::attention::detail {
namespace {

// Decayed products D[t, i] = sum_k x_t[k] k_i[k] exp(G_t[k] - G_i[k]) for every pair of one chunk
// (x, k [.., C, K]; G [.., C, K or 1] cumulative log-gates, non-increasing), lower triangle incl.
// the diagonal, upper triangle 0. Built from sub-blocks of s rows: a row block against earlier
// columns through the reference G at the row before the block (both factors <= 1); the block
// against itself through a reference at its middle row (factors within e^{s/2 * 10}).
at::Tensor decayed_products(const at::Tensor& x, const at::Tensor& k, const at::Tensor& G,
                            int64_t s) {
  const int64_t c = x.size(-2), nb = c / s;
  if (G.size(-1) == 1) {  // one gate per row (GDN): e^{G_t - G_i} <= 1 below the diagonal
    auto lower = at::ones({c, c}, x.options().dtype(at::kBool)).tril();
    auto expo = G - G.transpose(-1, -2);  // [.., C, C]
    const double neg_inf = -std::numeric_limits<double>::infinity();
    return at::matmul(x, k.transpose(-1, -2)) *
           at::exp(at::where(lower, expo, at::full({}, neg_inf, expo.options())));
  }
  auto lead = x.sizes().slice(0, x.dim() - 2).vec();
  auto blocks = [&](const at::Tensor& t) {  // [.., C, X] -> [.., nb, s, X]
    auto shape = lead;
    shape.insert(shape.end(), {nb, s, t.size(-1)});
    return t.reshape(shape);
  };
  auto xb = blocks(x), kb = blocks(k), Gb = blocks(G);
  // Within each row block: reference at its middle row.
  auto mid = Gb.narrow(-2, s / 2, 1);  // [.., nb, 1, Kg]
  // Its upper triangle multiplies the two large sides (e^{G_t - G_i}, t < i, can overflow):
  // dropped before anything else sees it.
  auto diag = at::matmul(xb * at::exp(Gb - mid), (kb * at::exp(mid - Gb)).transpose(-1, -2)).tril();
  auto eye = at::eye(nb, x.options()).view({nb, 1, nb, 1});
  auto full_shape = lead;
  full_shape.insert(full_shape.end(), {c, c});
  auto D = (diag.unsqueeze(-2) * eye).reshape(full_shape);  // block diagonal
  if (nb > 1) {
    // Row block a (a >= 1) against columns [0, a*s): reference G[a*s - 1].
    auto ref = Gb.narrow(-2, s - 1, 1).narrow(-3, 0, nb - 1);  // [.., nb-1, 1, Kg]
    auto rows = xb.narrow(-3, 1, nb - 1) * at::exp(Gb.narrow(-3, 1, nb - 1) - ref);
    auto cols = at::arange(c, x.options().dtype(at::kLong));
    auto limit = (at::arange(1, nb, x.options().dtype(at::kLong)) * s).view({nb - 1, 1, 1});
    auto before = cols.view({1, c, 1}).lt(limit);  // [nb-1, C, 1]
    auto expo = ref - G.unsqueeze(-3);             // [.., nb-1, C, Kg]
    const double neg_inf = -std::numeric_limits<double>::infinity();
    auto keys =
        k.unsqueeze(-3) * at::exp(at::where(before, expo, at::full({}, neg_inf, expo.options())));
    auto off = at::matmul(rows, keys.transpose(-1, -2));  // [.., nb-1, s, C]
    auto off_shape = lead;
    off_shape.insert(off_shape.end(), {(nb - 1) * s, c});
    D = D + at::constant_pad_nd(off.reshape(off_shape), {0, 0, s, 0});
  }
  return D.tril();
}

}  // namespace

ChunkTerms chunk_terms(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const at::Tensor& G, const at::Tensor& beta) {
  const int64_t c = q.size(-2);
  const int64_t s = c % 16 == 0 ? 16 : c;  // sub-block rows of the decayed products
  ChunkTerms t;
  // WY: T = (I + tril_-1(diag(beta) KK_dec))^-1 by one unit-lower triangular solve against I
  // (C right-hand sides, cheaper than solving for [V, K] directly), then [U, W] = T diag(beta)
  // [V, K e^G] in one matmul.
  auto kk = decayed_products(k, k, G, s).tril(-1);
  auto eye = at::eye(c, q.options());
  auto tri = at::linalg_solve_triangular(eye + beta * kk, eye.expand_as(kk), /*upper=*/false,
                                         /*left=*/true, /*unitriangular=*/true);
  auto sol = at::matmul(tri, beta * at::cat({v, k * at::exp(G)}, -1));
  const int64_t vd = v.size(-1), kd = k.size(-1);
  t.u = sol.narrow(-1, 0, vd);
  t.w = sol.narrow(-1, vd, kd);
  t.qk = decayed_products(q, k, G, s);
  t.q_decayed = q * at::exp(G);
  auto g_end = G.narrow(-2, c - 1, 1);  // [.., 1, K or 1]
  t.k_end = k * at::exp(g_end - G);
  t.decay_end = at::exp(g_end).transpose(-1, -2);
  return t;
}

}  // namespace hp::attention::detail
