// The intra-chunk terms of the chunked delta rule (delta_rule_chunks.h).
//
//   q, k, v, G, beta [.., C, X] -> decayed products kk, qk [.., C, C] (block decomposition for
//   KDA, one masked gate matrix for GDN) -> T = (I + beta tril_-1(kk))^-1 (one unit-lower
//   triangular solve) -> [u w] = T beta [V, K e^G] (one matmul); q e^G, k e^{G_C - G}, e^{G_C}.
#include "delta_rule_chunks.h"

#include <algorithm>
#include <limits>
#include <vector>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

namespace hp::attention::detail {
namespace {

// Decayed products D[t, i] = sum_k x_t[k] k_i[k] exp(G_t[k] - G_i[k]) for every pair of one chunk
// (x, k [.., C, K]; G [.., C, K or 1] cumulative log-gates, non-increasing), lower triangle incl.
// the diagonal, upper triangle 0.
//
// GDN (one gate per row): (x k^T) * e^{G_t - G_i} with the gate matrix masked before its exp.
//
// Both products of a chunk (q k and k k) come from one set of gate factors.
//
// KDA: built from sub-blocks of s rows: row block a against earlier columns [0, a*s) through the
// reference G at the row before the block (both factors <= 1); each block against itself through
// a reference at its middle row (factors within e^{s/2 max|g|}, kept in range by the choice of s:
// sub_block_rows; its upper triangle, which
// multiplies the two large sides, is dropped before anything else sees it). A hand-written
// backward reuses the same factors: with dD lower-triangular, dx = rowf (dD colf k),
// dk = colf (dD^T rowf x), and since every entry depends on G only through G_t - G_i,
// dG = x dx - k dk.
struct KdaFactors {
  at::Tensor ed, ed_inv;  // e^{G - mid} and e^{mid - G} per row block [.., nb, s, K]
  at::Tensor rowf, colf;  // e^{G_a - ref_a} [.., nb-1, s, K]; e^{ref_a - G_i}, i < a*s, else 0
};                        //                                   [.., nb-1, C, K]

KdaFactors kda_factors(const at::Tensor& G, int64_t s) {
  const int64_t c = G.size(-2), nb = c / s;
  auto shape = G.sizes().slice(0, G.dim() - 2).vec();
  shape.insert(shape.end(), {nb, s, G.size(-1)});
  auto Gb = G.reshape(shape);
  KdaFactors f;
  auto mid = Gb.narrow(-2, s / 2, 1);  // [.., nb, 1, K]
  f.ed = at::exp(Gb - mid);
  f.ed_inv = at::exp(mid - Gb);
  if (nb > 1) {
    auto ref = Gb.narrow(-2, s - 1, 1).narrow(-3, 0, nb - 1);  // [.., nb-1, 1, K]
    f.rowf = at::exp(Gb.narrow(-3, 1, nb - 1) - ref);
    auto cols = at::arange(c, G.options().dtype(at::kLong));
    auto limit = (at::arange(1, nb, G.options().dtype(at::kLong)) * s).view({nb - 1, 1, 1});
    auto later = cols.view({1, c, 1}).ge(limit);  // [nb-1, C, 1]: columns at or after the block
    const double neg_inf = -std::numeric_limits<double>::infinity();
    f.colf = (ref - G.unsqueeze(-3)).masked_fill_(later, neg_inf).exp_();  // [.., nb-1, C, K]
  }
  return f;
}

// [.., C, X] -> [.., C/s, s, X]
at::Tensor row_blocks(const at::Tensor& t, int64_t s) {
  auto shape = t.sizes().slice(0, t.dim() - 2).vec();
  shape.insert(shape.end(), {t.size(-2) / s, s, t.size(-1)});
  return t.reshape(shape);
}

// D for one (x, k) pair from the factors of G.
at::Tensor kda_products(const KdaFactors& f, const at::Tensor& x, const at::Tensor& k, int64_t s) {
  const int64_t c = x.size(-2), nb = c / s;
  auto xb = row_blocks(x, s), kb = row_blocks(k, s);
  auto diag = at::matmul(xb * f.ed, (kb * f.ed_inv).transpose(-1, -2)).tril();  // [.., nb, s, s]
  auto lead = x.sizes().slice(0, x.dim() - 2).vec();
  auto full_shape = lead;
  full_shape.insert(full_shape.end(), {c, c});
  auto eye = at::eye(nb, x.options()).view({nb, 1, nb, 1});
  auto D = (diag.unsqueeze(-2) * eye).reshape(full_shape);  // block diagonal
  if (nb > 1) {
    auto rows = xb.narrow(-3, 1, nb - 1) * f.rowf;                              // [.., nb-1, s, K]
    auto off = at::matmul(rows, (k.unsqueeze(-3) * f.colf).transpose(-1, -2));  // [.., s, C]
    auto off_shape = lead;
    off_shape.insert(off_shape.end(), {(nb - 1) * s, c});
    D.narrow(-2, s, (nb - 1) * s).add_(off.reshape(off_shape));
  }
  return D;
}

// Adds the gradients of kda_products(f, x, k) for dD into dx, dk ([.., C, K]).
void kda_products_backward(const KdaFactors& f, const at::Tensor& x, const at::Tensor& k,
                           const at::Tensor& dD_full, int64_t s, at::Tensor& dx_out,
                           at::Tensor& dk_out) {
  const int64_t c = x.size(-2), nb = c / s;
  auto dD = dD_full.tril();
  auto xb = row_blocks(x, s), kb = row_blocks(k, s);
  auto lead = dD.sizes().slice(0, dD.dim() - 2).vec();
  auto blocks_shape = lead;
  blocks_shape.insert(blocks_shape.end(), {nb, s, nb, s});
  // Diagonal blocks [.., nb, s, s] of dD.
  auto dd = at::diagonal(dD.reshape(blocks_shape), 0, -4, -2).movedim(-1, -3).tril();
  auto dx = at::matmul(dd, kb * f.ed_inv) * f.ed;  // [.., nb, s, K]
  auto dk = at::matmul(dd.transpose(-1, -2), xb * f.ed) * f.ed_inv;
  if (nb > 1) {
    auto off_shape = lead;
    off_shape.insert(off_shape.end(), {nb - 1, s, c});
    auto doff = dD.narrow(-2, s, (nb - 1) * s).reshape(off_shape);  // [.., nb-1, s, C]
    auto keys = k.unsqueeze(-3) * f.colf;                           // [.., nb-1, C, K]
    auto rows = xb.narrow(-3, 1, nb - 1) * f.rowf;                  // [.., nb-1, s, K]
    dx.narrow(-3, 1, nb - 1).add_(at::matmul(doff, keys) * f.rowf);
    dk = dk + row_blocks((at::matmul(doff.transpose(-1, -2), rows) * f.colf).sum(-3), s);
  }
  dx_out.add_(dx.reshape(x.sizes()));
  dk_out.add_(dk.reshape(k.sizes()));
}

// (q, k, G) -> (D(q, k), D(k, k)): both products of a chunk from one set of factors.
struct KdaDecayedFn : torch::autograd::Function<KdaDecayedFn> {
  static torch::autograd::variable_list forward(torch::autograd::AutogradContext* ctx,
                                                const at::Tensor& q, const at::Tensor& k,
                                                const at::Tensor& G, int64_t s) {
    auto f = kda_factors(G, s);
    ctx->save_for_backward({q, k, G});
    ctx->saved_data["s"] = s;
    return {kda_products(f, q, k, s), kda_products(f, k, k, s)};
  }

  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const auto &q = saved[0], &k = saved[1], &G = saved[2];
    const int64_t s = ctx->saved_data["s"].toInt();
    auto f = kda_factors(G, s);
    auto dq = at::zeros_like(q), dk_row = at::zeros_like(k), dk_col = at::zeros_like(k);
    if (grads[0].defined()) kda_products_backward(f, q, k, grads[0], s, dq, dk_col);
    if (grads[1].defined()) kda_products_backward(f, k, k, grads[1], s, dk_row, dk_col);
    // Every entry depends on G only through G_t - G_i: dG = x dx - k dk over both products.
    auto dG = q * dq + k * (dk_row - dk_col);
    return {dq, dk_row + dk_col, dG, at::Tensor()};
  }
};

// (D(q, k), D(k, k)), lower triangles incl. the diagonal.
std::pair<at::Tensor, at::Tensor> decayed_products(const at::Tensor& q, const at::Tensor& k,
                                                   const at::Tensor& G, int64_t s) {
  const int64_t c = q.size(-2);
  if (G.size(-1) == 1) {  // one gate per row (GDN): e^{G_t - G_i} <= 1 below the diagonal
    auto lower = at::ones({c, c}, q.options().dtype(at::kBool)).tril();
    auto expo = G - G.transpose(-1, -2);  // [.., C, C]
    const double neg_inf = -std::numeric_limits<double>::infinity();
    auto gates = at::exp(at::where(lower, expo, at::full({}, neg_inf, expo.options())));
    return {at::matmul(q, k.transpose(-1, -2)) * gates, at::matmul(k, k.transpose(-1, -2)) * gates};
  }
  auto r = KdaDecayedFn::apply(q, k, G, s);
  return {r[0], r[1]};
}

// The sub-block rows s of KDA's decayed products for chunks of C rows with cumulative log-gates
// G: 16 where C is a multiple of 16, else C, unless a block's factors e^{+-(G - mid)}, up to
// e^{s/2 max|g|} for per-token log-gates g, could leave the dtype's range (float32: e^88); then
// the largest divisor of C that keeps s/2 max|g| within the bound (1 at worst: every factor is
// then <= 1). So the products are exact for any gate, not only g in [kMinLogGate, 0].
int64_t sub_block_rows(const at::Tensor& G) {
  const int64_t c = G.size(-2);
  const int64_t preferred = c % 16 == 0 ? 16 : c;
  if (G.size(-1) == 1 || c == 1) return preferred;  // GDN: one masked gate matrix, no blocks
  // Factors up to e^bound (float32: 80, so s = 16 down to the model layers' clamp kMinLogGate;
  // the dropped upper triangle's products may overflow, and tril() discards them).
  const double bound = G.scalar_type() == at::kDouble ? 600.0 : 80.0;
  auto g = G.detach();
  auto steps = at::cat({g.narrow(-2, 0, 1), g.narrow(-2, 1, c - 1) - g.narrow(-2, 0, c - 1)}, -2);
  const double widest = steps.abs().max().item<double>();
  if (!(widest * static_cast<double>(preferred / 2) > bound)) return preferred;  // NaN: as before
  for (int64_t s = std::min<int64_t>(c, 16); s > 1; --s)
    if (c % s == 0 && widest * static_cast<double>(s / 2) <= bound) return s;
  return 1;
}

}  // namespace

