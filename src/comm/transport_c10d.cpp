// Transport over a c10d backend: Gloo always, NCCL where LibTorch was built with it (tensors
// stay on their device; nothing here allocates on the CPU). Every version difference of the
// c10d API is in common/torch_compat.h. Each call records the bytes it hands the backend for
// other ranks on its PendingOp (PendingOp::bytes_sent).
#include <algorithm>
#include <array>
#include <atomic>
#include <memory>
#include <thread>

#include "hp/comm/transport.h"
#include "hp/common/check.h"
#include "hp/common/torch_compat.h"
#include "hp/common/trace.h"

namespace hp::comm {

std::unique_ptr<PendingOp> Transport::reduce_scatter(at::Tensor /*out*/, at::Tensor /*in*/,
                                                     ReduceOp /*op*/) {
  HP_INTERNAL_ASSERT(false, "reduce_scatter called on backend '", backend_name(),
                     "' which has no native reduce-scatter");
}

std::unique_ptr<PendingOp> Transport::all_to_all_v(at::Tensor /*out*/, at::Tensor /*in*/,
                                                   std::vector<int64_t> /*out_rows*/,
                                                   std::vector<int64_t> /*in_rows*/) {
  HP_CHECK(false, "backend '", backend_name(),
           "' has no all-to-all with variable split sizes (expert parallelism needs it); use "
           "gloo or nccl, or train without --ep");
}

namespace {

c10d::ReduceOp to_c10d(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum:
      return c10d::ReduceOp::SUM;
    case ReduceOp::kMax:
      return c10d::ReduceOp::MAX;
    case ReduceOp::kMin:
      return c10d::ReduceOp::MIN;
    case ReduceOp::kAvg:
      break;
  }
  HP_INTERNAL_ASSERT(false, "kAvg must be lowered to kSum before the transport");
}

int64_t nbytes(const at::Tensor& t) {
  return t.numel() * static_cast<int64_t>(t.element_size());
}

// Bytes of the chunks of `in` [P, ...] that go to ranks other than `me`.
int64_t chunks_for_peers(const at::Tensor& in, int me) {
  return nbytes(in) - nbytes(in[me]);
}

// One work. With `ask_future`, its Future (where the backend offers one) stamps the completion
// time; offers_future() says whether it did.
class C10dPending final : public PendingOp {
 public:
  C10dPending(compat::WorkPtr work, int64_t bytes_sent, bool ask_future) : work_(std::move(work)) {
    set_bytes_sent(bytes_sent);
    done_at_ = std::make_shared<std::atomic<int64_t>>(-1);
    if (!ask_future) return;
    if (auto fut = compat::work_future(work_)) {
      offers_future_ = true;
      auto done_at = done_at_;
      fut->addCallback(
          [done_at](c10::ivalue::Future&) { done_at->store(common::Tracer::now_us()); });
    }
  }
  void wait() override { work_->wait(); }
  bool is_completed() override { return work_->isCompleted(); }
  int64_t completed_at_us() const override { return done_at_->load(); }
  bool offers_future() const { return offers_future_; }

 private:
  compat::WorkPtr work_;
  std::shared_ptr<std::atomic<int64_t>> done_at_;
  bool offers_future_ = false;
};

// Several works that complete together (the point-to-point legs of one collective).
// Gloo's send/recv works report completion only once waited, so with `watch` a thread waits
// for them from the launch on: is_completed() reads its flag (true as soon as they land, with
// no query needed first) and wait() joins it. Dropped unwaited (an exception unwinding past
// it), the operation still joins: at most the group's timeout when a peer is gone (a detached
// thread could outlive the process group its works belong to).
class MultiPending final : public PendingOp {
 public:
  MultiPending(std::vector<compat::WorkPtr> works, int64_t bytes_sent, bool watch)
      : works_(std::move(works)), watch_(watch) {
    set_bytes_sent(bytes_sent);
    if (watch_) {
      watcher_ = std::thread([this] {
        wait_all();
        done_.store(true);
      });
    }
  }
  ~MultiPending() override {
    if (watcher_.joinable()) watcher_.join();
  }
  void wait() override {
    if (watcher_.joinable()) watcher_.join();
    if (!watch_) wait_all();
    if (error_) std::rethrow_exception(error_);
  }
  bool is_completed() override {
    if (watch_) return done_.load();
    bool all = true;
    for (auto& w : works_)
      all = all && w->isCompleted();
    return all;
  }

