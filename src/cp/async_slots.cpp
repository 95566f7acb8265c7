// AsyncSlot plumbing: per role a FIFO of the transfers the handoff points started
// (comm/async_transfer.h: its start node is the handoff's, its finish node the consumer's).
#include "hp/cp/async.h"

#include <ATen/ATen.h>

#include "hp/common/check.h"
#include "hp/common/shape.h"

namespace hp::cp {

at::Tensor CPRuntimeState::produce(
    QKVRole role, const std::string& handoff, const at::Tensor& x,
    const std::function<comm::CommHandle(const at::Tensor&)>& launch,
    const std::function<comm::CommHandle(const at::Tensor&)>& launch_inverse) {
  auto slot = std::make_shared<AsyncSlot>();
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto& q = fifo_[static_cast<int>(role)];
    HP_CHECK(q.empty(), "async CP on module '", module_, "': the slot of handoff '",
             q.empty() ? "" : q.front()->handoff, "' (", role_name(role), ", invocation ",
             q.empty() ? 0 : q.front()->invocation,
             ") was never consumed: a forward ran its handoff point but not its attention. "
             "Every forward that passes a handoff point must reach the attention call");
    slot->invocation = invocations_[static_cast<int>(role)]++;
  }
  slot->role = role;
  slot->handoff = handoff;
  auto y = comm::start_handle_transfer(x, handoff, launch, launch_inverse, slot->transfer);
  slot->produced.emplace(y.getIntrusivePtr());
  slot->produced_sizes = y.sizes().vec();
  slot->produced_dtype = y.scalar_type();
  std::lock_guard<std::mutex> lock(mu_);
  fifo_[static_cast<int>(role)].push_back(slot);
  return y;
}

bool CPRuntimeState::arrived(QKVRole role) const {
  std::lock_guard<std::mutex> lock(mu_);
  const auto& q = fifo_[static_cast<int>(role)];
  return !q.empty() && comm::transfer_arrived(q.front()->transfer);
}

at::Tensor CPRuntimeState::consume(QKVRole role, const at::Tensor& consumer) {
  std::shared_ptr<AsyncSlot> slot;
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto& q = fifo_[static_cast<int>(role)];
    HP_CHECK(!q.empty(), "async CP on module '", module_, "': attention received ", role_name(role),
             " but no handoff slot is pending for it: the handoff point did "
             "not run in this forward (is it placed on the path to attention?)");
    slot = q.front();
    q.pop_front();
  }
  HP_CHECK(!slot->consumed, "async CP on module '", module_, "': the slot of handoff '",
           slot->handoff, "' (invocation ", slot->invocation, ") was consumed twice");
  slot->consumed = true;
  HP_CHECK(consumer.sizes() == at::IntArrayRef(slot->produced_sizes) &&
               consumer.scalar_type() == slot->produced_dtype,
           "async CP on module '", module_, "': attention received ", role_name(role), " ",
           common::shape_str(consumer.sizes()), " ", c10::toString(consumer.scalar_type()),
           " but handoff '", slot->handoff, "' emitted ", common::shape_str(slot->produced_sizes),
           " ", c10::toString(slot->produced_dtype),
           "; the handoff must be the last transform before attention");
  const c10::TensorImpl* emitted =
      slot->produced ? slot->produced->lock().get() : nullptr;  // null once the tensor died
  HP_CHECK(emitted == consumer.unsafeGetTensorImpl(), "async CP on module '", module_, "': the ",
           role_name(role), " reaching attention is not the tensor handoff '", slot->handoff,
           "' emitted (invocation ", slot->invocation,
           "): something transformed it after the handoff, or the call belongs to another "
           "invocation. Move the handoff point after the last transform");
  slot->produced.reset();
  return comm::finish_transfer(consumer, slot->transfer);
}

void CPRuntimeState::check_drained() {
  std::lock_guard<std::mutex> lock(mu_);
  std::string pending;
  for (auto& q : fifo_) {
    for (const auto& s : q) {
      pending += common::str_cat(pending.empty() ? "" : ", ", s->handoff, " (", role_name(s->role),
                                 ", invocation ", s->invocation, ")");
    }
    q.clear();
  }
  HP_CHECK(pending.empty(), "async CP on module '", module_,
           "': the forward ended with unconsumed handoff slots: ", pending,
           ". Every handoff point that runs must feed the attention call of the same forward");
}

size_t CPRuntimeState::pending() const {
  std::lock_guard<std::mutex> lock(mu_);
  return fifo_[0].size() + fifo_[1].size() + fifo_[2].size();
}

}  // namespace hp::cp