ChunkTerms chunk_terms(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const at::Tensor& G, const at::Tensor& beta) {
  const int64_t c = q.size(-2);
  const int64_t s = sub_block_rows(G);  // sub-block rows of the decayed products
  ChunkTerms t;
  // WY: T = (I + tril_-1(diag(beta) KK_dec))^-1 by one unit-lower triangular solve against I
  // (C right-hand sides, cheaper than solving for [V, K] directly), then [U, W] = T diag(beta)
  // [V, K e^G] in one matmul.
  auto [qk, kk_full] = decayed_products(q, k, G, s);
  auto kk = kk_full.tril(-1);
  auto eye = at::eye(c, q.options());
  auto tri = at::linalg_solve_triangular(eye + beta * kk, eye.expand_as(kk), /*upper=*/false,
                                         /*left=*/true, /*unitriangular=*/true);
  auto sol = at::matmul(tri, beta * at::cat({v, k * at::exp(G)}, -1));
  const int64_t vd = v.size(-1), kd = k.size(-1);
  t.u = sol.narrow(-1, 0, vd);
  t.w = sol.narrow(-1, vd, kd);
  t.qk = qk;
  t.q_decayed = q * at::exp(G);
  auto g_end = G.narrow(-2, c - 1, 1);  // [.., 1, K or 1]
  t.k_end = k * at::exp(g_end - G);
  t.decay_end = at::exp(g_end).transpose(-1, -2);
  return t;
}

}  // namespace hp::attention::detail