 private:
  void wait_all() {
    for (auto& w : works_) {
      try {
        w->wait();
      } catch (...) {
        if (!error_) error_ = std::current_exception();
      }
    }
  }
  std::vector<compat::WorkPtr> works_;
  bool watch_ = false;
  std::thread watcher_;
  std::atomic<bool> done_{false};
  std::exception_ptr error_;
};

// Over a c10d backend (what make_c10d_transport creates) or over a c10d::ProcessGroup someone
// else created (make_process_group_transport; the same type in LibTorch 1.x): both have the same
// collective calls.
template <class Backend>
class C10dTransport final : public Transport {
 public:
  C10dTransport(c10::intrusive_ptr<Backend> backend, std::string name, int rank)
      : backend_(std::move(backend)), name_(std::move(name)), rank_(rank) {
    for (auto& offered : futures_offered_)
      offered.store(true);
  }

  std::string backend_name() const override { return name_; }
  bool has_native_reduce_scatter() const override {
    return compat::backend_has_native_reduce_scatter(name_);
  }
  bool reduces_dtype(at::ScalarType t) const override {
    return t == at::kFloat || t == at::kDouble || t == at::kHalf || t == at::kInt ||
           t == at::kLong || t == at::kChar || t == at::kByte ||
           (t == at::kBFloat16 && name_ == "nccl");
  }
  bool moves_dtype(at::ScalarType t) const override { return reduces_dtype(t); }

  std::unique_ptr<PendingOp> all_gather(at::Tensor out, at::Tensor in) override {
    // Direct exchange: the input goes to each peer, each peer's lands in out[peer]; the same
    // (P-1)*n bytes per rank as a ring. Gloo's own allgather in LibTorch 1.13 stages through a
    // flat copy and ran at about a third of this rate here (hp-bench comm, P=2, 16 MiB).
    const int p = static_cast<int>(out.size(0));
    const int me = rank_;
    const int tag = kAllGatherTagBase + static_cast<int>(gather_seq_++ % kAllGatherTagSpan);
    std::vector<compat::WorkPtr> works;
    int64_t sent = 0;
    for (int k = 1; k < p; ++k) {
      const int to = (me + k) % p;
      const int from = (me - k + p) % p;
      std::vector<at::Tensor> s{in};
      works.push_back(backend_->send(s, to, tag));
      sent += nbytes(s[0]);
      std::vector<at::Tensor> r{out[from]};
      works.push_back(backend_->recv(r, from, tag));
    }
    out[me].copy_(in);
    return std::make_unique<MultiPending>(std::move(works), sent, name_ == "gloo");
  }
  std::unique_ptr<PendingOp> all_to_all(at::Tensor out, at::Tensor in) override {
    std::vector<int64_t> equal_splits;
    const int64_t sent = chunks_for_peers(in, rank_);
    return wrap(backend_->alltoall_base(out, in, equal_splits, equal_splits), sent,
                OpKind::kAllToAll);
  }
  std::unique_ptr<PendingOp> all_to_all_v(at::Tensor out, at::Tensor in,
                                          std::vector<int64_t> out_rows,
                                          std::vector<int64_t> in_rows) override {
    const int64_t row = in.size(0) > 0 ? nbytes(in) / in.size(0) : 0;
    int64_t sent = 0;
    for (size_t j = 0; j < in_rows.size(); ++j)
      sent += static_cast<int>(j) == rank_ ? 0 : in_rows[j] * row;
    return wrap(backend_->alltoall_base(out, in, out_rows, in_rows), sent, OpKind::kAllToAll);
  }
  std::unique_ptr<PendingOp> all_reduce(at::Tensor inout, ReduceOp op) override {
    const int64_t sent = nbytes(inout);
    std::vector<at::Tensor> tensors{std::move(inout)};
    c10d::AllreduceOptions opts;
    opts.reduceOp = to_c10d(op);
    return wrap(backend_->allreduce(tensors, opts), sent, OpKind::kAllReduce);
  }
  std::unique_ptr<PendingOp> reduce_scatter(at::Tensor out, at::Tensor in, ReduceOp op) override {
    const int64_t sent = chunks_for_peers(in, rank_);
    std::vector<at::Tensor> outputs{std::move(out)};
    std::vector<std::vector<at::Tensor>> inputs{in.unbind(0)};
    c10d::ReduceScatterOptions opts;
    opts.reduceOp = to_c10d(op);
    return wrap(backend_->reduce_scatter(outputs, inputs, opts), sent, OpKind::kReduceScatter);
  }
  std::unique_ptr<PendingOp> send(at::Tensor t, int dst, int tag) override {
    const int64_t sent = nbytes(t);
    std::vector<at::Tensor> tensors{std::move(t)};
    return wrap(backend_->send(tensors, dst, tag), sent, OpKind::kSend);
  }
  std::unique_ptr<PendingOp> recv(at::Tensor t, int src, int tag) override {
    std::vector<at::Tensor> tensors{std::move(t)};
    return wrap(backend_->recv(tensors, src, tag), 0, OpKind::kRecv);
  }
  std::unique_ptr<PendingOp> barrier() override {
    return wrap(backend_->barrier(), 0, OpKind::kBarrier);
  }

