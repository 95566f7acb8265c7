// The two nodes of an async differentiable transfer (see the header) and the ready-made starts.
#include "hp/comm/async_transfer.h"

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include "hp/comm/collectives.h"
#include "hp/common/capsule.h"
#include "hp/common/check.h"

namespace hp::comm {

struct AsyncTransfer {
  std::string name;
  Pending forward;
  std::function<bool()> forward_landed;  // null: the launch cannot tell
  TransferLaunch launch_inverse;
  Pending backward;
  bool backward_launched = false;
  // chain_inverse: while set, the finish node holds the gradient instead of launching.
  bool inverse_held = false;
  at::Tensor held_gradient;
  // The transfers whose held inverse this one's backward wait releases.
  std::vector<AsyncTransferPtr> release_after_backward;
};

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

AsyncTransferPtr transfer_of(AutogradContext* ctx) {
  return common::from_capsule<AsyncTransferPtr>(ctx->saved_data["transfer"]);
}

void launch_inverse_now(AsyncTransfer& t, const at::Tensor& gradient) {
  t.backward = t.launch_inverse(gradient);
  t.backward_launched = true;
}

// Lets `t` launch its inverse: now if its finish node already held the gradient, else when
// that node runs.
void release_inverse(AsyncTransfer& t) {
  t.inverse_held = false;
  if (!t.held_gradient.defined()) return;
  auto g = std::move(t.held_gradient);
  t.held_gradient = at::Tensor();
  launch_inverse_now(t, g);
}

// Identity in forward (the caller launched the collective); in backward, waits for the inverse
// collective the finishing node launched and returns the real gradient.
struct StartFn : torch::autograd::Function<StartFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, AsyncTransferPtr t) {
    ctx->set_materialize_grads(false);
    ctx->saved_data["transfer"] = common::to_capsule(std::move(t));
    return x;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto t = transfer_of(ctx);
    HP_INTERNAL_ASSERT(t->backward_launched || t->held_gradient.defined(), "backward of transfer '",
                       t->name,
                       "' reached its start before its finish launched the inverse collective");
    release_inverse(*t);  // still held: nothing released it before its result was needed
    auto real = t->backward();
    t->backward = nullptr;
    for (auto& next : t->release_after_backward)
      release_inverse(*next);
    t->release_after_backward.clear();
    if (grads[0].defined()) real = real + grads[0];  // other uses of the emitted tensor
    return {real, at::Tensor()};
  }
};

// Waits in forward; in backward launches the inverse collective and returns no gradient here.
struct FinishFn : torch::autograd::Function<FinishFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& /*emitted*/,
                            AsyncTransferPtr t) {
    auto out = t->forward();
    t->forward = nullptr;
    ctx->saved_data["transfer"] = common::to_capsule(std::move(t));
    return out;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto t = transfer_of(ctx);
    HP_INTERNAL_ASSERT(!t->backward_launched && !t->held_gradient.defined(), "transfer '", t->name,
                       "' back-propagated twice");
    HP_INTERNAL_ASSERT(grads[0].defined(), "transfer '", t->name, "': undefined gradient");
    if (t->inverse_held) {
      t->held_gradient = grads[0].contiguous();
    } else {
      launch_inverse_now(*t, grads[0].contiguous());
    }
    return {at::Tensor(), at::Tensor()};
  }
};

}  // namespace

Pending shift_async(Group& g, const at::Tensor& t, int offset) {
  const int p = g.size();
  const int to = ((g.rank() + offset) % p + p) % p, from = ((g.rank() - offset) % p + p) % p;
  if (to == g.rank()) {
    auto copy = t.clone();
    return [copy] { return copy; };
  }
  // Both legs in flight together, as comm::shift.
  auto r = std::make_shared<CommHandle>(recv_async(g, t.sizes(), t.options(), from));
  auto s = std::make_shared<CommHandle>(send_async(g, t, to));
  return [r, s] {
    s->wait();
    return r->wait();
  };
}

Pending shift_legs_async(Group& g, const at::Tensor& t, const at::Tensor& recv_like, int offset) {
  const int p = g.size();
  const int to = ((g.rank() + offset) % p + p) % p, from = ((g.rank() - offset) % p + p) % p;
  HP_CHECK(to != g.rank(), "shift_legs_async: offset ", offset, " is a multiple of the size of ",
           g.describe(), ": nothing would travel; skip the call");
  std::shared_ptr<CommHandle> r, s;
  if (recv_like.defined())
    r = std::make_shared<CommHandle>(recv_async(g, recv_like.sizes(), recv_like.options(), from));
  if (t.defined()) s = std::make_shared<CommHandle>(send_async(g, t, to));
  return [r, s] {
    if (s) s->wait();
    return r ? r->wait() : at::Tensor();
  };
}

namespace {

Group& checked(const GroupPtr& g, const char* fn) {
  HP_CHECK(g != nullptr, fn, ": group is null (this rank is not a member of it)");
  return *g;
}

}  // namespace

Pending pending(CommHandle handle) {
  auto h = std::make_shared<CommHandle>(std::move(handle));
  return [h] { return h->wait(); };
}

TransferLaunch handle_launch(std::function<CommHandle(const at::Tensor&)> launch) {
  return [fn = std::move(launch)](const at::Tensor& x) { return pending(fn(x)); };
}

