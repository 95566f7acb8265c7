// The chunked delta rule as one autograd node (delta_rule_kernel.h).
//
// Every (batch, value head) row is independent, so both passes are one at::parallel_for handing
// out rows dynamically (one fork each; the ATen ops and BLAS calls inside run single-threaded on
// contiguous per-row tensors, so two thread pools do not fight over the cores):
//   forward   row j: pad q, k, v, g, beta [T, .] to N*C tokens -> [N, C, .], G = cumsum of g per
//             chunk -> chunk_terms (delta_rule_chunks.h, all N chunks batched) -> the state
//             through the chunks in order: v_new_i = u_i - w_i h_i, h_{i+1} = e^{G_C} h_i +
//             k_end_i^T v_new_i (two matmuls per chunk) -> out = q_decayed hs + qk v_new (two
//             bmm over the N chunks). Kept for backward: the inputs and the entering states
//             hs [BH, N, K, V]; nothing chunk-local.
//   backward  row j: chunk_terms again, now under autograd on the row's inputs; v_new from hs;
//             a = qk^T dout, b = q_decayed^T dout (bmm); per chunk from the last: dv_new_i =
//             a_i + k_end_i dh_{i+1}, dh_i = b_i + e^{G_C} dh_{i+1} - w_i^T dv_new_i; then the
//             terms' gradients in one bmm each (du = dv_new, dw = -dv_new hs^T, dqk = dout
//             v_new^T, dq_decayed = dout hs^T, dk_end = v_new dh_{i+1}^T, de^{G_C} = sum_V hs
//             dh_{i+1}) -> autograd::grad through chunk_terms -> dq, dk, dv, dg, dbeta; dh_0 is
//             the initial state's gradient.
#include "delta_rule_kernel.h"

#include <atomic>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>

#include "delta_rule_chunks.h"
#include "hp/common/threads.h"
#include "parallel_units.h"

namespace hp::attention::detail {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// [T, X] -> [N, C, X], zeros after the last token (g = 0, beta = 0, k = 0: the state is left
// alone by padding).
at::Tensor chunked(const at::Tensor& t, int64_t n, int64_t c) {
  const int64_t pad = n * c - t.size(0);
  auto p = pad > 0 ? at::constant_pad_nd(t, {0, 0, 0, pad}) : t;
  return p.reshape({n, c, t.size(1)});
}

// fn(row) for rows [0, n) over the intra-op threads, rows handed out as threads free up (a thread
// slowed by another process does not hold the others back); BLAS pinned to one thread inside.
template <typename Fn>
void for_each_row(int64_t n, const Fn& fn) {
  common::ScopedBlasThreads one_blas_thread(1);
  warm_blas_buffers(at::get_num_threads());
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t begin, int64_t end) {
    for (int64_t slot = begin; slot < end; ++slot) {
      for (int64_t row = next++; row < n; row = next++)
        fn(row);
    }
  });
}

struct RowTerms {
  ChunkTerms t;
  at::Tensor leaves[5];  // q, k, v, g, beta of the row when built for autograd
};

RowTerms row_terms(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                   const at::Tensor& g, const at::Tensor& beta, int64_t n, int64_t c,
                   bool with_grad) {
  RowTerms r;
  r.leaves[0] = q, r.leaves[1] = k, r.leaves[2] = v, r.leaves[3] = g, r.leaves[4] = beta;
  if (with_grad) {
    for (auto& l : r.leaves)
      l = l.detach().requires_grad_(true);
  }
  auto G = chunked(r.leaves[3], n, c).cumsum(1);
  r.t = chunk_terms(chunked(r.leaves[0], n, c), chunked(r.leaves[1], n, c),
                    chunked(r.leaves[2], n, c), G, chunked(r.leaves[4].unsqueeze(-1), n, c));
  return r;
}

