// The c10d transport asks a backend for a work's Future (its completion time) only while that
// kind of work offers one: Gloo's send/recv works in LibTorch 1.13 refuse by throwing a
// c10::Error, whose backtrace cost milliseconds per point-to-point call. A fake process group
// counts the questions.
#include <atomic>

#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include "hp/comm/transport.h"
#include "hp/common/torch_compat.h"

namespace {

struct Asked {
  std::atomic<int> p2p{0}, collective{0};
};

// A finished work; `future` false: getFuture throws as Gloo's send/recv works do.
class FakeWork final : public c10d::Work {
 public:
  FakeWork(bool future, std::atomic<int>& asked) : future_(future), asked_(asked) {}
  bool isCompleted() override { return true; }
  bool wait(std::chrono::milliseconds /*timeout*/) override { return true; }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    ++asked_;
    TORCH_CHECK(future_, "Work::getFuture not implemented (fake)");
    auto f = c10::make_intrusive<c10::ivalue::Future>(c10::NoneType::get());
    f->markCompleted(c10::IValue());
    return f;
  }

 private:
  bool future_;
  std::atomic<int>& asked_;
};

// Send/recv works without a Future, all-reduce works with one (or without, `collective_future`).
class FakeGroup final : public c10d::ProcessGroup {
 public:
  FakeGroup(Asked& asked, bool collective_future)
      : c10d::ProcessGroup(0, 2), asked_(asked), collective_future_(collective_future) {}
  const std::string getBackendName() const override { return "fake"; }
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& /*tensors*/, int /*dst*/,
                                      int /*tag*/) override {
    return c10::make_intrusive<FakeWork>(false, asked_.p2p);
  }
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& /*tensors*/, int /*src*/,
                                      int /*tag*/) override {
    return c10::make_intrusive<FakeWork>(false, asked_.p2p);
  }
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& /*tensors*/,
                                           const c10d::AllreduceOptions& /*opts*/) override {
    return c10::make_intrusive<FakeWork>(collective_future_, asked_.collective);
  }

 private:
  Asked& asked_;
  bool collective_future_;
};

TEST(C10dTransport, PointToPointWorksWithoutAFutureAreAskedOncePerKind) {
  Asked asked;
  auto transport = hp::comm::make_process_group_transport(
      c10::make_intrusive<FakeGroup>(asked, /*collective_future=*/true));
  for (int i = 0; i < 6; ++i) {
    auto s = transport->send(at::ones({4}), 1, i);
    auto r = transport->recv(at::empty({4}), 1, i);
    s->wait();
    r->wait();
    EXPECT_EQ(s->completed_at_us(), -1);
    EXPECT_EQ(r->completed_at_us(), -1);
  }
  EXPECT_EQ(asked.p2p.load(), 2) << "send and recv: each asked until its first refusal";
  // Collectives that offer a Future keep being asked, and are stamped when they complete.
  for (int i = 0; i < 3; ++i) {
    auto op = transport->all_reduce(at::ones({4}), hp::comm::ReduceOp::kSum);
    op->wait();
    EXPECT_GE(op->completed_at_us(), 0);
  }
  EXPECT_EQ(asked.collective.load(), 3);
}

TEST(C10dTransport, CollectivesWithoutAFutureAreAskedOnce) {
  Asked asked;
  auto transport = hp::comm::make_process_group_transport(
      c10::make_intrusive<FakeGroup>(asked, /*collective_future=*/false));
  for (int i = 0; i < 4; ++i) {
    auto op = transport->all_reduce(at::ones({4}), hp::comm::ReduceOp::kSum);
    op->wait();
    EXPECT_EQ(op->completed_at_us(), -1);
  }
  EXPECT_EQ(asked.collective.load(), 1);
  EXPECT_EQ(asked.p2p.load(), 0);
}

}  // namespace