 private:
  // A backend that offers no Future for a kind of work (Gloo's send and recv in LibTorch 1.13)
  // throws a c10::Error when asked, and building one symbolizes a backtrace: milliseconds of CPU
  // against LibTorch's symbol table, which was 6-9% of all CPU in a usp or ring step at P = 4.
  // So each kind is asked until its first refusal, and then no more.
  std::unique_ptr<PendingOp> wrap(compat::WorkPtr work, int64_t sent, OpKind kind) {
    std::atomic<bool>& offered = futures_offered_[static_cast<size_t>(kind)];
    auto pending = std::make_unique<C10dPending>(std::move(work), sent, offered.load());
    if (!pending->offers_future()) offered.store(false);
    return pending;
  }

  // Tags of the all-gather legs live above the user point-to-point tags.
  static constexpr int kAllGatherTagBase = 1 << 30;
  static constexpr int64_t kAllGatherTagSpan = 1 << 20;

  c10::intrusive_ptr<Backend> backend_;
  std::string name_;
  int rank_;
  int64_t gather_seq_ = 0;
  // Per OpKind (kBarrier is the last): whether its works may still offer a Future (wrap).
  std::array<std::atomic<bool>, static_cast<size_t>(OpKind::kBarrier) + 1> futures_offered_;
};

}  // namespace

std::vector<std::string> available_c10d_backends() {
  std::vector<std::string> out{"gloo"};
  if (compat::kHasNccl) out.push_back("nccl");
  return out;
}

std::unique_ptr<Transport> make_c10d_transport(const c10::intrusive_ptr<c10d::Store>& store,
                                               int rank, int size,
                                               const C10dTransportOptions& options) {
  const auto available = available_c10d_backends();
  std::string valid;
  for (const auto& b : available)
    valid += (valid.empty() ? "" : ", ") + b;
  HP_CHECK(std::find(available.begin(), available.end(), options.backend) != available.end(),
           "comm backend '", options.backend, "' is not available in this build; valid: ", valid,
           options.backend == "nccl" ? " (NCCL needs a LibTorch built with CUDA and NCCL)" : "");
  auto backend =
      options.backend == "nccl"
          ? compat::make_nccl_backend(store, rank, size, options.timeout)
          : compat::make_gloo_backend(store, rank, size, options.timeout, options.hostname);
  return std::make_unique<C10dTransport<compat::C10dBackend>>(std::move(backend), options.backend,
                                                              rank);
}

std::unique_ptr<Transport> make_process_group_transport(
    const c10::intrusive_ptr<c10d::ProcessGroup>& process_group) {
  HP_CHECK(process_group, "make_process_group_transport: the process group is null");
  const std::string name = compat::process_group_backend_name(*process_group);
  return std::make_unique<C10dTransport<c10d::ProcessGroup>>(process_group, name,
                                                             process_group->getRank());
}

}  // namespace hp::comm
