#include "hp/comm/comm_handle.h"

#include <c10/util/Exception.h>

#include "comm_error.h"
#include "hp/comm/group.h"
#include "hp/comm/transport.h"
#include "hp/common/check.h"
#include "hp/common/trace.h"

namespace hp::comm {

namespace detail {

std::string backend_message(const std::exception& e) {
  std::string msg;
  if (auto* ce = dynamic_cast<const c10::Error*>(&e)) {
    msg = ce->what_without_backtrace();
  } else {
    msg = e.what();
  }
  auto nl = msg.find('\n');
  if (nl != std::string::npos) msg.resize(nl);
  return msg;
}

void throw_comm_failure(OpKind op, const Group& group, const std::string& backend,
                        const char* phase) {
  const auto& diagnose = group.context().diagnose_failure;
  throw CommError(common::str_cat(
      op_name(op), " on ", group.describe(), " failed", phase ? " while " : "", phase ? phase : "",
      ": ", backend, diagnose ? common::str_cat(". Diagnosis: ", diagnose()) : std::string(),
      ". A peer rank may have exited, or did not reach this collective within the group "
      "timeout of ",
      group.timeout().count(), " ms"));
}

}  // namespace detail

struct CommHandle::State {
  Group* group = nullptr;
  OpKind op = OpKind::kBarrier;
  int64_t bytes_sent = 0;
  std::unique_ptr<PendingOp> pending;
  std::vector<at::Tensor> buffers;
  Continuation continuation;
  int64_t launched_us = 0;
  bool waited = false;

  // Waits for the backend and records the trace events; throws CommError on failure when
  // `report` (a handle dropped without wait() has no one to report to: it skips the diagnosis,
  // a store probe of up to seconds per handle, which a failed step's unwinding would pay once
  // for every collective still in flight).
  void finish_backend(bool report = true) {
    const int64_t wait_begin = common::Tracer::now_us();
    std::string failure;
    try {
      if (pending) pending->wait();
    } catch (const std::exception& e) {
      failure = detail::backend_message(e);
      if (failure.empty()) failure = "unknown backend error";
    }
    const int64_t wait_end = common::Tracer::now_us();
    auto& ctx = group->context();
    ctx.counters.add_wait(op, group->name(), wait_end - wait_begin);
    if (ctx.tracer && ctx.tracer->enabled()) {
      int64_t done = pending ? pending->completed_at_us() : -1;
      if (done < launched_us || done > wait_end) done = wait_end;
      ctx.tracer->record(
          {op_name(op), "comm", ctx.world_rank, launched_us, done, group->name(), bytes_sent});
      ctx.tracer->record({common::str_cat("wait ", op_name(op)), "comm_wait", ctx.world_rank,
                          wait_begin, wait_end, group->name(), -1});
    }
    pending.reset();
    buffers.clear();
    if (!failure.empty() && report) detail::throw_comm_failure(op, *group, failure);
  }
};

CommHandle::CommHandle() = default;
CommHandle::CommHandle(CommHandle&&) noexcept = default;
CommHandle& CommHandle::operator=(CommHandle&& other) noexcept {
  if (this != &other) {
    if (state_ && !state_->waited) {
      try {
        state_->finish_backend(/*report=*/false);
      } catch (...) {  // nothing to report to: the handle was overwritten without wait()
      }
    }
    state_ = std::move(other.state_);
  }
  return *this;
}

CommHandle::CommHandle(Group& group, OpKind op, int64_t bytes_sent,
                       std::unique_ptr<PendingOp> pending, std::vector<at::Tensor> buffers,
                       Continuation continuation)
    : state_(std::make_unique<State>()) {
  state_->group = &group;
  state_->op = op;
  state_->bytes_sent = bytes_sent;
  state_->pending = std::move(pending);
  state_->buffers = std::move(buffers);
  state_->continuation = std::move(continuation);
  state_->launched_us = common::Tracer::now_us();
}

CommHandle CommHandle::ready(Group& group, OpKind op, at::Tensor result) {
  return CommHandle(group, op, 0, nullptr, {}, [r = std::move(result)] { return r; });
}

CommHandle::~CommHandle() {
  if (state_ && !state_->waited) {
    try {
      state_->finish_backend(/*report=*/false);
    } catch (...) {  // destructors must not throw; the caller chose not to wait
    }
  }
}

at::Tensor CommHandle::wait() {
  HP_CHECK(state_ != nullptr,
           "CommHandle::wait on an empty handle; only handles returned by an *_async "
           "collective can be waited");
  HP_CHECK(!state_->waited, "CommHandle::wait called a second time for ", op_name(state_->op),
           " on ", state_->group->describe(),
           "; a handle can be waited once: keep the tensor the first wait() returned");
  state_->waited = true;
  state_->finish_backend();
  auto fn = std::move(state_->continuation);
  state_->continuation = nullptr;
  return fn ? fn() : at::Tensor();
}

CommHandle CommHandle::then(std::function<at::Tensor(const at::Tensor&)> next) && {
  HP_CHECK(valid(), "CommHandle::then on an empty or already waited handle");
  state_->continuation = [before = std::move(state_->continuation), next = std::move(next)] {
    return next(before ? before() : at::Tensor());
  };
  return std::move(*this);
}

bool CommHandle::valid() const {
  return state_ != nullptr && !state_->waited;
}

bool CommHandle::is_completed() const {
  if (!state_) return false;
  if (state_->waited || !state_->pending) return true;
  return state_->pending->is_completed();
}

}  // namespace hp::comm
