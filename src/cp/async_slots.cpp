// AsyncSlot plumbing: per role a FIFO of the transfers the handoff points started
// (comm/async_transfer.h: its start node is the handoff's, its finish node the consumer's).
#include "hp/cp/async.h"

#include <algorithm>
#include <limits>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/custom_function.h>

#include "hp/common/capsule.h"
#include "hp/common/check.h"
#include "hp/common/shape.h"

namespace hp::cp {

namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// x's values (an alias: the pieces are x re-laid out for their moves) with the emitted pieces
// as its autograd inputs: its gradient goes to them split as x was.
struct JoinFn : torch::autograd::Function<JoinFn> {
  static at::Tensor forward(AutogradContext* ctx, const at::Tensor& x, at::TensorList pieces,
                            CPRuntimeState::Split split) {
    ctx->set_materialize_grads(false);
    ctx->saved_data["split"] = common::to_capsule(std::move(split));
    ctx->saved_data["pieces"] = static_cast<int64_t>(pieces.size());
    return x;
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const auto n = ctx->saved_data["pieces"].toInt();
    variable_list out(n + 2);  // x, the pieces, the split function
    if (!grads[0].defined()) return out;
    auto split = common::from_capsule<CPRuntimeState::Split>(ctx->saved_data["split"]);
    auto parts = split(grads[0]);
    HP_INTERNAL_ASSERT(static_cast<int64_t>(parts.size()) == n, "the gradient split into ",
                       parts.size(), " pieces, not ", n);
    for (int64_t i = 0; i < n; ++i)
      out[i + 1] = parts[i];
    return out;
  }
};

}  // namespace

at::Tensor CPRuntimeState::produce(
    QKVRole role, const std::string& handoff, const at::Tensor& x, const Split& split,
    const std::function<comm::CommHandle(const at::Tensor&)>& launch,
    const std::function<comm::CommHandle(const at::Tensor&)>& launch_inverse) {
  auto slot = std::make_shared<AsyncSlot>();
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto& q = fifo_[static_cast<int>(role)];
    HP_CHECK(q.empty(), "async CP on module '", module_, "': the slot of handoff '",
             q.empty() ? "" : q.front()->handoff, "' (", role_name(role), ", invocation ",
             q.empty() ? 0 : q.front()->invocation,
             ") was never consumed: a forward ran its handoff point but not its attention "
             "(or failed between them). Every forward that passes a handoff point must reach the "
             "attention call; open the module's forward in AttentionHost::forward_scope(), whose "
             "begin drops what a failed forward left");
    slot->invocation = invocations_[static_cast<int>(role)]++;
  }
  slot->role = role;
  slot->handoff = handoff;
  const auto pieces = split(x);
  HP_INTERNAL_ASSERT(!pieces.empty(), "handoff '", handoff, "': no pieces to move");
  std::vector<at::Tensor> emitted;
  std::vector<std::function<void()>> held;  // the later pieces' launches
  for (size_t i = 0; i < pieces.size(); ++i) {
    slot->transfers.emplace_back();
    const auto name = pieces.size() == 1 ? handoff : common::str_cat(handoff, "[", i, "]");
    if (i == 0) {
      emitted.push_back(
          comm::start_handle_transfer(pieces[i], name, launch, launch_inverse, slot->transfers[i]));
    } else {
      held.emplace_back();
      emitted.push_back(comm::start_deferred_transfer(pieces[i], name, launch, launch_inverse,
                                                      slot->transfers[i], held.back()));
    }
  }
  auto y =
      emitted.size() == 1 ? emitted[0] : JoinFn::apply(x.detach(), at::TensorList(emitted), split);
  if (emitted.size() > 1) slot->pieces = std::move(emitted);
  slot->produced.emplace(y.getIntrusivePtr());
  slot->produced_sizes = y.sizes().vec();
  slot->produced_dtype = y.scalar_type();
  {
    std::lock_guard<std::mutex> lock(mu_);
    fifo_[static_cast<int>(role)].push_back(slot);
    if (!held.empty()) {
      held_.push_back(std::move(held));
      ++first_pieces_unwaited_;
    }
  }
  return y;
}

