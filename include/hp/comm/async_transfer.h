// A collective started now and finished later, differentiably: two autograd nodes joined by
// the transfer they share.
//
//   y = start(x)        launches launch(x) (no grad) and returns x unchanged (node A)
//       ... compute that does not need the result runs while it travels ...
//   z = finish(y)       waits and returns the moved tensor (node B)
//   backward            B launches launch_inverse(dz) and returns no gradient; A waits for it
//                       and hands the real gradient to x's producer. The nodes autograd runs
//                       between B and A (those created between start and finish) overlap the
//                       inverse collective.
// start immediately followed by finish is the blocking collective (the sync schedule).
// Contract: finish runs once per start, with the tensor start returned (or the graph between
// them carries no gradient); a transfer back-propagates once.
#pragma once

#include <functional>
#include <memory>
#include <string>

#include <ATen/core/Tensor.h>

#include "hp/comm/comm_handle.h"
#include "hp/comm/group.h"

namespace hp::comm {

// A result in flight: blocks until done and returns it; called once.
using Pending = std::function<at::Tensor()>;
using TransferLaunch = std::function<Pending(const at::Tensor&)>;

// One ring step started now, not differentiable (comm::shift, in flight): the Pending returns
// what rank (rank - offset) mod P sent.
Pending shift_async(Group& group, const at::Tensor& t, int offset);
// One ring step in which only some members take part, each leg on its own: sends `t` to rank
// (rank + offset) mod P where `t` is defined, and receives a tensor shaped like `recv_like`
// from (rank - offset) mod P where that is defined. Every member of the group runs it at the
// same point, and a sender and its receiver must agree on whether that leg runs. The Pending
// waits for the send and returns what arrived (undefined without a receive).
Pending shift_legs_async(Group& group, const at::Tensor& t, const at::Tensor& recv_like,
                         int offset);

// A CommHandle as a Pending (shared so the function stays copyable; a handle dropped unwaited
// still waits in its destructor).
Pending pending(CommHandle handle);
// A launch that returns a CommHandle, as a TransferLaunch.
TransferLaunch handle_launch(std::function<CommHandle(const at::Tensor&)> launch);

struct AsyncTransfer;
using AsyncTransferPtr = std::shared_ptr<AsyncTransfer>;

// Node A: launches launch(x.detach()) and returns x wired to `transfer` (created here).
// `name` appears in messages.
at::Tensor start_transfer(const at::Tensor& x, const std::string& name,
                          const TransferLaunch& launch, const TransferLaunch& launch_inverse,
                          AsyncTransferPtr& transfer);
// start_transfer for collectives that return a CommHandle: transfer_arrived can tell when the
// forward one has landed.
at::Tensor start_handle_transfer(const at::Tensor& x, const std::string& name,
                                 std::function<CommHandle(const at::Tensor&)> launch,
                                 std::function<CommHandle(const at::Tensor&)> launch_inverse,
                                 AsyncTransferPtr& transfer);
// start_handle_transfer whose collective waits for `release` (set here) to launch it: the
// caller orders collectives on the wire differently from the order their inputs are ready.
// release launches once (later calls do nothing); finish_transfer launches first if it has not
// run. Like every collective, the launches must come in the same order on every rank.
at::Tensor start_deferred_transfer(const at::Tensor& x, const std::string& name,
                                   std::function<CommHandle(const at::Tensor&)> launch,
                                   std::function<CommHandle(const at::Tensor&)> launch_inverse,
                                   AsyncTransferPtr& transfer, std::function<void()>& release);
// Node B: waits for the transfer; `emitted` is what start_transfer returned.
at::Tensor finish_transfer(const at::Tensor& emitted, const AsyncTransferPtr& transfer);
// Whether finish_transfer would not block now: the forward collective has landed (or was
// already finished). False while it flies, and always for a plain Pending launch, which cannot
// tell.
bool transfer_arrived(const AsyncTransferPtr& transfer);

// start_transfer + finish_transfer held together.
class InFlight {
 public:
  InFlight(at::Tensor emitted, AsyncTransferPtr transfer)
      : emitted_(std::move(emitted)), transfer_(std::move(transfer)) {}
  at::Tensor wait();  // once
  // Whether wait() would not block now (transfer_arrived).
  bool landed() const { return transfer_arrived(transfer_); }
  // What start returned: compute that should run while the transfer flies (and whose backward
  // should overlap the inverse) consumes this tensor, not the one that was started.
  const at::Tensor& emitted() const { return emitted_; }
  const AsyncTransferPtr& transfer() const { return transfer_; }

 private:
  at::Tensor emitted_;
  AsyncTransferPtr transfer_;
};

// In backward, `then` launches its inverse collective only once `first`'s inverse has been
// waited for (at first's start node), so the two do not share the wire when first's result is
// needed first; if nothing released it by the time then's own result is needed, it launches
// then. Call before backward. Every rank must chain alike (the launch order follows).
void chain_inverse(const InFlight& first, const InFlight& then);

// The differentiable collectives of autograd_collectives.h, started now:
//   all_to_all_start(x, split, concat)  fwd all_to_all(split, concat)  bwd all_to_all(concat,
//   split) all_gather_start(x, dim)            fwd all_gather                 bwd
//   reduce_scatter(sum) shift_start(x, offset)              fwd shift(offset)              bwd
//   shift(-offset)
InFlight all_to_all_start(const at::Tensor& x, int64_t split_dim, int64_t concat_dim,
                          const GroupPtr& group);
InFlight all_gather_start(const at::Tensor& x, int64_t dim, const GroupPtr& group);
InFlight shift_start(const at::Tensor& x, int offset, const GroupPtr& group);

}  // namespace hp::comm
