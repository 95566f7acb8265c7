// The state pass of the chunked delta rule (delta_rule_scan.h) as one autograd node.
//
//   forward   terms [B, HV, N, ..] -> chunk-major [N, B*HV, ..] (one copy each), then per chunk
//             i in order: v_new_i = u_i - w_i h_i, h_{i+1} = decay_i h_i + k_end_i^T v_new_i
//             (two matmuls; heads split over threads, each runs its heads through all chunks); the entering states hs [N, B*HV, K, V] and v_new
//             are kept; out = q_decayed hs + qk v_new in one bmm pair over all N * B*HV chunks.
//   backward  dout -> a = qk^T dout, b = q_decayed^T dout (batched); per chunk i from the last:
//             dv_new_i = a_i + k_end_i dh_{i+1}, dh_i = b_i + decay_i dh_{i+1} - w_i^T dv_new_i
//             (two bmm each); then every term's gradient in one batched op each from hs, v_new,
//             the dh_{i+1} and dv_new. dh_0 is the initial state's gradient.
#include "delta_rule_scan.h"

#include <vector>

#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/autograd/custom_function.h>

namespace hp::attention::detail {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// [B, HV, N, X, Y] -> contiguous [N, B*HV, X, Y]
at::Tensor chunk_major(const at::Tensor& t) {
  auto c = t.permute({2, 0, 1, 3, 4}).contiguous();
  return c.view({c.size(0), c.size(1) * c.size(2), c.size(3), c.size(4)});
}

// [N, B*HV, X, Y] -> [B, HV, N, X, Y] with `like`'s B, HV
at::Tensor head_major(const at::Tensor& t, const at::Tensor& like) {
  return t.view({t.size(0), like.size(0), like.size(1), t.size(2), t.size(3)})
      .permute({1, 2, 0, 3, 4});
}

struct ScanFn : torch::autograd::Function<ScanFn> {
  static variable_list forward(AutogradContext* ctx, const at::Tensor& u, const at::Tensor& w,
                               const at::Tensor& qk, const at::Tensor& q_decayed,
                               const at::Tensor& k_end, const at::Tensor& decay_end,
                               const at::Tensor& h0) {
    const int64_t n = u.size(2);
    auto U = chunk_major(u), W = chunk_major(w), QK = chunk_major(qk);
    auto QD = chunk_major(q_decayed), KE = chunk_major(k_end), D = chunk_major(decay_end);
    const int64_t bh = U.size(1), kd = h0.size(-2), vd = h0.size(-1);
    auto hs = at::empty({n, bh, kd, vd}, h0.options());
    auto vs = at::empty_like(U);
    auto h_final = at::empty({bh, kd, vd}, h0.options());
    auto h0f = h0.reshape({bh, kd, vd});
    // Heads are independent: each thread runs its heads through all chunks (one fork for the
    // whole pass, not one per chunk); ATen ops inside run single-threaded.
    at::parallel_for(0, bh, 1, [&](int64_t begin, int64_t end) {
      for (int64_t j = begin; j < end; ++j) {
        auto h = h_final[j];
        h.copy_(h0f[j]);
        for (int64_t i = 0; i < n; ++i) {
          hs[i][j].copy_(h);
          auto vn = vs[i][j];
          at::addmm_out(vn, U[i][j], W[i][j], h, 1, -1);  // u - w h
          h.mul_(D[i][j]).addmm_(KE[i][j].t(), vn);       // decay h + k_end^T v_new
        }
      }
    });
    auto out = at::baddbmm(at::matmul(QK.flatten(0, 1), vs.flatten(0, 1)), QD.flatten(0, 1),
                           hs.flatten(0, 1));
    ctx->save_for_backward({W, QK, QD, KE, D, hs, vs});
    ctx->saved_data["b"] = u.size(0);
    ctx->saved_data["hv"] = u.size(1);
    auto out5 = out.view({n, u.size(0), u.size(1), u.size(3), vd}).permute({1, 2, 0, 3, 4});
    return {out5, h_final.view(h0.sizes())};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto saved = ctx->get_saved_variables();
    const auto &W = saved[0], &QK = saved[1], &QD = saved[2], &KE = saved[3], &D = saved[4];
    const auto &hs = saved[5], &vs = saved[6];
    const int64_t b = ctx->saved_data["b"].toInt(), hv = ctx->saved_data["hv"].toInt();
    const int64_t n = hs.size(0), bh = hs.size(1), kd = hs.size(2), vd = hs.size(3);
    const int64_t c = vs.size(2);
    auto dout = grads[0].defined()
                    ? grads[0].permute({2, 0, 1, 3, 4}).contiguous().view({n, bh, c, vd})
                    : at::zeros_like(vs);
    auto dh = grads[1].defined() ? grads[1].reshape({bh, kd, vd}).clone()
                                 : at::zeros({bh, kd, vd}, hs.options());
    auto flat = [](const at::Tensor& t) { return t.flatten(0, 1); };
    auto tr = [](const at::Tensor& t) { return t.transpose(-1, -2); };
    // What the outputs of chunk i send to its v_new and its entering state.
    auto a = at::bmm(tr(flat(QK)), flat(dout)).view({n, bh, c, vd});
    auto bq = at::bmm(tr(flat(QD)), flat(dout)).view({n, bh, kd, vd});
    auto dhs_next = at::empty_like(hs);  // the gradient of the state leaving chunk i
    auto dvs = at::empty_like(vs);
    at::parallel_for(0, bh, 1, [&](int64_t begin, int64_t end) {
      for (int64_t j = begin; j < end; ++j) {
        auto dhj = dh[j];
        for (int64_t i = n - 1; i >= 0; --i) {
          dhs_next[i][j].copy_(dhj);
          auto dvn = dvs[i][j];
          at::addmm_out(dvn, a[i][j], KE[i][j], dhj);  // a + k_end dh'
          // b + decay dh' - w^T dv_new
          dhj.mul_(D[i][j]).add_(bq[i][j]).addmm_(W[i][j].t(), dvn, 1, -1);
        }
      }
    });
    auto du = dvs;
    auto dw = -at::bmm(flat(dvs), tr(flat(hs))).view({n, bh, c, kd});
    auto dqk = at::bmm(flat(dout), tr(flat(vs))).view({n, bh, c, c});
    auto dqd = at::bmm(flat(dout), tr(flat(hs))).view({n, bh, c, kd});
    auto dke = at::bmm(flat(vs), tr(flat(dhs_next))).view({n, bh, c, kd});
    auto ddecay = (hs * dhs_next).sum(-1, /*keepdim=*/true);  // [N, BH, K, 1]
    if (D.size(2) == 1) ddecay = ddecay.sum(-2, /*keepdim=*/true);
    auto like = at::empty({b, hv}, hs.options());
    auto back = [&](const at::Tensor& t) { return head_major(t, like); };
    return {back(du),  back(dw),     back(dqk),
            back(dqd), back(dke),    back(ddecay),
            dh.view({b, hv, kd, vd})};
  }
};

}  // namespace

ScanResult delta_rule_scan(const ChunkTerms& t, const at::Tensor& h0) {
  auto r = ScanFn::apply(t.u, t.w, t.qk, t.q_decayed, t.k_end, t.decay_end, h0);
  return {r[0], r[1]};
}

}  // namespace hp::attention::detail