void CPRuntimeState::release_held() {
  release_through(std::numeric_limits<size_t>::max());
}

void CPRuntimeState::release_through(size_t piece) {
  launch_held(piece);
}

void CPRuntimeState::release_next() {
  launch_held(std::nullopt);
}

void CPRuntimeState::launch_held(std::optional<size_t> through) {
  std::vector<std::function<void()>> release;
  {
    std::lock_guard<std::mutex> lock(mu_);
    release = take_held(through);
  }
  for (auto& r : release)
    r();
}

void CPRuntimeState::first_piece_waited() {
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (first_pieces_unwaited_ > 0) --first_pieces_unwaited_;
    if (first_pieces_unwaited_ > 0 || release_deferred_) return;
  }
  release_held();
}

void CPRuntimeState::defer_release() {
  std::lock_guard<std::mutex> lock(mu_);
  release_deferred_ = true;
}

std::vector<std::function<void()>> CPRuntimeState::take_held(std::optional<size_t> through) {
  // held_ is in handoff order, each handoff's pieces 1.. in order: launch piece 1 of every
  // handoff, then piece 2, ... (every rank computes the same order from the same program order).
  std::vector<std::function<void()>> out;
  size_t max_pieces = 0;
  for (const auto& h : held_)
    max_pieces = std::max(max_pieces, h.size());
  const size_t last = std::min(through.value_or(launched_through_ + 1), max_pieces);
  for (size_t i = launched_through_ + 1; i <= last; ++i) {
    for (auto& h : held_) {
      if (i <= h.size()) out.push_back(std::move(h[i - 1]));
    }
  }
  launched_through_ = std::max(launched_through_, last);
  if (launched_through_ >= max_pieces) {
    held_.clear();
    launched_through_ = 0;
    first_pieces_unwaited_ = 0;
    release_deferred_ = false;
  }
  return out;
}

bool CPRuntimeState::arrived(QKVRole role) const {
  std::lock_guard<std::mutex> lock(mu_);
  const auto& q = fifo_[static_cast<int>(role)];
  if (q.empty()) return false;
  for (const auto& t : q.front()->transfers) {
    if (!comm::transfer_arrived(t)) return false;
  }
  return true;
}

std::vector<comm::InFlight> CPRuntimeState::consume(QKVRole role, const at::Tensor& consumer) {
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
  std::vector<comm::InFlight> out;
  if (slot->pieces.empty()) {
    out.emplace_back(consumer, slot->transfers[0]);
  } else {
    for (size_t i = 0; i < slot->pieces.size(); ++i)
      out.emplace_back(slot->pieces[i], slot->transfers[i]);
    slot->pieces.clear();
  }
  return out;
}

std::vector<std::shared_ptr<AsyncSlot>> CPRuntimeState::take_pending() {
  std::vector<std::shared_ptr<AsyncSlot>> out;
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& q : fifo_) {
    out.insert(out.end(), q.begin(), q.end());
    q.clear();
  }
  held_.clear();  // never launched, on any rank: dropped unlaunched
  launched_through_ = 0;
  first_pieces_unwaited_ = 0;
  release_deferred_ = false;
  return out;
}

void CPRuntimeState::check_drained() {
  std::string pending;
  for (const auto& s : take_pending()) {
    pending += common::str_cat(pending.empty() ? "" : ", ", s->handoff, " (", role_name(s->role),
                               ", invocation ", s->invocation, ")");
  }
  HP_CHECK(pending.empty(), "async CP on module '", module_,
           "': the forward ended with unconsumed handoff slots: ", pending,
           ". Every handoff point that runs must feed the attention call of the same forward");
}

void CPRuntimeState::discard_pending() {
  // The slots die with the returned vector, outside the lock: a launched collective's handle
  // waits for it as it is destroyed (every rank launched it, in the same order, before the
  // forward failed).
  take_pending();
}

size_t CPRuntimeState::pending() const {
  std::lock_guard<std::mutex> lock(mu_);
  return fifo_[0].size() + fifo_[1].size() + fifo_[2].size();
}

}  // namespace hp::cp
