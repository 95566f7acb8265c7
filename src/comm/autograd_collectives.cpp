// Autograd wrappers over collectives.h: forward runs one collective, backward its inverse.
// The group travels in the autograd context as a capsule that keeps it alive.
#include "hp/comm/autograd_collectives.h"

#include <torch/csrc/autograd/custom_function.h>

#include "hp/comm/collectives.h"
#include "hp/common/capsule.h"
#include "hp/common/check.h"

namespace hp::comm {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

void save_group(AutogradContext* ctx, const GroupPtr& g) {
  ctx->saved_data["group"] = common::to_capsule(g);
}

Group& saved_group(AutogradContext* ctx) {
  // The capsule in ctx keeps the group alive; the reference stays valid with it.
  return *common::from_capsule<GroupPtr>(ctx->saved_data["group"]);
}

Group& checked(const GroupPtr& g, const char* fn) {
  HP_CHECK(g != nullptr, fn, ": group is null (this rank is not a member of it)");
  return *g;
}

struct AllGatherFn : torch::autograd::Function<AllGatherFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t dim, GroupPtr g) {
    save_group(ctx, g);
    ctx->saved_data["dim"] = dim;
    return all_gather(*g, x, dim);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto dx = reduce_scatter(saved_group(ctx), grads[0], ctx->saved_data["dim"].toInt());
    return {dx, at::Tensor(), at::Tensor()};
  }
};

struct ReduceScatterFn : torch::autograd::Function<ReduceScatterFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t dim, GroupPtr g) {
    save_group(ctx, g);
    ctx->saved_data["dim"] = dim;
    return reduce_scatter(*g, x, dim);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto dx = all_gather(saved_group(ctx), grads[0], ctx->saved_data["dim"].toInt());
    return {dx, at::Tensor(), at::Tensor()};
  }
};

// all_to_all(split, concat) forward; all_to_all(concat, split) backward.
struct AllToAllFn : torch::autograd::Function<AllToAllFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t split_dim,
                            int64_t concat_dim, GroupPtr g) {
    save_group(ctx, g);
    ctx->saved_data["split"] = split_dim;
    ctx->saved_data["concat"] = concat_dim;
    return all_to_all(*g, x, split_dim, concat_dim);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto dx = all_to_all(saved_group(ctx), grads[0], ctx->saved_data["concat"].toInt(),
                         ctx->saved_data["split"].toInt());
    return {dx, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// Variable rows: all_to_all_v(send, recv) forward; all_to_all_v(recv, send) of the gradient.
struct AllToAllVFn : torch::autograd::Function<AllToAllVFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, std::vector<int64_t> send,
                            std::vector<int64_t> recv, GroupPtr g) {
    save_group(ctx, g);
    ctx->saved_data["send"] = send;
    ctx->saved_data["recv"] = recv;
    return all_to_all_v(*g, x, send, recv);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto dx = all_to_all_v(saved_group(ctx), grads[0], ctx->saved_data["recv"].toIntVector(),
                           ctx->saved_data["send"].toIntVector());
    return {dx, at::Tensor(), at::Tensor(), at::Tensor()};
  }
};

// all_reduce(sum) forward, identity backward (e.g. after a row-parallel matmul).
struct AllReduceForwardFn : torch::autograd::Function<AllReduceForwardFn> {
  static at::Tensor forward(AutogradContext*, const at::Tensor& x, GroupPtr g) {
    return all_reduce(*g, x.contiguous());
  }
  static variable_list backward(AutogradContext*, variable_list grads) {
    return {grads[0], at::Tensor()};
  }
};

// identity forward, all_reduce(sum) backward (e.g. before a column-parallel matmul).
struct AllReduceBackwardFn : torch::autograd::Function<AllReduceBackwardFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, GroupPtr g) {
    save_group(ctx, g);
    return x.view_as(x);
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    return {all_reduce(saved_group(ctx), grads[0].contiguous()), at::Tensor()};
  }
};