at::Tensor start_transfer(const at::Tensor& x, const std::string& name,
                          const TransferLaunch& launch, const TransferLaunch& launch_inverse,
                          AsyncTransferPtr& transfer) {
  HP_CHECK(x.defined(), "transfer '", name, "': the input tensor is undefined");
  transfer = std::make_shared<AsyncTransfer>();
  transfer->name = name;
  transfer->launch_inverse = launch_inverse;
  {
    at::NoGradGuard no_grad;  // the collective moves data; the two nodes carry autograd
    transfer->forward = launch(x.detach());
  }
  return StartFn::apply(x, transfer);
}

at::Tensor start_handle_transfer(const at::Tensor& x, const std::string& name,
                                 std::function<CommHandle(const at::Tensor&)> launch,
                                 std::function<CommHandle(const at::Tensor&)> launch_inverse,
                                 AsyncTransferPtr& transfer) {
  // The forward handle, shared by the Pending that waits for it and the completion query.
  auto cell = std::make_shared<std::shared_ptr<CommHandle>>();
  TransferLaunch forward = [fn = std::move(launch), cell](const at::Tensor& a) -> Pending {
    auto h = std::make_shared<CommHandle>(fn(a));
    *cell = h;
    return [h] { return h->wait(); };
  };
  auto y = start_transfer(x, name, forward, handle_launch(std::move(launch_inverse)), transfer);
  transfer->forward_landed = [cell] { return *cell != nullptr && (*cell)->is_completed(); };
  return y;
}

at::Tensor start_deferred_transfer(const at::Tensor& x, const std::string& name,
                                   std::function<CommHandle(const at::Tensor&)> launch,
                                   std::function<CommHandle(const at::Tensor&)> launch_inverse,
                                   AsyncTransferPtr& transfer, std::function<void()>& release) {
  // The input and the launch until released; then the handle.
  struct Held {
    at::Tensor input;
    std::function<CommHandle(const at::Tensor&)> launch;
    std::shared_ptr<CommHandle> handle;
    void go() {
      if (handle) return;
      at::NoGradGuard no_grad;
      handle = std::make_shared<CommHandle>(launch(input));
      input = at::Tensor();
      launch = nullptr;
    }
  };
  auto held = std::make_shared<Held>();
  held->launch = std::move(launch);
  TransferLaunch forward = [held](const at::Tensor& a) -> Pending {
    held->input = a;
    return [held] {
      held->go();
      return held->handle->wait();
    };
  };
  auto y = start_transfer(x, name, forward, handle_launch(std::move(launch_inverse)), transfer);
  transfer->forward_landed = [held] { return held->handle && held->handle->is_completed(); };
  release = [held] { held->go(); };
  return y;
}

bool transfer_arrived(const AsyncTransferPtr& transfer) {
  HP_CHECK(transfer != nullptr, "transfer_arrived: no transfer (start it first)");
  if (transfer->forward == nullptr) return true;  // finished already
  return transfer->forward_landed != nullptr && transfer->forward_landed();
}

at::Tensor finish_transfer(const at::Tensor& emitted, const AsyncTransferPtr& transfer) {
  HP_CHECK(transfer != nullptr, "finish_transfer: no transfer (start it first)");
  HP_CHECK(transfer->forward != nullptr, "transfer '", transfer->name, "' finished twice");
  return FinishFn::apply(emitted, transfer);
}

void chain_inverse(const InFlight& first, const InFlight& then) {
  HP_CHECK(first.transfer() != nullptr && then.transfer() != nullptr,
           "chain_inverse: a transfer is missing (start both first)");
  HP_CHECK(!then.transfer()->backward_launched, "chain_inverse: transfer '", then.transfer()->name,
           "' has already launched its inverse; chain before backward");
  then.transfer()->inverse_held = true;
  first.transfer()->release_after_backward.push_back(then.transfer());
}

at::Tensor InFlight::wait() {
  return finish_transfer(emitted_, transfer_);
}

InFlight all_to_all_start(const at::Tensor& x, int64_t split_dim, int64_t concat_dim,
                          const GroupPtr& group) {
  checked(group, "all_to_all_start");
  AsyncTransferPtr t;
  auto y = start_handle_transfer(
      x, "all_to_all",
      [=](const at::Tensor& a) { return all_to_all_async(*group, a, split_dim, concat_dim); },
      [=](const at::Tensor& g) { return all_to_all_async(*group, g, concat_dim, split_dim); }, t);
  return {y, t};
}

InFlight all_gather_start(const at::Tensor& x, int64_t dim, const GroupPtr& group) {
  checked(group, "all_gather_start");
  AsyncTransferPtr t;
  auto y = start_handle_transfer(
      x, "all_gather", [=](const at::Tensor& a) { return all_gather_async(*group, a, dim); },
      [=](const at::Tensor& g) { return reduce_scatter_async(*group, g, dim); }, t);
  return {y, t};
}

InFlight shift_start(const at::Tensor& x, int offset, const GroupPtr& group) {
  checked(group, "shift_start");
  AsyncTransferPtr t;
  auto y = start_transfer(
      x, "shift", [=](const at::Tensor& a) { return shift_async(*group, a, offset); },
      [=](const at::Tensor& g) { return shift_async(*group, g, -offset); }, t);
  return {y, t};
}

}  // namespace hp::comm
