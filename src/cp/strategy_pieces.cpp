// Shared pieces of strategies whose attention step runs several calls per query block:
// the log-sum-exp merge of partial results and the anchor that keeps every rank's backward
// collectives in one order.
#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include "hp/common/check.h"
#include "hp/cp/strategy.h"
#include "strategy_pieces.h"

namespace hp::cp {
namespace {

// A zero that depends on the moved tensors; its backward hands each a zero gradient of its own
// shape, dtype and device (saved as the tensors themselves: they are alive anyway, attention
// saved them).
struct MovedAnchor : torch::autograd::Function<MovedAnchor> {
  static at::Tensor forward(torch::autograd::AutogradContext* ctx, at::TensorList xs) {
    ctx->save_for_backward(xs.vec());
    return at::zeros({}, xs[0].options());
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list) {
    torch::autograd::variable_list out;
    for (const auto& x : ctx->get_saved_variables())
      out.push_back(at::zeros_like(x));
    return out;
  }
};

}  // namespace

at::Tensor detail::lse_like_out(const at::Tensor& lse, const QKVLayout& l) {
  auto x = l.seq_dim == 2 ? lse : lse.transpose(1, 2);  // BNSD or BSHD
  return x.unsqueeze(-1);
}

at::Tensor detail::lse_to_primitive(const at::Tensor& lse, const QKVLayout& l) {
  auto x = lse.squeeze(-1);
  return l.seq_dim == 2 ? x : x.transpose(1, 2);
}

bool can_split_call(const AttentionCall& call) {
  const auto& l = call.layout();
  const bool layout_ok =
      (l.seq_dim == 2 && l.heads_dim == 1) || (l.seq_dim == 1 && l.heads_dim == 2);
  return layout_ok && !call.options().mask.defined();
}

at::Tensor merge_by_lse(const std::vector<attention::AttentionResult>& parts, const QKVLayout& l) {
  HP_INTERNAL_ASSERT(!parts.empty(), "merge_by_lse: nothing to merge");
  if (parts.size() == 1) return parts[0].out;
  std::vector<at::Tensor> lses;
  for (const auto& p : parts) {
    HP_CHECK(p.lse.defined(),
             "CP attention: the module's attention returned no lse, which a strategy that "
             "merges partial results needs; use a primitive that returns it (math, blockwise)");
    auto x = detail::lse_like_out(p.lse, l);
    lses.push_back(x.scalar_type() == at::kDouble ? x : x.to(at::kFloat));
  }
  auto total = at::logsumexp(at::stack(lses), 0);
  at::Tensor out;
  for (size_t i = 0; i < parts.size(); ++i) {
    auto term = parts[i].out * at::exp(lses[i] - total).to(parts[i].out.scalar_type());
    out = out.defined() ? out + term : term;
  }
  return out;
}

at::Tensor anchored(const at::Tensor& out, const std::vector<at::Tensor>& moved) {
  return out + MovedAnchor::apply(at::TensorList(moved)).to(out.scalar_type());
}

}  // namespace hp::cp