struct ExchangeFn : torch::autograd::Function<ExchangeFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t peer, GroupPtr g) {
    save_group(ctx, g);
    ctx->saved_data["peer"] = peer;
    return exchange(*g, x, static_cast<int>(peer));
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto dx = exchange(saved_group(ctx), grads[0].contiguous(),
                       static_cast<int>(ctx->saved_data["peer"].toInt()));
    return {dx, at::Tensor(), at::Tensor()};
  }
};

struct ShiftFn : torch::autograd::Function<ShiftFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, int64_t offset, GroupPtr g) {
    save_group(ctx, g);
    ctx->saved_data["offset"] = offset;
    return shift(*g, x, static_cast<int>(offset));
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto dx = shift(saved_group(ctx), grads[0].contiguous(),
                    -static_cast<int>(ctx->saved_data["offset"].toInt()));
    return {dx, at::Tensor(), at::Tensor()};
  }
};

void check_seq_head(const at::Tensor& x, int64_t& seq_dim, int64_t& head_dim, const char* fn) {
  HP_CHECK(x.defined(), fn, ": the input tensor is undefined");
  const int64_t nd = x.dim();
  HP_CHECK(seq_dim >= -nd && seq_dim < nd && head_dim >= -nd && head_dim < nd, fn,
           ": seq_dim=", seq_dim, " head_dim=", head_dim, " out of range for a ", nd, "-d tensor");
  if (seq_dim < 0) seq_dim += nd;
  if (head_dim < 0) head_dim += nd;
  HP_CHECK(seq_dim != head_dim, fn, ": seq_dim and head_dim are both ", seq_dim,
           "; they must name different dims (e.g. BNSD: seq_dim=2, head_dim=1)");
}

}  // namespace

at::Tensor all_gather_autograd(const at::Tensor& x, int64_t dim, const GroupPtr& group) {
  checked(group, "all_gather_autograd");
  return AllGatherFn::apply(x, dim, group);
}

at::Tensor reduce_scatter_autograd(const at::Tensor& x, int64_t dim, const GroupPtr& group) {
  checked(group, "reduce_scatter_autograd");
  return ReduceScatterFn::apply(x, dim, group);
}

at::Tensor ulysses_seq_to_head(const at::Tensor& x, int64_t seq_dim, int64_t head_dim,
                               const GroupPtr& group) {
  checked(group, "ulysses_seq_to_head");
  check_seq_head(x, seq_dim, head_dim, "ulysses_seq_to_head");
  return AllToAllFn::apply(x, head_dim, seq_dim, group);
}

at::Tensor ulysses_head_to_seq(const at::Tensor& x, int64_t seq_dim, int64_t head_dim,
                               const GroupPtr& group) {
  checked(group, "ulysses_head_to_seq");
  check_seq_head(x, seq_dim, head_dim, "ulysses_head_to_seq");
  return AllToAllFn::apply(x, seq_dim, head_dim, group);
}

at::Tensor all_reduce_forward(const at::Tensor& x, const GroupPtr& group) {
  checked(group, "all_reduce_forward");
  if (group->size() == 1) return x;
  return AllReduceForwardFn::apply(x, group);
}

at::Tensor all_reduce_backward(const at::Tensor& x, const GroupPtr& group) {
  checked(group, "all_reduce_backward");
  if (group->size() == 1) return x;
  return AllReduceBackwardFn::apply(x, group);
}

at::Tensor all_to_all_v_autograd(const at::Tensor& x, const std::vector<int64_t>& send_rows,
                                 const std::vector<int64_t>& recv_rows, const GroupPtr& group) {
  checked(group, "all_to_all_v_autograd");
  return AllToAllVFn::apply(x, send_rows, recv_rows, group);
}

at::Tensor p2p_exchange(const at::Tensor& x, int peer, const GroupPtr& group) {
  checked(group, "p2p_exchange");
  return ExchangeFn::apply(x, static_cast<int64_t>(peer), group);
}

at::Tensor ring_shift(const at::Tensor& x, int offset, const GroupPtr& group) {
  checked(group, "ring_shift");
  return ShiftFn::apply(x, static_cast<int64_t>(offset), group);
}

}  // namespace hp::comm