struct ChunkedFn : torch::autograd::Function<ChunkedFn> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& q, const at::Tensor& k,
                               const at::Tensor& v, const at::Tensor& g, const at::Tensor& beta,
                               const at::Tensor& h0, int64_t chunk) {
    const int64_t bh = q.size(0), t = q.size(1), kd = q.size(2), vd = v.size(2);
    const int64_t c = chunk, n = (t + c - 1) / c;
    auto out = at::empty({bh, t, vd}, v.options());
    auto h_final = at::empty({bh, kd, vd}, v.options());
    auto hs = at::empty({bh, n, kd, vd}, v.options());
    for_each_row(bh, [&](int64_t j) {
      at::NoGradGuard no_grad;  // grad mode is per thread: off in the pool's threads too
      auto r = row_terms(q[j], k[j], v[j], g[j], beta[j], n, c, false).t;
      auto vs = at::empty({n, c, vd}, v.options());
      auto h = h_final[j];
      h.copy_(h0[j]);
      for (int64_t i = 0; i < n; ++i) {
        hs[j][i].copy_(h);
        auto vn = vs[i];
        at::addmm_out(vn, r.u[i], r.w[i], h, 1, -1);        // u - w h
        h.mul_(r.decay_end[i]).addmm_(r.k_end[i].t(), vn);  // e^{G_C} h + k_end^T v_new
      }
      auto o = at::baddbmm(at::bmm(r.qk, vs), r.q_decayed, hs[j]);  // [N, C, V]
      out[j].copy_(o.view({n * c, vd}).narrow(0, 0, t));
    });
    ctx->save_for_backward({q, k, v, g, beta, hs});
    ctx->saved_data["chunk"] = chunk;
    return {out, h_final};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const auto &q = saved[0], &k = saved[1], &v = saved[2], &g = saved[3], &beta = saved[4];
    const auto& hs = saved[5];
    const int64_t c = ctx->saved_data["chunk"].toInt();
    const int64_t bh = q.size(0), t = q.size(1), kd = q.size(2), vd = v.size(2), n = hs.size(1);
    auto dout = grads[0].defined() ? grads[0] : at::zeros({bh, t, vd}, v.options());
    auto dh = grads[1].defined() ? grads[1].clone() : at::zeros({bh, kd, vd}, v.options());
    auto dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v);
    auto dg = at::empty_like(g), dbeta = at::empty_like(beta);
    for_each_row(bh, [&](int64_t j) {
      at::AutoGradMode grad_on(true);
      auto r = row_terms(q[j], k[j], v[j], g[j], beta[j], n, c, true);
      std::vector<at::Tensor> dterms;
      {
        at::NoGradGuard no_grad;
        auto u = r.t.u.detach(), w = r.t.w.detach(), ke = r.t.k_end.detach();
        auto decay = r.t.decay_end.detach(), h = hs[j];
        auto d_o = chunked(dout[j], n, c);                              // [N, C, V]
        auto vs = at::baddbmm(u, w, h, 1, -1);                          // v_new [N, C, V]
        auto a = at::bmm(r.t.qk.detach().transpose(1, 2), d_o);         // [N, C, V]
        auto b = at::bmm(r.t.q_decayed.detach().transpose(1, 2), d_o);  // [N, K, V]
        auto dh_next = at::empty_like(h), dvs = at::empty_like(vs);
        auto dhj = dh[j];
        for (int64_t i = n - 1; i >= 0; --i) {
          dh_next[i].copy_(dhj);
          auto dvn = dvs[i];
          at::addmm_out(dvn, a[i], ke[i], dhj);  // a + k_end dh'
          // b + e^{G_C} dh' - w^T dv_new
          dhj.mul_(decay[i]).add_(b[i]).addmm_(w[i].t(), dvn, 1, -1);
        }
        auto ddecay = (h * dh_next).sum(-1, /*keepdim=*/true);  // [N, K, 1]
        if (decay.size(1) == 1) ddecay = ddecay.sum(1, /*keepdim=*/true);
        dterms = {dvs,
                  -at::bmm(dvs, h.transpose(1, 2)),
                  at::bmm(d_o, vs.transpose(1, 2)),
                  at::bmm(d_o, h.transpose(1, 2)),
                  at::bmm(vs, dh_next.transpose(1, 2)),
                  ddecay};
      }
      auto gr = torch::autograd::grad(
          {r.t.u, r.t.w, r.t.qk, r.t.q_decayed, r.t.k_end, r.t.decay_end},
          {r.leaves[0], r.leaves[1], r.leaves[2], r.leaves[3], r.leaves[4]}, dterms,
          /*retain_graph=*/false, /*create_graph=*/false, /*allow_unused=*/true);
      at::Tensor* dst[] = {&dq, &dk, &dv, &dg, &dbeta};
      for (int x = 0; x < 5; ++x) {
        if (gr[x].defined()) {
          (*dst[x])[j].copy_(gr[x]);
        } else {
          (*dst[x])[j].zero_();
        }
      }
    });
    return {dq, dk, dv, dg, dbeta, dh, at::Tensor()};
  }
};

}  // namespace

KernelResult delta_rule_chunked_kernel(const at::Tensor& q, const at::Tensor& k,
                                       const at::Tensor& v, const at::Tensor& g,
                                       const at::Tensor& beta, const at::Tensor& h0,
                                       int64_t chunk) {
  auto r = ChunkedFn::apply(q, k, v, g, beta, h0, chunk);
  return {r[0], r[1]};
}

}  // namespace hp::attention::detail
